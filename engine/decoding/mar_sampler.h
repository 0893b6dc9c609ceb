// MAR's sampling loop (shared/docs/models.md 3.3) over the engine's model: a random order per
// image, the cosine mask schedule, classifier-free guidance with fake_latent and MAR's linear
// or constant guidance schedule, and every token's diffusion noise keyed by its position (so
// a token's draws do not depend on the step that predicts it or on the batch). The pieces are
// public so that the engine's step loop and CSpD reuse them. Thread-safe (pure functions).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

#include "engine/model/mar.h"
#include "engine/util/status.h"

namespace imagegen {

struct MarSamplingParams {
  int64_t num_iter = 64;
  double cfg_scale = 1.0;
  bool cfg_linear = true;  // MAR's "linear" schedule (Muse); false: "constant"
  double temperature = 1.0;
};

// Tokens still masked after step `step` (0-based) of `num_iter`, when `masked` are masked
// before it: max(1, min(masked - 1, floor(seq_len cos(pi/2 (step + 1) / num_iter)))). At the
// last step every masked token is predicted regardless (MarPredictCount).
int64_t MarMaskLen(int64_t seq_len, int64_t step, int64_t num_iter, int64_t masked);
// Tokens predicted at `step` when `masked` are masked before it.
int64_t MarPredictCount(int64_t seq_len, int64_t step, int64_t num_iter, int64_t masked);
// The guidance scale of a step whose mask length is `mask_len` (MarMaskLen: 1 at the last
// step, where MAR computes it before predicting every remaining token).
double MarCfgAt(const MarSamplingParams& p, int64_t seq_len, int64_t mask_len);

// A token's trajectory noise, keyed by (seed, position, stream): x_T [C] and eps [steps, C]
// (see DiffusionHead::Sample), as float32 CPU tensors. Stream 0 is shared by MAR's own loop,
// CSpD's draft and its aligned target; stream 1 is the target's own when not aligned.
void MarTrajectoryNoise(uint64_t seed, int64_t position, int64_t steps, int64_t token_dim,
                        at::Tensor* x_T, at::Tensor* eps, uint32_t stream = 0);

// The whole loop for a batch with given orders and noise (the Python reference's
// sample_tokens): labels [B], orders [B, S] (a permutation per row), x_T [B, S, C],
// eps [B, S, steps, C] -> tokens [B, S, C] float32. Used by tests and baselines; the engine
// runs the same steps interleaved with other requests.
StatusOr<at::Tensor> MarSampleTokens(const Mar& mar, const at::Tensor& labels,
                                     const at::Tensor& orders, const at::Tensor& x_T,
                                     const at::Tensor& eps, const MarSamplingParams& params);

}  // namespace imagegen
