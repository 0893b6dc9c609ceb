#include "engine/util/cpu_idle.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace imagegen {

std::optional<uint64_t> ParseIdleTicks(const std::string& proc_stat, const std::vector<int>& cpus) {
  std::istringstream in(proc_stat);
  std::string line;
  uint64_t total = 0;
  size_t found = 0;
  while (std::getline(in, line)) {
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 || line[3] < '0' || line[3] > '9') continue;
    char* end = nullptr;
    const long cpu = std::strtol(line.c_str() + 3, &end, 10);
    if (std::find(cpus.begin(), cpus.end(), static_cast<int>(cpu)) == cpus.end()) continue;
    // user nice system idle iowait ...: the fourth and fifth numbers.
    uint64_t field[5];
    const char* p = end;
    for (uint64_t& f : field) {
      while (*p == ' ') ++p;
      if (*p < '0' || *p > '9') return std::nullopt;
      errno = 0;
      f = std::strtoull(p, &end, 10);
      if (errno != 0) return std::nullopt;
      p = end;
    }
    total += field[3] + field[4];
    found += 1;
  }
  if (found == 0 || found != cpus.size()) return std::nullopt;
  return total;
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

CpuIdleMeter::CpuIdleMeter(std::string path, std::vector<int> cpus)
    : path_(std::move(path)), cpus_(std::move(cpus)) {
  const long hz = sysconf(_SC_CLK_TCK);
  ticks_per_second_ = hz > 0 ? static_cast<double>(hz) : 100.0;
}

std::optional<double> CpuIdleMeter::IdleCpusSinceLastCall(double now) {
  std::ifstream f(path_);
  if (!f || cpus_.empty()) return std::nullopt;
  std::stringstream text;
  text << f.rdbuf();
  const std::optional<uint64_t> ticks = ParseIdleTicks(text.str(), cpus_);
  if (!ticks) return std::nullopt;
  std::optional<double> idle;
  if (last_ticks_ && now > last_now_ && *ticks >= *last_ticks_) {
    idle = static_cast<double>(*ticks - *last_ticks_) / ticks_per_second_ / (now - last_now_);
  }
  last_ticks_ = ticks;
  last_now_ = now;
  return idle;
}

}  // namespace imagegen
