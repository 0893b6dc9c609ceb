// One image to draw: the condition, the seed and how to sample and decode it. The scheduler
// resolves a client's GenerateParams into this once; everything below it takes it as given.
// Plain data; thread-safe as values are.
#pragma once

#include <cstdint>

#include "engine/decoding/policy.h"
#include "engine/decoding/sampling_params.h"
#include "engine/util/status.h"

namespace imagegen {

class Gpt;
struct GptConfig;

struct ImageRequest {
  int64_t class_id = 0;
  uint64_t seed = 0;
  SamplingParams sampling;
  DecodingPolicy policy;  // ignored by ArGenerator (always plain AR)
};

// The condition and sampling against one model; messages name the field ("class_id",
// "cfg_scale", ...).
Status ValidateSampledRequest(const ImageRequest& r, const GptConfig& cfg);

// All of the request against the target model and the draft model (null when none is loaded):
// condition, sampling and policy. Thread-safe (reads only the models' configs).
Status ValidateImageRequest(const ImageRequest& r, const Gpt& target, const Gpt* draft);

}  // namespace imagegen
