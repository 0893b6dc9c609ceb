#include "engine/util/run_queue_wait.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace imagegen {

std::optional<double> ParseRunQueueWaitSeconds(const std::string& schedstat) {
  const char* p = schedstat.c_str();
  uint64_t field[3];
  for (uint64_t& f : field) {
    while (*p == ' ') ++p;
    if (*p < '0' || *p > '9') return std::nullopt;
    char* end = nullptr;
    errno = 0;
    f = std::strtoull(p, &end, 10);
    if (errno != 0) return std::nullopt;
    p = end;
  }
  while (*p == ' ' || *p == '\n') ++p;
  if (*p != '\0') return std::nullopt;
  return static_cast<double>(field[1]) * 1e-9;
}

namespace {

// One thread's open schedstat file and its last reading.
struct ThreadReader {
  int fd = -1;
  bool unreadable = false;
  double last = -1;
  ~ThreadReader() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

std::optional<double> RunQueueWaitSinceLastCall(const char* path) {
  thread_local ThreadReader r;
  if (r.unreadable) return std::nullopt;
  if (r.fd < 0) {
    r.fd = open(path != nullptr ? path : "/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    if (r.fd < 0) {
      r.unreadable = true;
      return std::nullopt;
    }
  }
  char buf[128];
  const ssize_t n = pread(r.fd, buf, sizeof(buf) - 1, 0);
  const std::optional<double> now =
      n > 0 ? ParseRunQueueWaitSeconds(std::string(buf, static_cast<size_t>(n))) : std::nullopt;
  if (!now) return std::nullopt;
  const double since = r.last < 0 ? 0 : std::max(0.0, *now - r.last);
  r.last = *now;
  return since;
}

}  // namespace imagegen
