// From logits to the final distribution p that is sampled and verified: classifier-free
// guidance on raw logits, then temperature, top-k (ties kept), top-p, softmax, exactly as
// LlamaGen's sample() (shared/docs/models.md 1.6). Batched over rows, each with its own
// parameters; everything stays on the logits' device. Thread-safe (pure functions).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/decoding/sampling_params.h"
#include "engine/util/status.h"

namespace imagegen {

// logits of the unconditional row u and conditional row c -> u + (c - u) * scale; scale [R].
at::Tensor CfgCombine(const at::Tensor& cond, const at::Tensor& uncond, const at::Tensor& scale);

// logits [R, V] float32 -> probabilities [R, V] float32 after temperature, top-k, top-p.
at::Tensor FinalProbs(const at::Tensor& logits, const std::vector<SamplingParams>& params);

// Inverse-CDF draw: for each row the first id whose cumulative probability exceeds
// u * total (never an id of probability zero). probs [R, V], uniforms [R] in [0, 1).
at::Tensor SampleInverseCdf(const at::Tensor& probs, const at::Tensor& uniforms);

}  // namespace imagegen
