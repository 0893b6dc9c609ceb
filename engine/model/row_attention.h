#pragma once

// Attention for the batch-invariant forward on the CPU: every row's new queries over its own
// cache slot, all rows in one call (LoadOptions::row_attention).
//
// One task computes one (row, head, query) output from that query, the keys and values of its
// row's slot and its row's mask, in a fixed order (keys ascending), whatever the other rows
// are and whichever thread runs it: a row's output is bit-identical alone and in any batch by
// construction, without the one SDPA call per row group (and the copies of its keys and
// values) that the forward otherwise makes to get that guarantee.

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace imagegen {

// The batch-invariant forward sends row groups of at most this many new tokens a row through
// RowAttention and longer ones to one SDPA call each. On the 2-core dev VM (bundled model, fp32,
// imagegen-step-cost --forwards eager-sdpa,eager with RowAttention taking every row:
// docs/data/row_attention_step_cpu_max256.txt) a forward with RowAttention took 0.6-0.8x the
// time at 4-8 tokens a row, 0.9-0.97x at 16, but 1.0-1.04x at 32 and 1.03-1.1x at 64, where
// SDPA's blocked products pay off. (Up to 4 before its value loop's broadcasts stopped going
// through the stack: docs/data/row_attention_step_cpu_max8.txt.)
inline constexpr int64_t kRowAttentionMaxTokens = 16;
// Head sizes RowAttention takes: multiples of 8 up to this.
inline constexpr int64_t kRowAttentionMaxHeadDim = 256;

struct RowAttentionSpan {
  int64_t slot = 0;       // the row's cache slot
  int64_t cache_len = 0;  // committed entries, all visible to every new query
  int64_t n = 0;          // new tokens, at cache entries cache_len .. cache_len + n - 1
  int64_t t0 = 0;         // the row's first query among q's rows (and out's)
  // n x n row-major, mask[i * n + j] != 0 lets new query i see new key j; null: causal (j <= i).
  const uint8_t* mask = nullptr;
};

// q [T, H, hd] float (last dimension contiguous), k_cache and v_cache [slots, capacity, H, hd]
// contiguous float holding the spans' new keys and values already. Writes rows t0 .. t0 + n - 1
// of out [T, H * hd] (contiguous float) for every span, softmax(q k^T / sqrt(hd)) v over the
// visible keys; other rows of out are left as they are.
void RowAttention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const std::vector<RowAttentionSpan>& spans, at::Tensor& out);

}  // namespace imagegen
