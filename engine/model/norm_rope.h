#pragma once

// The reference layer's RMSNorm and rotary embedding on the CPU in fp32, each as one kernel.
//
// LlamaGen's RMSNorm is six ATen ops (pow, mean, add, rsqrt, mul, mul) and the rotary embedding
// about ten (selects, products, a stack); for the few rows of a small step their launches cost
// far more than their arithmetic (on the dev VM, under the profiler, a one-request forward's 13
// means took 135 us, 10 us each, of a 0.9-ms forward). These kernels compute the same bits in one
// pass: every elementwise op there rounds once and is done here in the same order (this file is
// built without floating-point contraction), and the mean's sum follows ATen's cascade sum over a
// contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp: vectors of L lanes, four partial
// vectors, the lanes added last), whose lane count L depends on the CPU capability ATen runs
// its reduction kernels at. RowNorm::Prepare finds L by comparing with the reference ops bit for
// bit at load, and is not ok where neither 8 nor 16 lanes reproduce them (another ATen, another
// architecture): the forward then keeps the ops.

#include <ATen/Tensor.h>

#include <cstdint>

namespace imagegen {

// The reference ops (the forward's fallback and the kernels' check). RMSNorm as LlamaGen
// computes it: normalise in fp32, cast back, then scale. x [T, dim].
at::Tensor RmsNormOps(const at::Tensor& x, const at::Tensor& weight, double eps);
// x [T, H, hd]; table [T, hd/2, 2] float32: LlamaGen's interleaved pairs (2j, 2j+1), or with
// `half` Hugging Face LLaMA's rotate-half layout (element j pairs with j + hd/2); in fp32.
at::Tensor RopeOps(const at::Tensor& x, const at::Tensor& table, bool half);

class RowNorm {
 public:
  RowNorm() = default;
  // The kernel for rows of `dim` whose sum of squares adds `lanes` lanes (8 or 16), unchecked.
  static RowNorm WithLanes(int64_t dim, double eps, int lanes);
  // The kernel whose outputs equal RmsNormOps's bit for bit on random rows of `dim` (at every
  // magnitude, more rows than ATen runs on one thread); not ok() where no lane count does.
  static RowNorm Prepare(int64_t dim, double eps);

  bool ok() const { return lanes_ > 0; }
  int lanes() const { return lanes_; }
  // x [T, dim] fp32 on the CPU, rows contiguous; weight [dim] fp32: RmsNormOps(x, weight, eps).
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& weight) const;

 private:
  int64_t dim_ = 0;
  float eps_ = 0;
  int lanes_ = 0;  // 0: not ok
};

// RopeOps(x, table, half) in one pass: x [T, H, hd] fp32 on the CPU whose heads are contiguous
// (a view of the qkv projection with its row stride is fine); table [T, hd/2, 2] fp32. Returns
// a contiguous [T, H, hd].
at::Tensor RopeRows(const at::Tensor& x, const at::Tensor& table, bool half);
// Whether RopeRows equals RopeOps bit for bit on random rows of this shape (checked at load).
bool RopeRowsMatch(int64_t heads, int64_t head_dim, bool half);

}  // namespace imagegen
