#include "engine/scheduler/decode_queue.h"

#include <string>
#include <utility>

#include <ATen/Parallel.h>

#include "engine/model/cuda_stream.h"

namespace imagegen {

DecodeQueue::DecodeQueue(bool async, const c10::Device& device, int64_t cpu_threads)
    : async_(async) {
  if (async_) thread_ = std::thread([this, device, cpu_threads] { Loop(device, cpu_threads); });
}

DecodeQueue::~DecodeQueue() { Stop(); }

void DecodeQueue::Count(bool ok) { (ok ? completed_ : failed_).fetch_add(1); }

void DecodeQueue::Run(Task task) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (async_ && !stopping_) {
      tasks_.push_back(std::move(task));
      cv_.notify_one();
      return;
    }
  }
  Count(task());
}

void DecodeQueue::Complete(std::shared_ptr<RequestObserver> observer, RequestResult result,
                           Clock::time_point finished, ImageDecode decode) {
  Run([observer = std::move(observer), res = std::make_shared<RequestResult>(std::move(result)),
       finished, decode = std::move(decode)] {
    if (decode) {
      StatusOr<Image> image = Internal("image not decoded");
      try {
        image = decode(*res);
      } catch (const std::exception& e) {
        image = Internal(std::string("image decoding failed: ") + e.what());
      }
      if (!image.ok()) {
        observer->OnError(image.status());
        return false;
      }
      res->image = std::move(image).value();
    }
    res->stats.decode_seconds = std::chrono::duration<double>(Clock::now() - finished).count();
    observer->OnComplete(std::move(*res));
    return true;
  });
}

void DecodeQueue::Stop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
    cv_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

int64_t DecodeQueue::pending() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int64_t>(tasks_.size()) + running_;
}

void DecodeQueue::Loop(c10::Device device, int64_t cpu_threads) {
  if (cpu_threads > 0) at::set_num_threads(static_cast<int>(cpu_threads));
  OwnStream stream(device);
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping, and nothing left
    Task task = std::move(tasks_.front());
    tasks_.pop_front();
    running_ += 1;
    l.unlock();
    bool ok = false;
    try {
      ok = task();
    } catch (...) {
      ok = false;  // a task reports its own errors; this one escaped (a bug): counted as failed
    }
    Count(ok);
    l.lock();
    running_ -= 1;
  }
}

}  // namespace imagegen
