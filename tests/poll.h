// Waiting for a condition in tests: poll it with a generous limit, never a fixed sleep (a
// loaded machine makes any fixed wait too short).
#pragma once

#include <chrono>
#include <functional>
#include <thread>

namespace imagegen::testing {

// Polls `done` every 10 ms until it holds or `limit` passes; true if it held.
inline bool WaitUntil(const std::function<bool()>& done, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace imagegen::testing
