// Plain autoregressive generation with LlamaGen's semantics: prefill the class token, then one
// token per forward; CFG on raw logits with both rows fed the same token; temperature, top-k,
// top-p; one counter-based uniform per token keyed by (seed, position). Many requests run as
// rows of one ragged batch. This is the baseline every speculative method must reproduce in
// distribution. Not thread-safe (owns a KV cache per call).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/decoding/sampling.h"
#include "engine/model/gpt.h"
#include "engine/util/status.h"

namespace imagegen {

struct ImageRequest {
  int64_t class_id = 0;
  uint64_t seed = 0;
  SamplingParams sampling;
};

struct ImageResult {
  std::vector<int32_t> tokens;  // grid^2 ids, raster order
  int64_t nfe = 0;              // target forwards (a CFG pair counts once; prefill counts)
};

// Checks one request against a model; messages name the field ("class_id", "cfg_scale", ...).
Status ValidateRequest(const ImageRequest& r, const GptConfig& cfg);

class ArGenerator {
 public:
  explicit ArGenerator(const Gpt& gpt) : gpt_(gpt) {}
  StatusOr<std::vector<ImageResult>> Generate(const std::vector<ImageRequest>& requests) const;

 private:
  const Gpt& gpt_;
};

}  // namespace imagegen
