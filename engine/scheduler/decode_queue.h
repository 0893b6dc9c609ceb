// Finished images' decoding (tokens or latents into pixels) and their completion callbacks, off
// the engine thread (EngineOptions::decode_thread). A finished request hands its tokens to the
// queue and the engine goes on with the next step at once; the decode thread decodes the image
// on its own CUDA stream (cuda_stream.h), so that the decoder's kernels overlap the next
// forwards instead of stalling every request in the batch, and then calls the request's
// OnComplete (or OnError). Inline (async false), each task runs at once on the caller.
//
// Tasks run one at a time, in the order given. Thread-safe; a task must not touch the
// scheduler's state (it gets host data and the model, which outlives the queue).
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "engine/scheduler/request.h"

namespace imagegen {

class DecodeQueue {
 public:
  // A task returns true when its request completed and false when it failed (it has called
  // the observer's OnComplete or OnError either way).
  using Task = std::function<bool()>;

  // `cpu_threads` > 0: the decode thread's LibTorch intra-op threads (as the engine thread's,
  // EngineOptions::cpu_threads).
  DecodeQueue(bool async, const c10::Device& device, int64_t cpu_threads = 0);
  ~DecodeQueue();  // Stop()
  DecodeQueue(const DecodeQueue&) = delete;
  DecodeQueue& operator=(const DecodeQueue&) = delete;

  // Runs `task`: queued for the decode thread, or now when inline or stopped.
  void Run(Task task);
  // Completes a finished request through Run: `decode` (null: no image wanted) makes its image
  // from the result, then `observer` gets OnComplete with it (decode_seconds counted from
  // `finished`, the wait for the decode thread included), or OnError when decoding fails.
  using ImageDecode = std::function<StatusOr<Image>(const RequestResult&)>;
  void Complete(std::shared_ptr<RequestObserver> observer, RequestResult result,
                Clock::time_point finished, ImageDecode decode);
  // Runs every queued task, then ends the decode thread. Idempotent.
  void Stop();

  bool async() const { return async_; }
  int64_t pending() const;  // queued or running, not yet returned
  // Tasks that returned true / false so far (counted when the task returns, after the
  // observer's OnComplete or OnError).
  int64_t completed() const { return completed_.load(); }
  int64_t failed() const { return failed_.load(); }

 private:
  void Count(bool ok);
  void Loop(c10::Device device, int64_t cpu_threads);

  const bool async_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  int64_t running_ = 0;
  bool stopping_ = false;
  std::atomic<int64_t> completed_{0}, failed_{0};
  std::thread thread_;
};

}  // namespace imagegen
