// A request inside the engine, from submission to its end, whatever the model family. The
// engine thread owns it (not thread-safe).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/decoding/image_request.h"
#include "engine/scheduler/engine.h"
#include "engine/scheduler/goodput.h"
#include "engine/scheduler/request.h"

namespace imagegen {

// The engine thread's calls of observers and listeners: an exception from one is dropped (see
// RequestObserver), not let out to end the engine thread.
inline void NotifyStep(RequestObserver& o, const StepEvent& e) noexcept {
  try {
    o.OnStep(e);
  } catch (...) {
  }
}
inline void NotifyError(RequestObserver& o, const Status& s) noexcept {
  try {
    o.OnError(s);
  } catch (...) {
  }
}
inline void NotifyListener(EngineListener* l, const StepSample& s) noexcept {
  if (l == nullptr) return;
  try {
    l->OnStep(s);
  } catch (...) {
  }
}

struct Job {
  int64_t id = 0;
  int64_t group = 0;     // the id of the first request of its Engine::SubmitGroup call
  ImageRequest request;  // resolved and validated once, at submission
  GenerateParams params;
  std::shared_ptr<RequestObserver> observer;
  Clock::time_point submitted, started, first_token;
  int64_t handle = -1;      // in the SpecBatch while active, and while waiting after a preemption
  int64_t preemptions = 0;  // times it gave up its slots to a more urgent request
  // What the last event reported.
  size_t reported = 0;
  int64_t verified = 0, accepted = 0;
  std::vector<int64_t> verified_at_depth, accepted_at_depth;
  // The step (nfe) and time of the last preview; 0 and `started` before the first.
  int64_t last_preview_nfe = 0;
  Clock::time_point last_preview;
  int64_t previews_passed = 0;  // GenerateParams::previews: thresholds served
  // Window control: the request's commits against expectation, and sums over its steps.
  RequestCommits commits;
  std::string commit_key;  // CommitModel::Key(request.policy), set at its first plan
  int64_t steps = 0, window_sum = 0;
  int64_t last_window = 0, window_change_sum = 0;  // |window - the previous step's|, summed
  int64_t planned_window = 0;  // the last window the controller chose without exploring
  double expected_sum = 0, predicted_sum = 0, measured_sum = 0;
};

// A finished request's result as both model families report it: the request's identity and
// sampling, and the stats derived from its counters, the tokens each step committed, the
// per-depth draft counts and its times up to `t_end`, its last step. The caller adds the
// tokens, the image, the decoding time and its family's own stats.
RequestResult FinishedResult(const Job& j, const std::string& model, int64_t grid,
                             const RequestCounters& counters,
                             const std::vector<int32_t>& step_tokens,
                             const std::vector<int64_t>& verified_at_depth,
                             const std::vector<int64_t>& accepted_at_depth,
                             Clock::time_point t_end);

// A preview due (GenerateParams::preview_every, or the next of GenerateParams::previews) for a
// request whose image has `decided` of its `total` tokens after `nfe` forwards.
inline bool PreviewDueAt(const Job& j, int64_t nfe, int64_t decided, int64_t total) {
  const GenerateParams& p = j.params;
  if (decided >= total) return false;  // the image itself comes next
  if (p.previews > 0) {
    return j.previews_passed < p.previews &&
           decided * (p.previews + 1) >= (j.previews_passed + 1) * total;
  }
  return p.preview_every > 0 && nfe - j.last_preview_nfe >= p.preview_every;
}

// After a preview: the thresholds it covers (a late preview does not bring a burst of others).
inline void PreviewServed(Job& j, int64_t nfe, int64_t decided, int64_t total) {
  j.last_preview_nfe = nfe;
  if (j.params.previews > 0 && total > 0) {
    j.previews_passed =
        std::min<int64_t>(j.params.previews, decided * (j.params.previews + 1) / total);
  }
}

}  // namespace imagegen
