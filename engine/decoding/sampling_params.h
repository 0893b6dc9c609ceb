// The sampling parameters of one request (LlamaGen's sample(): CFG scale, temperature, top-k,
// top-p). Plain data without LibTorch, so that the server can use it; thread-safe.
#pragma once

#include <cstdint>

#include "engine/util/status.h"

namespace imagegen {

struct SamplingParams {
  double cfg_scale = 1.0;    // > 1 enables guidance (an unconditional row per request)
  double temperature = 1.0;  // divides logits by max(temperature, 1e-5)
  int64_t top_k = 0;         // 0 = off
  double top_p = 1.0;        // 1 = off

  bool uses_cfg() const { return cfg_scale > 1.0; }
};

// Checks ranges; the error names the field ("cfg_scale", "temperature", "top_k", "top_p").
Status ValidateSampling(const SamplingParams& p, int64_t vocab_size);

}  // namespace imagegen
