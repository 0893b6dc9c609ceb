// The preview budget (EngineOptions::preview_share). Previews are decoded on the engine thread,
// so every request in the batch waits for them: they may take `share` of the engine's time and
// no more. Each step with previews due earns that share of its own duration in decoding time,
// banked up to a quarter second, or one preview's recent cost when a preview costs more (a
// bank smaller than one preview would never serve another); the due requests are served
// longest-waiting first while the credit covers the recent cost of a preview. A request whose
// preview is not served this step stays due, and gets the grid as it is when it is served.
// One per model's scheduler (both families); the engine thread's only (not thread-safe).
#pragma once

#include <algorithm>
#include <cstddef>

namespace imagegen {

class PreviewBudget {
 public:
  static constexpr double kMaxCredit = 0.25;  // seconds

  explicit PreviewBudget(double share) : share_(share) {}

  // How many of `due` previews a step of `step_seconds` may serve (all of them with share 0:
  // no budget).
  size_t Grant(size_t due, double step_seconds) {
    if (due == 0 || share_ <= 0) return due;
    credit_ = std::min(credit_ + share_ * step_seconds, std::max(kMaxCredit, cost_));
    size_t n = 0;
    if (cost_ <= 0) {
      n = credit_ > 0 ? 1 : 0;  // no cost measured yet: one, to measure it
    } else if (credit_ > 0) {
      n = static_cast<size_t>(credit_ / cost_);
    }
    return std::min(n, due);
  }
  // `n` previews took `seconds` to decode.
  void Spent(size_t n, double seconds) {
    if (n == 0) return;
    credit_ -= seconds;
    const double each = seconds / static_cast<double>(n);
    cost_ = cost_ == 0 ? each : 0.8 * cost_ + 0.2 * each;
  }
  double cost() const { return cost_; }
  double credit() const { return credit_; }

 private:
  double share_;
  double credit_ = 0, cost_ = 0;
};

}  // namespace imagegen
