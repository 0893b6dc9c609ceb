// One model's scheduler: a FIFO waiting queue, the KV-cache slots, admission, the token budget,
// the step, and the events each step produces. The engine thread owns it (not thread-safe).
#pragma once

#include <deque>
#include <memory>
#include <unordered_set>
#include <vector>

#include "engine/decoding/speculative.h"
#include "engine/model/image_model.h"
#include "engine/scheduler/engine.h"

namespace imagegen {

// A request from submission to its end.
struct Job {
  int64_t id = 0;
  ImageRequest request;  // resolved and validated once, at submission
  GenerateParams params;
  std::shared_ptr<RequestObserver> observer;
  Clock::time_point submitted, started, first_token;
  int64_t handle = -1;  // in the SpecBatch while active
  // What the last event reported.
  size_t reported = 0;
  int64_t verified = 0, accepted = 0;
  std::vector<int64_t> verified_at_depth, accepted_at_depth;
  // The step (nfe) and time of the last preview; 0 and `started` before the first.
  int64_t last_preview_nfe = 0;
  Clock::time_point last_preview;
};

struct Outcomes {
  int64_t completed = 0, cancelled = 0, expired = 0, failed = 0;
};

class ModelScheduler {
 public:
  // `model`, `opts` and `listener` (may be null) are kept by reference and must outlive the
  // scheduler (the Engine owns all four).
  ModelScheduler(const ImageModel& model, int64_t slots, const EngineOptions& opts,
                 EngineListener* listener);

  void Enqueue(std::unique_ptr<Job> job);

  // One scheduling round: ends the cancelled and expired requests, admits what fits (FIFO),
  // and runs one step if a request is active. Returns whether a step ran.
  bool Tick(const std::unordered_set<int64_t>& cancelled, Clock::time_point now, Outcomes& out);

  // Ends every request, queued or active, with `status`.
  void EndAll(const Status& status, Outcomes& out);

  int64_t queued() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t active() const { return static_cast<int64_t>(active_.size()); }
  int64_t slots_total() const { return slots_; }
  int64_t slots_used() const { return slots_ - batch_.free_slots(); }
  bool idle() const { return waiting_.empty() && active_.empty(); }
  // The earliest deadline of any request (max() if none).
  Clock::time_point next_deadline() const;

 private:
  void Admit(Outcomes& out);
  void Step(Outcomes& out);
  StepEvent Event(Job& job, int64_t window);  // counters are deltas since the last event
  bool PreviewDue(const Job& job) const;
  // Of the requests whose preview is due, those the preview budget allows this step.
  std::vector<size_t> PreviewsThisStep(std::vector<size_t> due, double step_seconds);
  void AddPreviews(const std::vector<size_t>& due, std::vector<StepEvent>& events);
  void Finish(Job& job, Outcomes& out);
  void End(Job& job, const Status& status);

  const ImageModel& model_;
  const EngineOptions& opts_;
  EngineListener* listener_;
  int64_t slots_;
  SpecBatch batch_;
  std::deque<std::unique_ptr<Job>> waiting_;
  std::vector<std::unique_ptr<Job>> active_;  // in admission order
  // The preview budget (EngineOptions::preview_share): seconds of decoding earned and not yet
  // spent, and the recent cost of one preview.
  double preview_credit_ = 0, preview_cost_ = 0;
};

}  // namespace imagegen
