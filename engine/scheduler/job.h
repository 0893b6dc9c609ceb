// A request inside the engine, from submission to its end, whatever the model family. The
// engine thread owns it (not thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/decoding/image_request.h"
#include "engine/scheduler/goodput.h"
#include "engine/scheduler/request.h"

namespace imagegen {

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
  // Window control: the request's commits against expectation, and sums over its steps.
  RequestCommits commits;
  int64_t steps = 0, window_sum = 0;
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

}  // namespace imagegen
