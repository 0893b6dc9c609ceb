#include "engine/scheduler/decode_queue.h"

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>

#include <ATen/Parallel.h>

#include "engine/model/cuda_stream.h"

namespace imagegen {

DecodeQueue::DecodeQueue(bool async, const c10::Device& device, int64_t cpu_threads,
                         int64_t max_batch)
    : async_(async), max_batch_(std::max<int64_t>(max_batch, 1)) {
  if (async_) thread_ = std::thread([this, device, cpu_threads] { Loop(device, cpu_threads); });
}

DecodeQueue::~DecodeQueue() { Stop(); }

void DecodeQueue::Count(bool ok) { (ok ? completed_ : failed_).fetch_add(1); }

void DecodeQueue::Run(Task task) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (async_ && !stopping_) {
      Entry e;
      e.task = std::move(task);
      if (tasks_.empty() && running_ == 0) beat_ = Clock::now();
      tasks_.push_back(std::move(e));
      cv_.notify_one();
      return;
    }
  }
  Count(task());
}

void DecodeQueue::Complete(std::shared_ptr<RequestObserver> observer, RequestResult result,
                           Clock::time_point finished, ImageDecode decode) {
  Run([f = std::make_shared<Finished>(Finished{std::move(observer), std::move(result), finished}),
       decode = std::move(decode)] {
    if (!decode) return Deliver(*f, nullptr);
    StatusOr<Image> image = Internal("image not decoded");
    try {
      image = decode(f->result);
    } catch (const std::exception& e) {
      image = Internal(std::string("image decoding failed: ") + e.what());
    }
    return Deliver(*f, &image);
  });
}

bool DecodeQueue::Deliver(Finished& f, StatusOr<Image>* image) {
  try {
    if (image != nullptr && !image->ok()) {
      f.observer->OnError(image->status());
      return false;
    }
    if (image != nullptr) f.result.image = std::move(*image).value();
    f.result.stats.decode_seconds =
        std::chrono::duration<double>(Clock::now() - f.finished).count();
    f.observer->OnComplete(std::move(f.result));
    return true;
  } catch (...) {
    return false;  // an observer's own error: counted as failed, the others still complete
  }
}

void DecodeQueue::CompleteBatch(const void* key, std::vector<Finished> done, BatchDecode decode) {
  if (key == nullptr) key = this;  // any non-null key: merged only with the same decoder's
  // Calls of at most max_batch requests.
  std::vector<std::vector<Finished>> parts;
  for (size_t i = 0; i < done.size(); i += static_cast<size_t>(max_batch_)) {
    const size_t end = std::min(done.size(), i + static_cast<size_t>(max_batch_));
    parts.emplace_back(std::make_move_iterator(done.begin() + static_cast<long>(i)),
                       std::make_move_iterator(done.begin() + static_cast<long>(end)));
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    if (async_ && !stopping_) {
      if (tasks_.empty() && running_ == 0) beat_ = Clock::now();
      for (std::vector<Finished>& part : parts) {
        Entry e;
        e.key = key;
        e.done = std::move(part);
        e.decode = decode;
        tasks_.push_back(std::move(e));
      }
      cv_.notify_one();
      return;
    }
  }
  for (std::vector<Finished>& part : parts) RunBatch(part, decode);
}

// One decoder call for all of `done`, then each request's OnComplete or OnError.
void DecodeQueue::RunBatch(std::vector<Finished>& done, const BatchDecode& decode) {
  batch_calls_.fetch_add(1);
  batch_images_.fetch_add(static_cast<int64_t>(done.size()));
  std::vector<const RequestResult*> results;
  for (const Finished& f : done) results.push_back(&f.result);
  std::vector<StatusOr<Image>> images;
  Status failed;
  try {
    images = decode(results);
  } catch (const std::exception& e) {
    failed = Internal(std::string("image decoding failed: ") + e.what());
  }
  if (failed.ok() && images.size() != done.size()) {
    failed = Internal("image decoding made " + std::to_string(images.size()) + " images for " +
                      std::to_string(done.size()) + " requests");
  }
  for (size_t i = 0; i < done.size(); ++i) {
    StatusOr<Image> image = failed.ok() ? std::move(images[i]) : StatusOr<Image>(failed);
    Count(Deliver(done[i], &image));
  }
}

void DecodeQueue::RunEntry(Entry& e) {
  if (e.key != nullptr) {
    RunBatch(e.done, e.decode);
    return;
  }
  bool ok = false;
  try {
    ok = e.task();
  } catch (...) {
    ok = false;  // a task reports its own errors; this one escaped (a bug): counted as failed
  }
  Count(ok);
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
  int64_t n = running_;
  for (const Entry& e : tasks_) n += e.Size();
  return n;
}

double DecodeQueue::StalledSeconds(Clock::time_point now) const {
  std::lock_guard<std::mutex> l(mu_);
  if (running_ == 0 && tasks_.empty()) return 0;
  return std::max(0.0, std::chrono::duration<double>(now - beat_).count());
}

void DecodeQueue::Loop(c10::Device device, int64_t cpu_threads) {
  if (cpu_threads > 0) at::set_num_threads(static_cast<int>(cpu_threads));
  OwnStream stream(device);
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping, and nothing left
    Entry e = std::move(tasks_.front());
    tasks_.pop_front();
    // The same decoder's finished requests queued right behind: one call for all of them.
    while (e.key != nullptr && !tasks_.empty() && tasks_.front().key == e.key &&
           e.Size() + tasks_.front().Size() <= max_batch_) {
      for (Finished& f : tasks_.front().done) e.done.push_back(std::move(f));
      tasks_.pop_front();
    }
    const int64_t n = e.Size();
    running_ += n;
    l.unlock();
    RunEntry(e);
    l.lock();
    running_ -= n;
    beat_ = Clock::now();
  }
}

}  // namespace imagegen
