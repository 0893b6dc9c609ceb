// How many of the CPUs this process may run on sat idle: /proc/stat's per-CPU idle and iowait
// ticks (proc(5)), summed over the process's affinity mask, per second of wall time. The thread
// governor (engine/scheduler/thread_governor.h) lowers the engine's intra-op threads while other
// work holds its cores; at the lowered count the engine thread no longer waits for a CPU, so its
// own wait cannot say when that work has gone. Idle CPUs beside it can: one busy loop on one of
// two cores leaves about none idle while the engine runs one thread, and once the loop ends the
// core it held is idle.
//
// Standard library and POSIX only. Written here rather than taken from a library: it reads two
// numbers from each of a few lines, and the engine links nothing but LibTorch (so that it builds
// on a GPU host that has only LibTorch and CUDA); procps' libproc2 would be its first other
// library. A CPU of the mask without a line (taken offline) makes every reading nullopt.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace imagegen {

// The idle and iowait ticks of the CPUs in `cpus` (their "cpuN" lines), summed; nullopt when
// the text has none of them or a listed CPU's line is malformed.
std::optional<uint64_t> ParseIdleTicks(const std::string& proc_stat, const std::vector<int>& cpus);

// The CPUs the calling thread may run on (sched_getaffinity); empty where that fails.
std::vector<int> AllowedCpus();

class CpuIdleMeter {
 public:
  // `path` replaces /proc/stat and `cpus` the affinity mask (tests).
  explicit CpuIdleMeter(std::string path = "/proc/stat", std::vector<int> cpus = AllowedCpus());
  // The idle CPUs on average (idle CPU-seconds per second) between the previous call and this
  // one, at `now` seconds on a monotonic clock; nullopt at the first call, where the file cannot
  // be read, or when `now` has not moved.
  std::optional<double> IdleCpusSinceLastCall(double now);

 private:
  std::string path_;
  std::vector<int> cpus_;
  double ticks_per_second_;
  std::optional<uint64_t> last_ticks_;
  double last_now_ = 0;
};

}  // namespace imagegen
