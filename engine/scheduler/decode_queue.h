// Finished images' decoding (tokens or latents into pixels) and their completion callbacks, off
// the engine thread (EngineOptions::decode_thread). A finished request hands its tokens to the
// queue and the engine goes on with the next step at once; the decode thread decodes the image
// on its own CUDA stream (cuda_stream.h), so that the decoder's kernels overlap the next
// forwards instead of stalling every request in the batch, and then calls the request's
// OnComplete (or OnError). Inline (async false), each task runs at once on the caller.
//
// Tasks run one at a time, in the order given. Thread-safe; a task must not touch the
// scheduler's state (it gets host data and the model, which outlives the queue).
//
// Batched decoding (CompleteBatch, EngineOptions::decode_batch): finished requests of one
// decoder that wait in the queue one behind the other are decoded in one decoder call of up
// to `max_batch` images, so that a decode thread that fell behind under load catches up in
// few calls instead of one call per image. A batch's pixels equal one-at-a-time decoding's
// only within rounding (a convolution's arithmetic depends on the batch), so the engine
// batches only where its forward is not batch-invariant either (CUDA graphs).
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/scheduler/request.h"

namespace imagegen {

class DecodeQueue {
 public:
  // A task returns true when its request completed and false when it failed (it has called
  // the observer's OnComplete or OnError either way).
  using Task = std::function<bool()>;

  // `cpu_threads` > 0: the decode thread's LibTorch intra-op threads (as the engine thread's,
  // EngineOptions::cpu_threads). `max_batch` >= 1: the most images one CompleteBatch decoder
  // call makes.
  DecodeQueue(bool async, const c10::Device& device, int64_t cpu_threads = 0,
              int64_t max_batch = 1);
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
  // A finished request waiting for its image.
  struct Finished {
    std::shared_ptr<RequestObserver> observer;
    RequestResult result;
    Clock::time_point finished;  // its last token (decode_seconds counts from here)
  };
  // Makes the images of several finished requests in one decoder call: one per request, in
  // their order.
  using BatchDecode =
      std::function<std::vector<StatusOr<Image>>(const std::vector<const RequestResult*>&)>;
  // Completes each of `done` as Complete does, its image made by `decode`. Requests with the
  // same non-null `key` (their decoder) that are queued one behind the other are decoded in
  // one call of up to max_batch (inline: at once, in calls of up to max_batch). A failed call
  // fails each of its requests with the error.
  void CompleteBatch(const void* key, std::vector<Finished> done, BatchDecode decode);
  // Runs every queued task, then ends the decode thread. Idempotent.
  void Stop();

  bool async() const { return async_; }
  int64_t max_batch() const { return max_batch_; }
  int64_t pending() const;  // tasks and batched requests queued or running, not yet returned
  // With tasks pending: the seconds up to `now` since the decode thread last returned from one
  // (or since the first was queued at an idle thread); 0 with none (Engine::Progress).
  double StalledSeconds(Clock::time_point now) const;
  // Tasks that returned true / false so far (counted when the task returns, after the
  // observer's OnComplete or OnError); a batched request counts as one task.
  int64_t completed() const { return completed_.load(); }
  int64_t failed() const { return failed_.load(); }
  // CompleteBatch's decoder calls so far, and the requests they were for.
  int64_t batch_calls() const { return batch_calls_.load(); }
  int64_t batch_images() const { return batch_images_.load(); }

 private:
  // A queued task, or finished requests to decode together (key non-null).
  struct Entry {
    Task task;
    const void* key = nullptr;
    std::vector<Finished> done;
    BatchDecode decode;
    int64_t Size() const { return key != nullptr ? static_cast<int64_t>(done.size()) : 1; }
  };
  void Count(bool ok);
  // Hands `f` its image (null: none wanted) through OnComplete, or its error through OnError;
  // true when it completed. An observer's exception counts as a failure and goes no further.
  static bool Deliver(Finished& f, StatusOr<Image>* image);
  void RunEntry(Entry& e);
  void RunBatch(std::vector<Finished>& done, const BatchDecode& decode);
  void Loop(c10::Device device, int64_t cpu_threads);

  const bool async_;
  const int64_t max_batch_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> tasks_;
  int64_t running_ = 0;
  bool stopping_ = false;
  Clock::time_point beat_ = Clock::now();  // StalledSeconds' origin
  std::atomic<int64_t> completed_{0}, failed_{0}, batch_calls_{0}, batch_images_{0};
  std::thread thread_;
};

}  // namespace imagegen
