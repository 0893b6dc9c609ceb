// ThreadGovernor: the engine thread's intra-op thread count, following the CPU it gets.
//
// On cores shared with other busy work the OpenMP workers of a step lose their CPUs, and each
// of a step's hundreds of parallel regions waits for whichever worker is off its core: on the
// 2-core VM one busy loop cost the daemon 4.1-5.7x its images/s, and one thread in place of two
// served 3-5x the default under it, where on a quiet machine one thread costs 0.4-0.8x
// (docs/results-serving.md, "Cores shared with other work"). The governor takes the signal that
// tells the two cases apart, the engine thread's run-queue wait as a share of its step time
// (engine/util/run_queue_wait.h: 0.00-0.01 quiet at 1-16 clients, 0.34-0.40 beside the busy
// loop), and halves the count when the share reaches `lower_share`. A lowered count no longer
// sees the contention it avoids (one thread beside the loop waited 0.00-0.01), so it cannot
// tell when the other work has gone: after `first_probe_seconds` it tries the count above for
// one window, keeps it if the share stays below `lower_share`, and otherwise goes back down and
// waits twice as long before the next try (up to `max_probe_seconds`). Sooner where the engine
// says how many of its CPUs sat idle (engine/util/cpu_idle.h): once they would hold the threads
// a try adds (`idle_try_share` of a CPU each), the other work has left them, and the try starts
// at the window's end. A try counts as held once the count above lasts `first_probe_seconds`;
// one that goes back down sooner (a share that hovers about `lower_share`: 0.13-0.25 per window
// under the daemon's own streaming load on 2 cores) failed, and the waits double as for a try
// that failed at once, the idle-started tries' too, so the count does not follow the share's
// noise up and down every few seconds.
//
// A lowering must also pay: where the engine gives each step's time as calibrated at start on a
// quiet machine (`work`), a window's slowness is its step time over that, and the first window
// at the lower count must be at least `verify_margin` less slow than the window that lowered it.
// Beside a busy loop one thread serves 2.2-4.5x two threads' images/s, and the lowerings pay
// and stay; under the daemon's own streaming load (previews of every step at 16 clients, the load
// client on the same 2 cores) the share crossed 0.2 while one thread served 6.5-6.7 images/s
// against two threads' 7.7-8.1. Where it does not pay the count goes back up at once and no
// lowering comes for `first_probe_seconds`, doubling (up to `max_probe_seconds`) while lowerings
// keep not paying.
//
// Only counts whose forwards give the same bits as the engine's own count may be listed (the
// engine checks that at start), so what a seed draws does not depend on the load.
//
// Pure logic over the numbers it is given (no clock, no LibTorch): the engine thread feeds it
// each step and applies its count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace imagegen {

struct ThreadGovernorOptions {
  // The counts it may run at, the engine's own (the most) first, then each lower one it may
  // step down to, in descending order. One count: it never changes.
  std::vector<int> counts;
  // The run-queue wait's share of step time, over a window, that lowers the count.
  double lower_share = 0.2;
  // A window: at least this much step time and this many steps (a look at the share each).
  double window_seconds = 1.0;
  int64_t window_steps = 16;
  // After lowering, the wall-clock wait before trying the count above; each failed try doubles
  // it, up to max_probe_seconds; a try that holds for first_probe_seconds resets it (one that
  // goes back down sooner failed).
  double first_probe_seconds = 30;
  double max_probe_seconds = 600;
  // Idle CPUs per thread the try would add that start it before its time (0: never); and, after
  // a try that went back down, the least wait before such a try, doubled for each further
  // idle-started try in a row that failed (up to max_probe_seconds).
  double idle_try_share = 0.75;
  double idle_try_gap_seconds = 5;
  // How much less slow the first window at a lowered count must be than the window that
  // lowered it (0.05: 5%); negative: lowerings are not checked. Checked only where steps come
  // with their calibrated time.
  double verify_margin = 0.05;
};

// Descending halvings of `threads` down to 1 (8 -> 8, 4, 2, 1; 6 -> 6, 3, 1; 1 -> 1).
std::vector<int> HalvingThreadCounts(int threads);

// Empty when the options hold, else what is wrong, naming the field.
std::string ValidateThreadGovernorOptions(const ThreadGovernorOptions& o);

class ThreadGovernor {
 public:
  explicit ThreadGovernor(ThreadGovernorOptions o);

  // One step: its wall time, the engine thread's run-queue wait since its previous step
  // (negative: unknown; such a step is not counted), and `now` (seconds on a monotonic clock).
  // `idle_cpus`: the idle CPUs on average over the time since the engine's previous reading
  // (negative: none this step). A window's idle CPUs are the mean of its readings (the engine
  // takes them at even intervals), so work that comes and goes within a window counts for the
  // share of the window it held its CPU, not for whether the last reading caught it asleep.
  // `work_seconds`: the step's time as calibrated at start (<= 0: unknown; such a step does not
  // count for the slowness). Returns the count the engine thread runs its next step at.
  int Observe(double step_seconds, double wait_seconds, double now, double idle_cpus = -1,
              double work_seconds = -1);

  int threads() const { return o_.counts[level_]; }
  int max_threads() const { return o_.counts.front(); }
  // Changes so far: down (contention, or a try that did not hold) and up (tries).
  int64_t lowered() const { return lowered_; }
  int64_t raised() const { return raised_; }
  // Tries of the count above that went back down, and tries started by idle CPUs.
  int64_t failed_tries() const { return failed_tries_; }
  int64_t idle_tries() const { return idle_tries_; }
  // The share of the last complete window (-1: none yet).
  double last_share() const { return last_share_; }
  // The mean idle reading of the last complete window (-1: none).
  double window_idle() const { return window_idle_; }
  // Whether the count now is a try (its first window decides).
  bool trying() const { return trying_; }
  // The least wait now after a failed try before an idle-started one.
  double idle_try_gap() const;
  // Lowerings that did not pay and went back up; the slowness of the last complete window and
  // of the window that made the last lowering (-1: unknown); and until when (the clock's
  // seconds) no lowering comes.
  int64_t reverted() const { return reverted_; }
  double last_slowness() const { return last_slowness_; }
  double slowness_before() const { return slow_before_; }
  double no_lowering_until() const { return hold_until_; }

 private:
  ThreadGovernorOptions o_;
  size_t level_ = 0;  // index into o_.counts
  bool trying_ = false;
  bool idle_try_ = false;      // whether the try (or the count it held at) was started by idle CPUs
  double held_at_ = -1;        // when a try held, until the count above lasts first_probe_seconds
  int64_t idle_failures_ = 0;  // idle-started tries in a row that failed
  bool verifying_ = false;     // the window now is a lowered count's first
  double slow_before_ = -1, last_slowness_ = -1;
  double hold_until_ = -1e300, hold_wait_ = 0;
  int64_t reverted_ = 0;
  double work_s_ = 0, work_step_s_ = 0;  // this window's calibrated and measured time
  double probe_wait_ = 0, next_probe_ = 0;
  double step_s_ = 0, wait_s_ = 0;
  int64_t steps_ = 0;
  int64_t lowered_ = 0, raised_ = 0, failed_tries_ = 0, idle_tries_ = 0;
  double last_share_ = -1;
  double idle_sum_ = 0;  // this window's idle readings
  int64_t idle_readings_ = 0;
  double window_idle_ = -1;
  double last_failed_ = -1e300;  // when the last try went back down
};

}  // namespace imagegen
