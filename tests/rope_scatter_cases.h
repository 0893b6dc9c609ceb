// Random inputs for the static forward's rotary scatter (kernels/rope_scatter.h): a layer's qkv
// rows (with a row stride past 3D, as a strided view would have), each token's (cos, sin) row,
// distinct cache entries and query rows in shuffled order; and the eager path on them
// (LlamaGen's complex multiply, then index_copy_ of keys, values and queries, as
// Gpt::Decode's fused layer without the scatter): the reference the host path is checked
// against (rope_scatter_test.cc) and the kernel on a GPU (kernels_test.cc).
#pragma once

#include <ATen/ATen.h>

#include <cmath>

#include "kernels/rope_scatter.h"

namespace imagegen::rope_test {

struct RopeCase {
  at::Tensor qkv;       // [T, 3D + 8]: the first 3D columns are the layer's q, k, v
  at::Tensor table;     // [T, hd / 2, 2] float32
  at::Tensor dst, qin;  // [T] int64: distinct cache entries and query rows
  int64_t entries = 0, rows = 0, heads = 0, head_dim = 0;
  int64_t tokens() const { return qkv.size(0); }
  RopeCase To(const at::Device& d) const {
    return {qkv.to(d), table.to(d), dst.to(d), qin.to(d), entries, rows, heads, head_dim};
  }
};

// Where the scatter writes: keys and values [entries, H, hd], queries [rows, H, hd], zeroed.
struct RopeOut {
  at::Tensor k, v, q;
};

inline RopeCase RandomRopeCase(int64_t T, int64_t H, int64_t hd, at::ScalarType dtype,
                               uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  RopeCase c;
  c.heads = H;
  c.head_dim = hd;
  // As many query rows as cache entries, so that a test may swap the two index lists.
  c.entries = 3 * T + 5;
  c.rows = c.entries;
  const int64_t D = H * hd;
  c.qkv = (at::randn({T, 3 * D + 8}, g, f32) * 3).to(dtype);
  // Angles as LlamaGen's table has them: position times a frequency, up to a few hundred.
  at::Tensor angle = at::rand({T, hd / 2}, g, f32) * 300;
  c.table = at::stack({at::cos(angle), at::sin(angle)}, -1).contiguous();
  c.dst = at::randperm(c.entries, g, at::TensorOptions().dtype(at::kLong)).narrow(0, 0, T);
  c.qin = at::randperm(c.rows, g, at::TensorOptions().dtype(at::kLong)).narrow(0, 0, T);
  c.dst = c.dst.contiguous();
  c.qin = c.qin.contiguous();
  return c;
}

inline RopeOut ZeroOut(const RopeCase& c) {
  const auto o = c.qkv.options();
  return {at::zeros({c.entries, c.heads, c.head_dim}, o),
          at::zeros({c.entries, c.heads, c.head_dim}, o),
          at::zeros({c.rows, c.heads, c.head_dim}, o)};
}

// The arguments for case `c` writing into `out` (both on one device).
inline kernels::RopeScatterArgs RopeArgs(const RopeCase& c, RopeOut& out) {
  kernels::RopeScatterArgs a;
  a.qkv = c.qkv.data_ptr();
  a.row_stride = c.qkv.stride(0);
  a.table = c.table.data_ptr<float>();
  a.dst = c.dst.data_ptr<int64_t>();
  a.qin = c.qin.data_ptr<int64_t>();
  a.k_cache = out.k.data_ptr();
  a.v_cache = out.v.data_ptr();
  a.queries = out.q.data_ptr();
  a.tokens = c.tokens();
  a.heads = c.heads;
  a.head_dim = c.head_dim;
  a.dtype = c.qkv.scalar_type() == at::kBFloat16 ? kernels::RopeDtype::kBFloat16
                                                 : kernels::RopeDtype::kFloat32;
  return a;
}

inline RopeOut HostScatter(const RopeCase& c) {
  RopeOut out = ZeroOut(c);
  kernels::RopeScatterOnHost(RopeArgs(c, out));
  return out;
}

// The fused layer's path without the scatter, on c's device.
inline RopeOut EagerScatter(const RopeCase& c) {
  const int64_t T = c.tokens(), H = c.heads, hd = c.head_dim, D = H * hd;
  RopeOut out = ZeroOut(c);
  at::Tensor qk2 = c.qkv.narrow(1, 0, 2 * D).view({T, 2 * H, hd});
  at::Tensor xc = at::view_as_complex(qk2.to(at::kFloat).reshape({T, 2 * H, hd / 2, 2}));
  at::Tensor qk = at::view_as_real(xc * at::view_as_complex(c.table).unsqueeze(1))
                      .reshape({T, 2 * H, hd})
                      .to(c.qkv.scalar_type());
  out.k.index_copy_(0, c.dst, qk.narrow(1, H, H));
  out.v.index_copy_(0, c.dst, c.qkv.narrow(1, 2 * D, D).view({T, H, hd}));
  out.q.index_copy_(0, c.qin, qk.narrow(1, 0, H));
  return out;
}

// Rotated elements (queries or keys, part 0 or 1) of outputs a and b that differ by more than
// `ulps` units of the dtype's precision (float32: 2^-23, bfloat16: 2^-7) times the norm of the
// element's input pair, which bounds every rotated component: a bound that an FMA's single
// rounding (ATen's CUDA complex multiply may fuse) keeps to even where a*c and b*d cancel.
// a and b are [entries or rows, H, hd]; the rows compared are the tokens' (dst or qin).
inline int64_t RotatedMismatches(const RopeCase& c, int part, const at::Tensor& a,
                                 const at::Tensor& b, double ulps) {
  const int64_t T = c.tokens(), H = c.heads, hd = c.head_dim, D = H * hd;
  const double eps =
      c.qkv.scalar_type() == at::kBFloat16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -23);
  at::Tensor in = c.qkv.cpu().narrow(1, part * D, D).to(at::kDouble).reshape({T, H, hd / 2, 2});
  at::Tensor norm = in.pow(2).sum(-1, true).sqrt().expand({T, H, hd / 2, 2}).reshape({T, H, hd});
  at::Tensor idx = (part == 0 ? c.qin : c.dst).cpu();
  at::Tensor x = a.cpu().index_select(0, idx).to(at::kDouble);
  at::Tensor y = b.cpu().index_select(0, idx).to(at::kDouble);
  return ((x - y).abs() > norm * eps * ulps).sum().item<int64_t>();
}

// The fraction of the tokens' rotated elements (part 0: queries, 1: keys) in which a and b are
// equal bit for bit.
inline double BitEqualFraction(const RopeCase& c, int part, const at::Tensor& a,
                               const at::Tensor& b) {
  at::Tensor idx = (part == 0 ? c.qin : c.dst).cpu();
  at::Tensor x = a.cpu().index_select(0, idx), y = b.cpu().index_select(0, idx);
  if (x.scalar_type() == at::kBFloat16) {
    x = x.view(at::kShort);
    y = y.view(at::kShort);
  } else {
    x = x.view(at::kInt);
    y = y.view(at::kInt);
  }
  return (x == y).to(at::kDouble).mean().item<double>();
}

}  // namespace imagegen::rope_test
