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
  // LlamaGen's cfg_interval: image tokens past index cfg_interval + 1 are drawn from the
  // conditional logits alone (its decode loop stops guiding after step cfg_interval; the
  // unconditional row still runs). -1: every token is guided.
  int64_t cfg_interval = -1;

  bool uses_cfg() const { return cfg_scale > 1.0; }
  // The guidance scale of image token `index` (0-based, raster order): 1 when unguided.
  double ScaleAt(int64_t index) const {
    if (!uses_cfg() || (cfg_interval >= 0 && index > cfg_interval + 1)) return 1.0;
    return cfg_scale;
  }
};

// Checks ranges; the error names the field ("cfg_scale", "temperature", "top_k", "top_p",
// "cfg_interval").
Status ValidateSampling(const SamplingParams& p, int64_t vocab_size);

}  // namespace imagegen
