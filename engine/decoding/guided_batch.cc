#include "engine/decoding/guided_batch.h"

#include <ATen/ATen.h>

#include "engine/decoding/sampling.h"
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

}  // namespace imagegen
