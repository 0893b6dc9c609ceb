// Plain autoregressive generation with LlamaGen's semantics: prefill the class token, then one
// token per forward; CFG on raw logits with both rows fed the same token; temperature, top-k,
// top-p; one counter-based uniform per token keyed by (seed, position). Many requests run as
// rows of one ragged batch. This is the baseline every speculative method must reproduce in
// distribution. Thread-safe: each call owns its KV cache; the Gpt must outlive the generator.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/decoding/image_request.h"
#include "engine/model/gpt.h"
#include "engine/util/status.h"

namespace imagegen {

struct ImageResult {
  std::vector<int32_t> tokens;  // grid^2 ids, raster order
  int64_t nfe = 0;              // target forwards (a CFG pair counts once; prefill counts)
};

class ArGenerator {
 public:
  explicit ArGenerator(const Gpt& gpt) : gpt_(gpt) {}
  // Requests' policies are ignored (AR); each is validated (ValidateSampledRequest).
  StatusOr<std::vector<ImageResult>> Generate(const std::vector<ImageRequest>& requests) const;

 private:
  const Gpt& gpt_;
};

}  // namespace imagegen
