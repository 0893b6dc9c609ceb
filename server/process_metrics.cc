#include "server/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "engine/util/read_file.h"

namespace imagegen::server {

std::optional<ProcStat> ParseProcStat(const std::string& text) {
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  // Field 3 (state) onwards; field k is at index k - 3.
  std::istringstream in(text.substr(close + 1));
  std::vector<std::string> f;
  for (std::string w; in >> w;) f.push_back(w);
  if (f.size() < 22) return std::nullopt;
  auto u64 = [&](int field, uint64_t* out) {
    const std::string& s = f[static_cast<size_t>(field - 3)];
    char* end = nullptr;
    *out = std::strtoull(s.c_str(), &end, 10);
    return !s.empty() && *end == '\0' && s[0] != '-';
  };
  ProcStat st;
  uint64_t rss = 0;
  if (!u64(14, &st.utime_ticks) || !u64(15, &st.stime_ticks) || !u64(22, &st.start_ticks) ||
      !u64(23, &st.vsize_bytes) || !u64(24, &rss)) {
    return std::nullopt;
  }
  st.rss_pages = static_cast<int64_t>(rss);
  return st;
}

std::optional<int64_t> ParseBootTime(const std::string& proc_stat) {
  std::istringstream in(proc_stat);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("btime ", 0) == 0) {
      char* end = nullptr;
      const long long v = std::strtoll(line.c_str() + 6, &end, 10);
      if (end != line.c_str() + 6 && v > 0) return static_cast<int64_t>(v);
    }
  }
  return std::nullopt;
}

namespace {

prometheus::MetricFamily One(const char* name, const char* help, prometheus::MetricType type,
                             double value) {
  prometheus::MetricFamily f{name, help, type, {}};
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(m);
  return f;
}

// Entries of /proc/self/fd, less the one this count holds open; -1 when it cannot be read.
int64_t OpenFds() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int64_t n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') n += 1;
  }
  ::closedir(d);
  return n - 1;
}

}  // namespace

std::vector<prometheus::MetricFamily> ProcessMetrics::Collect() const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  const long ticks = ::sysconf(_SC_CLK_TCK);
  const long page = ::sysconf(_SC_PAGESIZE);
  StatusOr<std::string> text = ReadFile("/proc/self/stat", 1 << 16);
  const std::optional<ProcStat> st = text.ok() ? ParseProcStat(*text) : std::nullopt;
  if (st.has_value() && ticks > 0) {
    out.push_back(
        One("process_cpu_seconds_total",
            "CPU time the process has used (user and system), in seconds", MetricType::Counter,
            static_cast<double>(st->utime_ticks + st->stime_ticks) / static_cast<double>(ticks)));
    StatusOr<std::string> stat = ReadFile("/proc/stat", 1 << 22);
    if (const auto boot = stat.ok() ? ParseBootTime(*stat) : std::nullopt; boot.has_value()) {
      out.push_back(One("process_start_time_seconds", "When the process started, in Unix seconds",
                        MetricType::Gauge,
                        static_cast<double>(*boot) +
                            static_cast<double>(st->start_ticks) / static_cast<double>(ticks)));
    }
  }
  if (st.has_value()) {
    out.push_back(One("process_virtual_memory_bytes", "The process's virtual memory, in bytes",
                      MetricType::Gauge, static_cast<double>(st->vsize_bytes)));
    if (page > 0) {
      out.push_back(One("process_resident_memory_bytes",
                        "The process's memory resident in RAM, in bytes", MetricType::Gauge,
                        static_cast<double>(st->rss_pages) * page));
    }
  }
  if (const int64_t fds = OpenFds(); fds >= 0) {
    out.push_back(One("process_open_fds", "File descriptors the process has open",
                      MetricType::Gauge, static_cast<double>(fds)));
  }
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    out.push_back(One("process_max_fds",
                      "The most file descriptors the process may open (RLIMIT_NOFILE)",
                      MetricType::Gauge, static_cast<double>(lim.rlim_cur)));
  }
  return out;
}

}  // namespace imagegen::server
