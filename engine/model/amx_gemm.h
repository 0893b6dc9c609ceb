#pragma once

// Linear layers in bf16 on the CPU's AMX tiles, for the fp32 forward at a matmul precision of
// "medium" (LoadOptions::matmul_precision; PyTorch's torch.set_float32_matmul_precision names):
// x and the weight rounded to bf16 (round to nearest even), products and sums in fp32, the
// output fp32. Everything else in the forward stays fp32.
//
// Batch-invariant by construction: every output is one row of x against the packed weight, in
// the same order of k whatever the number of rows (rows are computed 16 at a time, a short last
// block padded with zero rows), and whichever thread computes its columns. So it serves every
// row count, where the fp32 forward needs SmallRowsLinear below 16 rows and the BLAS above.
//
// Not the same numbers as the fp32 forward: a model's logits move by bf16's rounding of the
// products' inputs (about 3 significant digits), so the images a seed draws differ from fp32's.
// The product is the same arithmetic as PyTorch's bf16 linear with fp32 accumulation, up to the
// order of the sums.

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>

namespace imagegen {

class AmxBf16Linear {
 public:
  AmxBf16Linear() = default;
  // w [N, K] fp32 on the CPU: packs a bf16 copy of it (half its bytes) in the tiles' layout.
  // Not ok() where the kernel cannot run here (Supported()).
  static AmxBf16Linear Prepare(const at::Tensor& w);
  // An x86-64 build, a CPU with AMX-TILE and AMX-BF16, and a kernel that lets this process use
  // the tiles' state (Linux 5.16 or later: arch_prctl ARCH_REQ_XCOMP_PERM, asked once).
  static bool Supported();
  // Why not Supported(), in a few words ("" where it is).
  static std::string Unsupported();

  bool ok() const { return n_ > 0; }
  // x [m, K] fp32 on the CPU (any m, contiguous or not): bf16(x) bf16(w)^T in fp32, [m, N].
  at::Tensor operator()(const at::Tensor& x) const;

 private:
  // [N16 / 16, K32 / 32, 16 pairs of k, 16 columns, 2]: the weight's 16-column panels, each a
  // run of 1 KB tiles (32 k by 16 columns) in the pairs-of-k order the tiles multiply; N16 and
  // K32 are N and K rounded up to 16 and 32 (zero-filled).
  at::Tensor packed_;
  int64_t n_ = 0, k_ = 0, k32_ = 0;
};

}  // namespace imagegen
