// How long a thread has waited for a CPU while it could have run: the second field of Linux's
// /proc/thread-self/schedstat (proc(5): "time spent waiting on a runqueue", in nanoseconds,
// since the thread started). On cores shared with other busy work the engine thread and its
// OpenMP workers lose their CPUs in the middle of a step, and each of the step's hundreds of
// parallel regions then waits for whichever worker is off its core: one busy loop on one of two
// cores cost the daemon 4-5.7x its images/s (docs/results-serving.md, "Cores shared with other
// work"). The engine thread's wait over its steps says so, where the step times alone could as
// well be a slower device.
//
// Standard library and POSIX only.
#pragma once

#include <optional>
#include <string>

namespace imagegen {

// The run-queue wait in seconds from the text of a schedstat file ("<on cpu ns> <waiting ns>
// <timeslices>"); nullopt when it is not three numbers.
std::optional<double> ParseRunQueueWaitSeconds(const std::string& schedstat);

// The calling thread's run-queue wait since its previous call (0 at its first), in seconds. Its
// file stays open per thread (one pread a call, a few microseconds). nullopt where it cannot be
// read: not Linux, or a kernel without CONFIG_SCHED_INFO (then never tried again on that
// thread). `path` replaces /proc/thread-self/schedstat on the thread's first call (tests).
std::optional<double> RunQueueWaitSinceLastCall(const char* path = nullptr);

}  // namespace imagegen
