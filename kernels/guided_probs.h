// Fused final distributions: GuidedBatch::Probs (CFG combine, temperature, softmax) for every
// output row of a step in one pass, where no row uses top-k or top-p. One CUDA block per row
// (kernels/guided_probs.cu); on the CPU the same functions in the same order
// (GuidedProbsRowOnHost). It replaces the eager path's row gathers, CFG combine, temperature,
// softmax and float64 conversion (about 8 launches) with one, and computes:
//
//   z_v = (u_v + (c_v - u_v) * scale) / temperature   in float32, op for op as CfgCombine and
//                                                     FinalProbs (so z is theirs bit for bit)
//   p_v = exp(z_v - max z) / sum_v' exp(z_v' - max z) in float64
//
// where c and u are the row's conditional and unconditional logits (the same row without CFG,
// scale 1). The eager softmax works in float32; this one in float64, so the two differ by
// float32 rounding (about 1e-7 relative), not in what they mean. Sums are taken in the chain
// verification's fixed order (kChainVerifyChunks contiguous chunks, each left to right, then
// the chunk sums left to right); device and host then differ only where CUDA's exp and the C
// library's round differently (at most an ulp or two of float64). Header-only and free of
// CUDA: the engine's CPU path and the tests include it.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/chain_verify.h"  // kChainVerifyChunks, ChainChunkBegin, IMAGEGEN_HD

namespace imagegen::kernels {

struct GuidedProbsArgs {
  const float* logits = nullptr;  // [tokens, V] the forward's logits, row-major
  // [4, rows]: each output row's conditional and unconditional logit row (integers held
  // exactly in float64), its CFG scale and its temperature (already max(T, 1e-5)).
  const double* meta = nullptr;
  int64_t rows = 0, vocab = 0;
  double* out = nullptr;  // [rows, V] out
};

// z_v of output row r, in float32 (no fused multiply-add: guided_probs.cu is built without).
IMAGEGEN_HD float GuidedLogit(const GuidedProbsArgs& a, int64_t r, int64_t v) {
  const auto c_row = static_cast<int64_t>(a.meta[r]);
  const auto u_row = static_cast<int64_t>(a.meta[a.rows + r]);
  const auto scale = static_cast<float>(a.meta[2 * a.rows + r]);
  const auto temperature = static_cast<float>(a.meta[3 * a.rows + r]);
  const float c = a.logits[c_row * a.vocab + v];
  const float u = a.logits[u_row * a.vocab + v];
  const float d = c - u;
  const float scaled = d * scale;
  const float z = u + scaled;
  return z / temperature;
}

// exp(z_v - m) in float64.
IMAGEGEN_HD double GuidedExp(const GuidedProbsArgs& a, int64_t r, int64_t v, float m) {
  return exp(static_cast<double>(GuidedLogit(a, r, v)) - static_cast<double>(m));
}

// Chunk c's largest z (NaN-free rows; -inf for an empty chunk).
IMAGEGEN_HD float GuidedChunkMax(const GuidedProbsArgs& a, int64_t r, int c) {
  const int64_t e = ChainChunkBegin(a.vocab, c + 1);
  float m = -INFINITY;
  for (int64_t v = ChainChunkBegin(a.vocab, c); v < e; ++v) {
    const float z = GuidedLogit(a, r, v);
    if (z > m) m = z;
  }
  return m;
}

// Chunk c's sum of exp(z - m), left to right.
IMAGEGEN_HD double GuidedChunkSum(const GuidedProbsArgs& a, int64_t r, int c, float m) {
  const int64_t e = ChainChunkBegin(a.vocab, c + 1);
  double s = 0.0;
  for (int64_t v = ChainChunkBegin(a.vocab, c); v < e; ++v) s += GuidedExp(a, r, v, m);
  return s;
}

// Writes chunk c of row r's distribution, given the row's max and total.
IMAGEGEN_HD void GuidedChunkWrite(const GuidedProbsArgs& a, int64_t r, int c, float m,
                                  double total) {
  const int64_t e = ChainChunkBegin(a.vocab, c + 1);
  for (int64_t v = ChainChunkBegin(a.vocab, c); v < e; ++v) {
    a.out[r * a.vocab + v] = GuidedExp(a, r, v, m) / total;
  }
}

// The CPU path: row r, each chunk in turn where the kernel runs them side by side.
inline void GuidedProbsRowOnHost(const GuidedProbsArgs& a, int64_t r) {
  float m = -INFINITY;
  for (int c = 0; c < kChainVerifyChunks; ++c) {
    const float cm = GuidedChunkMax(a, r, c);
    if (cm > m) m = cm;
  }
  double sums[kChainVerifyChunks];
  for (int c = 0; c < kChainVerifyChunks; ++c) sums[c] = GuidedChunkSum(a, r, c, m);
  const double total = ChainTotal(sums);
  for (int c = 0; c < kChainVerifyChunks; ++c) GuidedChunkWrite(a, r, c, m, total);
}

// Launches the kernel over all rows on `stream` (a cudaStream_t; null: the default stream).
// Every pointer is device memory. Returns the cudaError_t of the launch (0: none). Defined in
// guided_probs.cu, built only where nvcc is.
int LaunchGuidedProbs(const GuidedProbsArgs& args, void* stream);

}  // namespace imagegen::kernels
