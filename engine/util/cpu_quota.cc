#include "engine/util/cpu_quota.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <sys/stat.h>

namespace imagegen {
namespace {

bool IsDir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::optional<std::string> FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

// A positive quota over a positive period, or nullopt ("max", -1, unreadable, malformed).
std::optional<double> Ratio(const std::string& quota, const std::string& period) {
  try {
    size_t a = 0, b = 0;
    const double q = std::stod(quota, &a), p = std::stod(period, &b);
    if (a != quota.size() || b != period.size() || !(q > 0) || !(p > 0) || !std::isfinite(q / p)) {
      return std::nullopt;
    }
    return q / p;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::optional<double> V2(const std::string& dir) {
  const std::optional<std::string> line = FirstLine(dir + "/cpu.max");
  if (!line) return std::nullopt;
  std::istringstream s(*line);
  std::string quota, period;
  if (!(s >> quota >> period)) return std::nullopt;
  return Ratio(quota, period);
}

std::optional<double> V1(const std::string& dir) {
  const std::optional<std::string> quota = FirstLine(dir + "/cpu.cfs_quota_us");
  const std::optional<std::string> period = FirstLine(dir + "/cpu.cfs_period_us");
  if (!quota || !period) return std::nullopt;
  return Ratio(*quota, *period);
}

// The smallest quota from mount + path up to mount, reading each level with `read` (levels that
// do not exist read as none: in a container the path is the host's, and the mount's root holds
// the limit).
template <typename Read>
void Walk(const std::string& mount, std::string path, Read read, std::optional<CpuQuota>* best) {
  if (!IsDir(mount)) return;
  while (!path.empty() && path.back() == '/') path.pop_back();
  while (true) {
    const std::string dir = mount + path;
    if (std::optional<double> cpus = read(dir); cpus && (!*best || *cpus < (*best)->cpus)) {
      *best = CpuQuota{*cpus, dir};
    }
    if (path.empty()) break;
    path.erase(path.rfind('/'));
  }
}

}  // namespace

std::optional<CpuQuota> ReadCpuQuota(const std::string& root) {
  std::ifstream in(root + "/proc/self/cgroup");
  std::optional<CpuQuota> best;
  std::string line;
  while (std::getline(in, line)) {
    // hierarchy-id:controllers:path
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (path.empty() || path[0] != '/') continue;
    const std::string cg = root + "/sys/fs/cgroup";
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      // v2's unified hierarchy: at /sys/fs/cgroup, or /sys/fs/cgroup/unified beside v1's
      // (Walk skips a mount that does not exist).
      Walk(cg, path, V2, &best);
      Walk(cg + "/unified", path, V2, &best);
      continue;
    }
    if (("," + controllers + ",").find(",cpu,") == std::string::npos) continue;
    // v1's cpu controller, mounted under its hierarchy's name ("cpu,cpuacct") and, on most
    // systems, its alias "cpu" too.
    Walk(cg + "/" + controllers, path, V1, &best);
    if (controllers != "cpu") Walk(cg + "/cpu", path, V1, &best);
  }
  return best;
}

int64_t ThreadsUnderQuota(int64_t threads, double cpus) {
  if (!(cpus > 0) || !std::isfinite(cpus)) return threads;
  const auto cap = std::max<int64_t>(1, static_cast<int64_t>(std::floor(cpus)));
  return std::min(threads, cap);
}

}  // namespace imagegen
