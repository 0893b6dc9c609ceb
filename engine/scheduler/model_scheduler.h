// One model's scheduler: the waiting queue (wait_queue.h), the KV-cache slots, admission, the token
// budget, the step, and the events each step produces. The engine thread owns it (not thread-safe).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "engine/decoding/speculative.h"
#include "engine/model/image_model.h"
#include "engine/scheduler/decode_queue.h"
#include "engine/scheduler/engine.h"
#include "engine/scheduler/family_scheduler.h"
#include "engine/scheduler/goodput.h"
#include "engine/scheduler/step_cost.h"
#include "engine/scheduler/window_budget.h"

namespace imagegen {

class ModelScheduler : public FamilyScheduler {
 public:
  // `model`, `opts`, `decoder` and `listener` (may be null) are kept by reference and must
  // outlive the scheduler (the Engine owns all five). Finished images are decoded, and their
  // requests completed, through `decoder`.
  ModelScheduler(const ImageModel& model, int64_t slots, const EngineOptions& opts,
                 DecodeQueue& decoder, EngineListener* listener);

  // With the goodput window policy: the step-cost model, read from the cache
  // (EngineOptions::cache_dir) when it holds one for this model, device, dtype and CPU thread
  // count, else measured now with a few real steps (and cached). Call once, before the first Tick.
  Status Calibrate(const LoadOptions& load);
  const StepCostModel& step_cost() const { return cost_; }

  bool Tick(const std::unordered_set<int64_t>& cancelled, Clock::time_point now,
            Outcomes& out) override;
  void EndAll(const Status& status, Outcomes& out) override;
  int64_t active() const override { return static_cast<int64_t>(active_.size()); }
  int64_t slots_total() const override { return slots_; }
  int64_t slots_used() const override { return slots_ - batch_.free_slots(); }
  Clock::time_point next_deadline() const override;

 private:
  void Admit(Outcomes& out);
  // Suspends running requests less urgent than `next` (the least urgent, newest first) until it has
  // `need` free slots and the token budget room for its rows, if suspending all of them would give
  // it that; returns whether it then fits.
  bool Preempt(const Job& next, int64_t need, int64_t& rows, WaitQueue::Running& running,
               Outcomes& out);
  void Discard(Job& job) override;
  // The calibration's request (sjd with the widest window it measures, or AR if the model
  // cannot draft) and the request counts it measures as the KV slots allow (1, 4, 16, 32).
  ImageRequest CalibrationRequest() const;
  std::vector<int64_t> CalibrationSizes(const ImageRequest& req) const;
  std::vector<StepCostSample> MeasureStepCost(ImageRequest req);
  // A shape's timed steps (see TimeShape): the forward rows granted and the seconds taken.
  struct TimedStep {
    int64_t rows;
    double seconds;
  };
  // Steps of the requests `handles` at windows of at most `w` nodes: one untimed, then up to
  // `timed` timed (fewer when one of them finishes).
  std::vector<TimedStep> TimeShape(const std::vector<int64_t>& handles, int64_t w,
                                   int64_t timed = 3);
  // One request's shapes of the calibration, timed in interleaved rounds, into *samples;
  // `handles` holds the one request (replaced by a fresh one as it runs out of tokens).
  void MeasureLoneRequest(ImageRequest req, std::vector<int64_t>& handles,
                          std::chrono::steady_clock::time_point start,
                          std::vector<StepCostSample>* samples);
  // With EngineOptions::lone_request_max_window kLoneWindowFromCalibration: the ceiling on a
  // lone request's window (LoneRequestCeiling) for a policy, from the calibration's
  // one-request steps as Calibrate read or measured them (never the online refinement);
  // memoised (it is asked every step of a lone request). 0 otherwise (no ceiling).
  int64_t LoneCeiling(const DecodingPolicy& policy, const std::string& key, int64_t rows);
  // Whether the cached calibration (read from `path`) still describes this device: a few
  // one-request steps timed against its prediction (FAILED_PRECONDITION, naming both, when it
  // predicts them far too slow).
  Status SpotCheckCalibration(ImageRequest req, const std::string& path);
  // This step's windows for the decoding requests active_[idx[i]] (demand[i]); `expected`
  // gets each one's expected commits (goodput) and `plan` the predicted step time and
  // expected total.
  std::vector<int64_t> ChooseWindows(const std::vector<size_t>& idx,
                                     const std::vector<WindowDemand>& demand,
                                     std::vector<double>& expected, GoodputPlan& plan);
  double ReplayedSeconds(StepSample& sample, const std::vector<int64_t>& windows,
                         const std::vector<bool>& decoding);
  void TraceStep(const std::vector<size_t>& dec, const std::vector<int64_t>& windows,
                 const std::vector<WindowDemand>& demand, const std::vector<double>& expected,
                 StepSample& sample, std::vector<size_t>& traced);
  // Prompt chunks for the prefilling requests active_[idx[i]], in order, within
  // EngineOptions::prefill_tokens_per_step.
  std::vector<int64_t> PrefillChunks(const std::vector<size_t>& idx) const;
  void Step(Outcomes& out);
  StepEvent Event(Job& job, int64_t window);  // counters are deltas since the last event
  bool PreviewDue(const Job& job) const;
  void AddPreviews(const std::vector<size_t>& due, std::vector<StepEvent>& events);
  // Completes a finished job through the decode queue; with `batch` (decode_batch > 1), a job
  // that wants its image is added to it, for one decoder call with the step's others.
  void Finish(Job& job, std::vector<DecodeQueue::Finished>* batch);
  void End(Job& job, const Status& status);

  const ImageModel& model_;
  const EngineOptions& opts_;
  DecodeQueue& decoder_;
  EngineListener* listener_;
  int64_t slots_;
  SpecBatch batch_;
  std::vector<std::unique_ptr<Job>> active_;  // in admission order
  Status LoadOrMeasureCost(const LoadOptions& load);

  StepCostModel cost_;
  StepCostModel lone_cost_;        // fitted to the calibration's one-request steps (LoneCeiling)
  StepCostModel calibrated_cost_;  // cost_ before any online refinement
  std::map<std::tuple<std::string, int64_t, int64_t>, int64_t> lone_ceilings_;
  std::mt19937_64 noise_rng_{1};  // EngineOptions::simulated_step_noise
  CommitModel commits_;
  int64_t planned_steps_ = 0;               // goodput steps whose windows were planned
  bool explore_due_ = false;                // an exploring step is due (explore_every)
  double explore_credit_s_ = 0;             // predicted seconds exploring may still cost
  double explore_extra_s_ = 0;              // the last exploring step's predicted extra time
  std::set<StaticShape> replayed_buckets_;  // simulated_capture_cost
  bool explored_ = false;  // the last plan was an exploring one (GoodputPlan::wider)
};

}  // namespace imagegen
