// Test helpers around the serving engine: an observer that records a request's events and
// waits for its end, and a PNG size reader.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/scheduler/engine.h"

namespace imagegen::testing {

class Recorder : public RequestObserver {
 public:
  // Cancels its own request from inside OnStep after `cancel_after_steps` events (0: never).
  explicit Recorder(Engine* engine = nullptr, int64_t cancel_after_steps = 0)
      : engine_(engine), cancel_after_(cancel_after_steps) {}

  void OnStep(const StepEvent& e) override {
    std::lock_guard<std::mutex> l(mu_);
    events.push_back(e);
    if (engine_ != nullptr && cancel_after_ > 0 &&
        static_cast<int64_t>(events.size()) == cancel_after_) {
      engine_->Cancel(e.request_id);
    }
  }
  void OnComplete(RequestResult r) override {
    std::lock_guard<std::mutex> l(mu_);
    result = std::move(r);
    ++terminal_calls;
    cv_.notify_all();
  }
  void OnError(const Status& s) override {
    std::lock_guard<std::mutex> l(mu_);
    error = s;
    ++terminal_calls;
    cv_.notify_all();
  }
  // True once the request ended (within `timeout`).
  bool Wait(std::chrono::seconds timeout = std::chrono::seconds(300)) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, timeout, [&] { return terminal_calls > 0; });
  }
  size_t steps() {
    std::lock_guard<std::mutex> l(mu_);
    return events.size();
  }

  std::vector<StepEvent> events;
  std::optional<RequestResult> result;
  std::optional<Status> error;
  int terminal_calls = 0;

 private:
  Engine* engine_;
  int64_t cancel_after_;
  std::mutex mu_;
  std::condition_variable cv_;
};

// Width and height from a PNG's IHDR chunk (0, 0 if the signature is wrong).
inline std::pair<int, int> PngSize(const std::string& png) {
  static const char kSig[] = "\x89PNG\r\n\x1a\n";
  if (png.size() < 24 || png.compare(0, 8, std::string(kSig, 8)) != 0) return {0, 0};
  auto be32 = [&](size_t o) {
    return (static_cast<uint8_t>(png[o]) << 24) | (static_cast<uint8_t>(png[o + 1]) << 16) |
           (static_cast<uint8_t>(png[o + 2]) << 8) | static_cast<uint8_t>(png[o + 3]);
  };
  return {static_cast<int>(be32(16)), static_cast<int>(be32(20))};
}

}  // namespace imagegen::testing
