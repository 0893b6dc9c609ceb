#pragma once

// Linear layers of a few rows for the batch-invariant forward on the CPU.
//
// The batch-invariant forward cannot hand the BLAS a matrix of fewer than kInvariantMinRows
// rows: MKL switches to other kernels for those, which round differently, so it pads them to
// 16 rows (about 4x the time of the rows themselves on the dev VM: a 2-row, 192 x 576 product
// 5 us, padded 21 us plus the padding's copies). SmallRowsLinear computes such rows itself,
// rounded exactly as the BLAS rounds the same rows in a matrix of 16 or more: each output as
// sequential fused multiply-adds over k, in the BLAS's blocks of k, the blocks' sums added in
// order. Which blocks the BLAS uses depends on its build and on the CPU, so Prepare finds them
// by comparing candidates bit for bit with at::linear on 16 rows, once per weight at load; where
// none reproduces it (another BLAS, a CPU without AVX2 and FMA, another architecture) it is not
// ok and the forward pads as before. Either way a row's logits are the same bits.

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace imagegen {

// Models whose linear weights take more bytes than this keep the padded products (the kernel
// keeps a second, packed copy of every weight).
inline constexpr int64_t kSmallGemmMaxWeightBytes = int64_t{512} << 20;

class SmallRowsLinear {
 public:
  SmallRowsLinear() = default;
  // w [N, K]: CPU, fp32. Packs a copy of it (the same bytes again) and finds the k-blocking
  // that reproduces at::linear on 16 rows bit for bit; not ok() where none does.
  static SmallRowsLinear Prepare(const at::Tensor& w);
  // The kernel with the given k-blocks (summing to K), unchecked (tests); avx512 false: the
  // AVX2 tiles even where the CPU has AVX-512 (the same bits, which tests check).
  static SmallRowsLinear WithBlocks(const at::Tensor& w, std::vector<int64_t> blocks,
                                    bool avx512 = true);
  // The kernel runs on this CPU: an x86-64 build, AVX2 and FMA.
  static bool Supported();

  bool ok() const { return !blocks_.empty(); }
  // The most rows the forward gives the kernel (more go to the BLAS, padded to 16): every count
  // below kInvariantMinRows with AVX-512 tiles; 11 with AVX2 ones, which on the dev VM took
  // 0.64-0.67x the padded forward's time at 2-4 rows and 0.83-0.88x at 8, but 1.03-1.11x at 14
  // (against MKL's AVX-512).
  int64_t max_rows() const;
  const std::vector<int64_t>& blocks() const { return blocks_; }
  // x [m, K] fp32 on the CPU (any m; the forward uses it below kInvariantMinRows): x w^T.
  at::Tensor operator()(const at::Tensor& x) const;

 private:
  at::Tensor packed_;  // [ceil(N / 16), K, 16]: 16 output columns a panel, zero-padded
  int64_t n_ = 0, k_ = 0;
  std::vector<int64_t> blocks_;  // k-blocks, in order; empty: not ok
  bool avx512_ = false;          // AVX-512 tiles (the CPU has them, and not turned off)
};

}  // namespace imagegen
