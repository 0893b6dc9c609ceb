// How a step's token budget is shared among the active requests of one model (DESIGN.md,
// "Scheduler"): under light load every request feeds its whole window (lowest latency); when
// the windows do not fit, they shrink toward one token so that speculation never crowds out
// other requests' progress. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

namespace imagegen {

struct WindowDemand {
  int64_t wanted = 1;  // tokens the request would feed (its window, clipped to what is left)
  int64_t rows = 1;    // forward rows per token (2 with CFG)
};

// Granted windows, in the order of `demand` (oldest request first). With budget <= 0, or when
// everything fits, each request gets what it wants. Otherwise every request gets
// min(wanted, W) for the largest W >= 1 whose total cost sum(min(wanted, W) * rows) fits, and
// what is left goes one token at a time to the oldest requests still held below their
// window. Every request gets at least one token, even past the budget (admission keeps that
// case from arising).
std::vector<int64_t> AllocateWindows(const std::vector<WindowDemand>& demand, int64_t budget);

}  // namespace imagegen
