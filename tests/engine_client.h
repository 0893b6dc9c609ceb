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
  // Whether the events so far have decided every token of the image.
  bool all_decided() {
    std::lock_guard<std::mutex> l(mu_);
    return !events.empty() && events.back().totals.tokens == events.back().total_tokens;
  }
  int ended() {
    std::lock_guard<std::mutex> l(mu_);
    return terminal_calls;
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

}  // namespace imagegen::testing
