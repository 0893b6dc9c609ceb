#include "engine/scheduler/thread_governor.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace imagegen {

std::vector<int> HalvingThreadCounts(int threads) {
  std::vector<int> counts;
  for (int t = std::max(threads, 1); t >= 1; t /= 2) {
    counts.push_back(t);
    if (t == 1) break;
  }
  return counts;
}

std::string ValidateThreadGovernorOptions(const ThreadGovernorOptions& o) {
  if (o.counts.empty()) return "counts: must list at least the engine's own count";
  for (size_t i = 0; i < o.counts.size(); ++i) {
    if (o.counts[i] < 1) return "counts: each must be >= 1";
    if (i > 0 && o.counts[i] >= o.counts[i - 1]) return "counts: must be in descending order";
  }
  if (!(o.lower_share > 0 && o.lower_share <= 1)) return "lower_share: must be in (0, 1]";
  if (!(o.window_seconds > 0) || !std::isfinite(o.window_seconds)) {
    return "window_seconds: must be > 0";
  }
  if (o.window_steps < 1) return "window_steps: must be >= 1";
  if (!(o.first_probe_seconds > 0) || !std::isfinite(o.first_probe_seconds)) {
    return "first_probe_seconds: must be > 0";
  }
  if (!(o.max_probe_seconds >= o.first_probe_seconds) || !std::isfinite(o.max_probe_seconds)) {
    return "max_probe_seconds: must be >= first_probe_seconds";
  }
  if (!(o.idle_try_share >= 0) || !std::isfinite(o.idle_try_share)) {
    return "idle_try_share: must be >= 0";
  }
  if (!(o.idle_try_gap_seconds >= 0) || !std::isfinite(o.idle_try_gap_seconds)) {
    return "idle_try_gap_seconds: must be >= 0";
  }
  if (!(o.verify_margin < 1) || !std::isfinite(o.verify_margin)) {
    return "verify_margin: must be < 1 (negative: off)";
  }
  return "";
}

ThreadGovernor::ThreadGovernor(ThreadGovernorOptions o) : o_(std::move(o)) {
  if (o_.counts.empty()) o_.counts = {1};
  probe_wait_ = o_.first_probe_seconds;
  hold_wait_ = o_.first_probe_seconds;
}

double ThreadGovernor::idle_try_gap() const {
  return std::min(std::ldexp(o_.idle_try_gap_seconds,
                             static_cast<int>(std::clamp<int64_t>(idle_failures_ - 1, 0, 30))),
                  o_.max_probe_seconds);
}

int ThreadGovernor::Observe(double step_seconds, double wait_seconds, double now, double idle_cpus,
                            double work_seconds) {
  if (idle_cpus >= 0) {
    idle_sum_ += idle_cpus;
    idle_readings_ += 1;
  }
  if (o_.counts.size() < 2 || wait_seconds < 0 || !(step_seconds >= 0)) return threads();
  step_s_ += step_seconds;
  wait_s_ += wait_seconds;
  steps_ += 1;
  if (work_seconds > 0) {
    work_s_ += work_seconds;
    work_step_s_ += step_seconds;
  }
  if (step_s_ < o_.window_seconds || steps_ < o_.window_steps) return threads();
  const double share = wait_s_ / step_s_;
  const double slowness = work_s_ > 0 ? work_step_s_ / work_s_ : -1;
  step_s_ = wait_s_ = work_s_ = work_step_s_ = 0;
  steps_ = 0;
  last_share_ = share;
  last_slowness_ = slowness;
  const double idle = window_idle_ = idle_readings_ > 0 ? idle_sum_ / idle_readings_ : -1;
  idle_sum_ = 0;  // a reading counts for the window it came in
  idle_readings_ = 0;
  if (held_at_ >= 0 && now - held_at_ >= o_.first_probe_seconds) {
    // The try has lasted: the waits start over.
    held_at_ = -1;
    probe_wait_ = o_.first_probe_seconds;
    idle_failures_ = 0;
  }
  if (verifying_) {
    verifying_ = false;
    if (slowness > 0 && slowness > slow_before_ * (1 - o_.verify_margin)) {
      // The lower count is no faster for the same work: the wait was not worth avoiding. Back
      // up, and no lowering for a while (longer each time in a row).
      level_ -= 1;
      raised_ += 1;
      reverted_ += 1;
      hold_until_ = now + hold_wait_;
      hold_wait_ = std::min(2 * hold_wait_, o_.max_probe_seconds);
      return threads();
    }
    if (slowness > 0) hold_wait_ = o_.first_probe_seconds;  // it paid
  }
  if (share >= o_.lower_share) {
    // A try's own window, or the count a try reached before it lasted: the try failed. Back
    // down, and wait longer before the next one.
    const bool failed = trying_ || held_at_ >= 0;
    const bool lower = !failed && level_ + 1 < o_.counts.size() && now >= hold_until_;
    if (failed || lower) {
      level_ += 1;
      lowered_ += 1;
      if (failed) {
        failed_tries_ += 1;
        last_failed_ = now;
        probe_wait_ = std::min(2 * probe_wait_, o_.max_probe_seconds);
        idle_failures_ += idle_try_ ? 1 : 0;
      } else {
        probe_wait_ = o_.first_probe_seconds;
        verifying_ = o_.verify_margin >= 0 && slowness > 0;
        slow_before_ = slowness;
      }
      next_probe_ = now + probe_wait_;
    }
    trying_ = false;
    held_at_ = -1;
    return threads();
  }
  if (trying_) {
    // The try held its window: stay, and try the next count up (if any) after the first wait.
    trying_ = false;
    held_at_ = now;
    next_probe_ = now + o_.first_probe_seconds;
  } else if (level_ > 0) {
    const double added = o_.counts[level_ - 1] - o_.counts[level_];
    const bool idle_try = o_.idle_try_share > 0 && idle >= o_.idle_try_share * added &&
                          now - last_failed_ >= idle_try_gap();
    if (now >= next_probe_ || idle_try) {
      idle_try_ = now < next_probe_;
      idle_tries_ += idle_try_ ? 1 : 0;
      level_ -= 1;
      raised_ += 1;
      trying_ = true;
      held_at_ = -1;
    }
  }
  return threads();
}

}  // namespace imagegen
