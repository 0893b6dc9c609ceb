// The rows of one guided forward (classifier-free guidance): every request contributes its
// conditional row and, with CFG, an unconditional twin that differs only in its condition
// tokens (the null class for the class token, the model's unconditional prompt for a prompt). After
// the forward, the outputs each request asked for are combined (CFG on raw logits) and turned into
// final distributions, in the order they were added. The one place where CFG rows are packed: the
// target step, the draft-model drafts and plain AR generation all use it.
// Not thread-safe; a value built and used within one step.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

#include "engine/decoding/sampling_params.h"
#include "engine/model/gpt.h"

namespace imagegen {

class GuidedBatch {
 public:
  // Adds `row` (its slot is the conditional slot) and, when `uncond_slot` >= 0, its twin in
  // that slot, whose tokens at condition positions (below the row's prefix) are taken from
  // `uncond_condition` by position; the row's new tokens at `outputs` (indices into
  // row.tokens) produce a distribution each, sampled with `sampling` (none for a prefill
  // chunk). Sets row.group so that a batch-invariant forward runs the pair as one attention
  // call.
  void Add(BatchRow row, int64_t uncond_slot, const std::vector<int64_t>& uncond_condition,
           const SamplingParams& sampling, const std::vector<int64_t>& outputs);

  const std::vector<BatchRow>& rows() const { return rows_; }
  int64_t outputs() const { return static_cast<int64_t>(cond_.size()); }

  // Logits of rows() [tokens, V] -> final distributions [outputs(), V] (float32, on the
  // logits' device): u + (c - u) * scale, then temperature, top-k, top-p.
  at::Tensor Probs(const at::Tensor& logits) const;

  // The same distributions in float64 through the fused kernel (kernels/guided_probs.h): one
  // upload and one launch on CUDA where the build has the kernel, the same arithmetic on the
  // host on the CPU (`host` true; otherwise the CPU keeps Probs, whose vectorised float32
  // softmax is the cheaper there). Undefined where it does not apply: a row with top-p, a
  // device without the kernel, or `host` false on the CPU. The callers then take Probs.
  at::Tensor FusedProbs(const at::Tensor& logits, bool host) const;

 private:
  int64_t tokens_ = 0;  // new tokens in rows_ so far
  std::vector<BatchRow> rows_;
  std::vector<int64_t> cond_, uncond_;  // per output: its token's index in the logits
  std::vector<float> scale_;
  std::vector<SamplingParams> params_;
};

}  // namespace imagegen
