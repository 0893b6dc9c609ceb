// The CPU time a process may use by its cgroup's CFS quota: Docker's --cpus, a Kubernetes CPU
// limit, systemd's CPUQuota. LibTorch sizes its intra-op threads by the CPUs the process may run
// on (its affinity mask), not by the quota, so a daemon limited to 2 CPUs on a 64-core host runs
// 64 OpenMP threads that wait on each other at every one of a step's hundreds of parallel
// regions while the quota throttles them. The engine caps its threads by this (EngineOptions::
// cpu_threads).
//
// Standard library only. Written here rather than taken from a library: no Debian package reads
// the quota (libcgroup manages cgroups, and is more than two files' parsing).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace imagegen {

struct CpuQuota {
  double cpus = 0;   // quota / period
  std::string file;  // where it was read (the smallest along the path, when several are set)
};

// The smallest CFS quota along this process's cgroup path, from its own cgroup up to the
// hierarchy's root, in cgroup v2 (cpu.max: "max 100000" or "200000 100000") or v1 (the cpu
// controller's cpu.cfs_quota_us, -1 for none, and cpu.cfs_period_us). Where the path that
// /proc/self/cgroup names does not exist under the mount (a container that sees the host's
// path), its levels read as none and the mount's root, where the runtime set the limit, is
// read. nullopt where no quota is set or none can be read. `root` prefixes every path (tests
// give a made-up tree).
std::optional<CpuQuota> ReadCpuQuota(const std::string& root = "");

// The intra-op threads for a process that would run `threads` under a quota of `cpus`: at most
// the quota, rounded down (a thread over the quota is throttled while the others wait for it at
// the next barrier), at least 1, never more than `threads`.
int64_t ThreadsUnderQuota(int64_t threads, double cpus);

}  // namespace imagegen
