// From logits to the final distribution p that is sampled and verified: classifier-free
// guidance on raw logits, then temperature, top-k (ties kept), top-p, softmax, exactly as
// LlamaGen's sample() (shared/docs/models.md 1.6). Batched over rows, each with its own
// parameters; everything stays on the logits' device. Thread-safe (pure functions).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/decoding/sampling_params.h"
#include "engine/util/status.h"

namespace imagegen {

// logits of the unconditional row u and conditional row c -> u + (c - u) * scale; scale [R] on
// their device.
at::Tensor CfgCombine(const at::Tensor& cond, const at::Tensor& uncond, const at::Tensor& scale);

// logits [R, V] float32 -> probabilities [R, V] float32 after temperature, top-k, top-p.
at::Tensor FinalProbs(const at::Tensor& logits, const std::vector<SamplingParams>& params);

// Inverse-CDF draw: for each row the first id whose cumulative probability exceeds
// u * total (never an id of probability zero). probs [R, V], uniforms [R] in [0, 1), on the
// same device.
at::Tensor SampleInverseCdf(const at::Tensor& probs, const at::Tensor& uniforms);

// Gumbel top-k draws: for rows p [R, V] and uniforms u [R, V] (clamped to [1e-300, 1 - 1e-16]),
// the k ids with the largest p / (-log u), best first: the first as int64 [R], the other k - 1 as
// int64 [R, k - 1] (undefined for k = 1), -1 where the key is 0 (p = 0). The key is the
// exponential of the Gumbel-max key log p - log(-log u), so the order is the same (the top k of
// p + Gumbel noise: k draws from p without replacement) in one log instead of three. The eager
// path of Gumbel-coupled drafts (next_drafts.cc); kernels/chain_verify.h computes the same in
// the fused verification.
std::pair<at::Tensor, at::Tensor> GumbelTopK(const at::Tensor& p, const at::Tensor& u, int64_t k);

// One-hot rows [n, classes] of `dtype` for ids in [0, classes), on the ids' device. Unlike
// at::one_hot it does not read the ids' range back to the host (a device sync on the CPU
// path's checks); out-of-range ids are the caller's bug.
at::Tensor OneHot(const at::Tensor& ids, int64_t classes, at::ScalarType dtype);

}  // namespace imagegen
