#include "engine/decoding/guided_batch.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>

#include "engine/decoding/fused_kernels.h"
#include "engine/decoding/sampling.h"
#include "engine/model/cuda_stream.h"
#include "engine/model/transfer.h"

namespace imagegen {

void GuidedBatch::Add(BatchRow row, int64_t uncond_slot,
                      const std::vector<int64_t>& uncond_condition, const SamplingParams& sampling,
                      const std::vector<int64_t>& outputs) {
  const auto len = static_cast<int64_t>(row.tokens.size());
  const auto prefix = row.prefix >= 0 ? row.prefix : static_cast<int64_t>(uncond_condition.size());
  row.group = static_cast<int64_t>(rows_.size());
  for (int64_t i : outputs) {
    cond_.push_back(tokens_ + i);
    // The output at position p predicts image token p + 1 - prefix.
    scale_.push_back(
        static_cast<float>(sampling.ScaleAt(row.positions[static_cast<size_t>(i)] + 1 - prefix)));
  }
  rows_.push_back(row);
  tokens_ += len;
  if (uncond_slot >= 0) {
    row.slot = uncond_slot;
    for (size_t i = 0; i < row.tokens.size() && row.positions[i] < prefix; ++i) {
      row.tokens[i] = uncond_condition[static_cast<size_t>(row.positions[i])];
    }
    for (int64_t i : outputs) uncond_.push_back(tokens_ + i);
    rows_.push_back(std::move(row));
    tokens_ += len;
  } else {
    for (int64_t i : outputs) uncond_.push_back(tokens_ - len + i);  // the row itself
  }
  params_.insert(params_.end(), outputs.size(), sampling);
}

at::Tensor GuidedBatch::Probs(const at::Tensor& logits) const {
  const at::Device dev = logits.device();
  std::vector<int64_t> both(cond_);
  both.insert(both.end(), uncond_.begin(), uncond_.end());
  const auto n = static_cast<int64_t>(cond_.size());
  at::Tensor rows = logits.index_select(0, UploadLongs(both, dev));
  return FinalProbs(
      CfgCombine(rows.narrow(0, 0, n), rows.narrow(0, n, n), UploadFloats(scale_, dev)), params_);
}

at::Tensor GuidedBatch::FusedProbs(const at::Tensor& logits_in, bool host) const {
  const at::Device dev = logits_in.device();
  if (dev.is_cpu() ? !host : !(dev.is_cuda() && FusedKernelsOn())) return {};
  const int64_t V = logits_in.size(1);
  const bool top_p = std::any_of(params_.begin(), params_.end(),
                                 [](const SamplingParams& p) { return p.top_p < 1.0; });
  if (top_p) return {};
  // One "launch" either way, as LaunchCount and profilers see it.
  RECORD_FUNCTION("imagegen::guided_probs", std::vector<c10::IValue>());
  const auto n = static_cast<int64_t>(cond_.size());
  std::vector<double> meta(static_cast<size_t>(5 * n));
  for (int64_t r = 0; r < n; ++r) {
    kernels::GuidedMetaRow(meta.data(), n, V, r, cond_[r], uncond_[r], scale_[r],
                           params_[r].temperature, params_[r].top_k);
  }
  at::Tensor logits = logits_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({n, V}, logits.options().dtype(at::kDouble));
  kernels::GuidedProbsArgs a;
  a.logits = logits.data_ptr<float>();
  a.rows = n;
  a.vocab = V;
  a.out = out.data_ptr<double>();
  if (dev.is_cpu()) {
    a.meta = meta.data();
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) kernels::GuidedProbsRowOnHost(a, r);
    });
  } else {
    at::Tensor m = UploadDoubles(meta, dev);
    a.meta = m.data_ptr<double>();
    const c10::DeviceGuard on(dev);  // a null (default) stream is the current device's
    const int err = LaunchGuidedProbsKernel(a, CurrentCudaStream(dev));
    TORCH_CHECK(err == 0, "fused final distributions: CUDA launch failed (error ", err, ")");
  }
  return out;
}

}  // namespace imagegen
