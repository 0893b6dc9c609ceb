#pragma once

// Attention for the forward on the CPU in fp32 (batch-invariant or not): every row's new
// queries over its own cache slot, all rows in one call (LoadOptions::row_attention).
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

// The batch-invariant forward sends every row through RowAttention (with
// LoadOptions::row_attention, on the CPU in fp32). Until 2026-12-06 rows of more than 16 new
// tokens kept one SDPA call per row group (kRowAttentionMaxTokens), measured when this kernel
// ran on one thread while SDPA used two (the engine was compiled without OpenMP:
// docs/data/row_attention_step_cpu_max256.txt). With both threads, a forward of the bundled
// model with RowAttention taking every row against the SDPA calls (imagegen-step-cost, one cell
// a process, the two in alternating order, 8 rounds: docs/data/row_attention_all_rows_2026-12-06/)
// took 0.85-0.92x the time at 1 request of 16-128 tokens, 0.72x at 192, 0.63-0.82x at 4
// requests of 16-128, 0.55-0.87x at 16 of 16-32 (medians; 7 or 8 of 8 rounds below 1 in every
// cell).

// Head sizes RowAttention computes: up to this. Multiples of 8 run with the dimensions in
// eight-float vectors; any other size with the keys in eight-float vectors (a row's keys copied
// dimension-major first) and the output in four-float ones.
inline constexpr int64_t kRowAttentionMaxHeadDim = 256;

// The head sizes a model's forward sends through RowAttention (LoadOptions::row_attention):
// multiples of 8, and sizes under 8 (the exact-distribution tests' toy models have 4). Measured
// against the SDPA calls (imagegen-step-cost --shapes hd4,hd12, 1 and 16 requests, 2 threads,
// each forward twice in ABBA order, 2026-12-07: docs/data/toy_row_attention_2026-12-07/):
// heads of 4 took 0.29-0.57x their forward's time at one-token rows, 0.56-0.65x at rows of 4
// and 0.85-1.0x at one request of 16-64 tokens; heads of 12 took 0.52-0.74x at one-token rows
// and 0.83-0.88x at rows of 4 but 1.09-1.34x at one request of 16-64 tokens, so such sizes
// keep SDPA.
inline bool RowAttentionTakes(int64_t head_dim) {
  return head_dim > 0 && head_dim <= kRowAttentionMaxHeadDim && (head_dim % 8 == 0 || head_dim < 8);
}

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
