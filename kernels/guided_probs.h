// Fused final distributions: GuidedBatch::Probs (CFG combine, temperature, top-k, softmax) for
// every output row of a step in one pass, where no row uses top-p. One CUDA block per row
// (kernels/guided_probs.cu); on the CPU the same functions in the same order
// (GuidedProbsRowOnHost). It replaces the eager path's row gathers, CFG combine, temperature,
// top-k sort and mask, softmax and float64 conversion with one launch, and computes:
//
//   z_v = (u_v + (c_v - u_v) * scale) / temperature   in float32, op for op as CfgCombine and
//                                                     FinalProbs (so z is theirs bit for bit)
//   kth = the k-th largest z (ties counted; -inf without top-k), found exactly by a radix
//         select over z's bits: FinalProbs' sorted[k - 1]
//   p_v = [z_v >= kth] exp(z_v - max z) / sum_v' [z_v' >= kth] exp(z_v' - max z)   in float64
//
// where c and u are the row's conditional and unconditional logits (the same row without CFG,
// scale 1). The eager softmax works in float32; this one in float64, so the two differ by
// float32 rounding (about 1e-7 relative), not in what they mean; the top-k set is the same.
// Sums are taken in the chain verification's fixed order (kChainVerifyChunks contiguous
// chunks, each left to right, then the chunk sums left to right); device and host then differ
// only where CUDA's exp and the C library's round differently (an ulp or two of float64).
// Header-only and free of CUDA: the engine's CPU path and the tests include it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/chain_verify.h"  // kChainVerifyChunks, ChainChunkBegin, IMAGEGEN_HD

namespace imagegen::kernels {

struct GuidedProbsArgs {
  const float* logits = nullptr;  // [tokens, V] the forward's logits, row-major
  // [5, rows]: each output row's conditional and unconditional logit row (integers held
  // exactly in float64), its CFG scale, its temperature (already max(T, 1e-5)) and its top-k
  // (in [1, V]; V: none).
  const double* meta = nullptr;
  int64_t rows = 0, vocab = 0;
  double* out = nullptr;  // [rows, V] out
};

// Writes output row r's entries of `meta` ([5, rows]) from what its request gives: temperature
// and top-k as FinalProbs takes them (T held at 1e-5 at least, in float32; top_k <= 0: none).
inline void GuidedMetaRow(double* meta, int64_t rows, int64_t vocab, int64_t r, int64_t cond,
                          int64_t uncond, float scale, double temperature, int64_t top_k) {
  meta[r] = static_cast<double>(cond);
  meta[rows + r] = static_cast<double>(uncond);
  meta[2 * rows + r] = scale;
  meta[3 * rows + r] = static_cast<float>(temperature > 1e-5 ? temperature : 1e-5);
  meta[4 * rows + r] = static_cast<double>(top_k > 0 && top_k < vocab ? top_k : vocab);
}

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

// z's key: unsigned integers in z's order (-0 taken as +0, which compares equal to it).
IMAGEGEN_HD uint32_t GuidedKey(float z) {
  if (z == 0.0F) z = 0.0F;
  uint32_t bits;
  memcpy(&bits, &z, sizeof(bits));
  return (bits & 0x80000000U) != 0 ? ~bits : bits | 0x80000000U;
}

IMAGEGEN_HD float GuidedFromKey(uint32_t key) {
  const uint32_t bits = (key & 0x80000000U) != 0 ? key & 0x7FFFFFFFU : ~key;
  float z;
  memcpy(&z, &bits, sizeof(z));
  return z;
}

IMAGEGEN_HD int64_t GuidedTopK(const GuidedProbsArgs& a, int64_t r) {
  return static_cast<int64_t>(a.meta[4 * a.rows + r]);
}

// How many of chunk c's z have a key of at least `key` (the radix select's count).
IMAGEGEN_HD int64_t GuidedChunkCount(const GuidedProbsArgs& a, int64_t r, int c, uint32_t key) {
  const int64_t e = ChainChunkBegin(a.vocab, c + 1);
  int64_t n = 0;
  for (int64_t v = ChainChunkBegin(a.vocab, c); v < e; ++v) {
    n += GuidedKey(GuidedLogit(a, r, v)) >= key ? 1 : 0;
  }
  return n;
}

// The radix select's next prefix: bit `bit` set where at least k keys reach it.
IMAGEGEN_HD uint32_t GuidedSelectStep(uint32_t prefix, int bit, int64_t count_at_least, int64_t k) {
  const uint32_t cand = prefix | (1U << bit);
  return count_at_least >= k ? cand : prefix;
}

// exp(z_v - m) in float64, 0 below the k-th largest.
IMAGEGEN_HD double GuidedExp(const GuidedProbsArgs& a, int64_t r, int64_t v, float m, float kth) {
  const float z = GuidedLogit(a, r, v);
  if (z < kth) return 0.0;
  return exp(static_cast<double>(z) - static_cast<double>(m));
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

// Chunk c's sum of exp(z - m) over the kept ids, left to right.
IMAGEGEN_HD double GuidedChunkSum(const GuidedProbsArgs& a, int64_t r, int c, float m, float kth) {
  const int64_t e = ChainChunkBegin(a.vocab, c + 1);
  double s = 0.0;
  for (int64_t v = ChainChunkBegin(a.vocab, c); v < e; ++v) s += GuidedExp(a, r, v, m, kth);
  return s;
}

// Writes chunk c of row r's distribution, given the row's max, k-th largest and total.
IMAGEGEN_HD void GuidedChunkWrite(const GuidedProbsArgs& a, int64_t r, int c, float m, float kth,
                                  double total) {
  const int64_t e = ChainChunkBegin(a.vocab, c + 1);
  for (int64_t v = ChainChunkBegin(a.vocab, c); v < e; ++v) {
    a.out[r * a.vocab + v] = GuidedExp(a, r, v, m, kth) / total;
  }
}

// The CPU path: row r, each chunk in turn where the kernel runs them side by side.
inline void GuidedProbsRowOnHost(const GuidedProbsArgs& a, int64_t r) {
  float m = -INFINITY;
  for (int c = 0; c < kChainVerifyChunks; ++c) {
    const float cm = GuidedChunkMax(a, r, c);
    if (cm > m) m = cm;
  }
  float kth = -INFINITY;
  const int64_t k = GuidedTopK(a, r);
  if (k < a.vocab) {
    uint32_t prefix = 0;
    std::vector<uint32_t> keys(static_cast<size_t>(a.vocab));  // counts need no order
    for (int64_t v = 0; v < a.vocab; ++v) keys[v] = GuidedKey(GuidedLogit(a, r, v));
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = prefix | (1U << bit);
      int64_t n = 0;
      for (uint32_t key : keys) n += key >= cand ? 1 : 0;
      prefix = GuidedSelectStep(prefix, bit, n, k);
    }
    kth = GuidedFromKey(prefix);
  }
  double sums[kChainVerifyChunks];
  for (int c = 0; c < kChainVerifyChunks; ++c) sums[c] = GuidedChunkSum(a, r, c, m, kth);
  const double total = ChainTotal(sums);
  for (int c = 0; c < kChainVerifyChunks; ++c) GuidedChunkWrite(a, r, c, m, kth, total);
}

// Launches the kernel over all rows on `stream` (a cudaStream_t; null: the default stream).
// Every pointer is device memory. Returns the cudaError_t of the launch (0: none). Defined in
// guided_probs.cu, built only where nvcc is.
int LaunchGuidedProbs(const GuidedProbsArgs& args, void* stream);

}  // namespace imagegen::kernels
