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
  return "";
}

ThreadGovernor::ThreadGovernor(ThreadGovernorOptions o) : o_(std::move(o)) {
  if (o_.counts.empty()) o_.counts = {1};
  probe_wait_ = o_.first_probe_seconds;
}

int ThreadGovernor::Observe(double step_seconds, double wait_seconds, double now,
                            double idle_cpus) {
  if (idle_cpus >= 0) {
    idle_sum_ += idle_cpus;
    idle_readings_ += 1;
  }
  if (o_.counts.size() < 2 || wait_seconds < 0 || !(step_seconds >= 0)) return threads();
  step_s_ += step_seconds;
  wait_s_ += wait_seconds;
  steps_ += 1;
  if (step_s_ < o_.window_seconds || steps_ < o_.window_steps) return threads();
  const double share = wait_s_ / step_s_;
  step_s_ = wait_s_ = 0;
  steps_ = 0;
  last_share_ = share;
  const double idle = window_idle_ = idle_readings_ > 0 ? idle_sum_ / idle_readings_ : -1;
  idle_sum_ = 0;  // a reading counts for the window it came in
  idle_readings_ = 0;
  if (share >= o_.lower_share) {
    if (trying_) {
      // The count above is still contended: back down, and wait longer before the next try.
      trying_ = false;
      level_ += 1;
      lowered_ += 1;
      failed_tries_ += 1;
      last_failed_ = now;
      probe_wait_ = std::min(2 * probe_wait_, o_.max_probe_seconds);
      next_probe_ = now + probe_wait_;
    } else if (level_ + 1 < o_.counts.size()) {
      level_ += 1;
      lowered_ += 1;
      probe_wait_ = o_.first_probe_seconds;
      next_probe_ = now + probe_wait_;
    }
    return threads();
  }
  if (trying_) {
    // The try held: stay, and try the next count up (if any) after the first wait.
    trying_ = false;
    probe_wait_ = o_.first_probe_seconds;
    next_probe_ = now + probe_wait_;
  } else if (level_ > 0) {
    const double added = o_.counts[level_ - 1] - o_.counts[level_];
    const bool idle_try = o_.idle_try_share > 0 && idle >= o_.idle_try_share * added &&
                          now - last_failed_ >= o_.idle_try_gap_seconds;
    if (now >= next_probe_ || idle_try) {
      idle_tries_ += now >= next_probe_ ? 0 : 1;
      level_ -= 1;
      raised_ += 1;
      trying_ = true;
    }
  }
  return threads();
}

}  // namespace imagegen
