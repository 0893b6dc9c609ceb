#include "engine/scheduler/window_budget.h"

#include <algorithm>

namespace imagegen {

std::vector<int64_t> AllocateWindows(const std::vector<WindowDemand>& demand, int64_t budget) {
  std::vector<int64_t> out;
  int64_t total = 0, widest = 1;
  for (const WindowDemand& d : demand) {
    out.push_back(std::max<int64_t>(d.wanted, 1));
    total += out.back() * d.rows;
    widest = std::max(widest, out.back());
  }
  if (budget <= 0 || total <= budget) return out;
  auto cost = [&](int64_t w) {
    int64_t c = 0;
    for (size_t i = 0; i < demand.size(); ++i) c += std::min(out[i], w) * demand[i].rows;
    return c;
  };
  int64_t lo = 1, hi = widest;  // cost(hi) > budget; find the largest w with cost(w) <= budget
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cost(mid) <= budget) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  int64_t left = budget - cost(lo);
  for (size_t i = 0; i < demand.size(); ++i) {
    const int64_t granted = std::min(out[i], lo);
    if (out[i] > lo && left >= demand[i].rows) {
      out[i] = granted + 1;
      left -= demand[i].rows;
    } else {
      out[i] = granted;
    }
  }
  return out;
}

}  // namespace imagegen
