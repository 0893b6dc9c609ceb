#include "engine/model/norm_rope.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

// Built with -ffp-contract=off (engine/CMakeLists.txt): a product and the sum it feeds are two
// roundings in ATen's separate ops, and must stay two here.

// SumOfSquares's helpers pass L-float vectors by value; they are inlined, internal and never
// cross an ABI boundary, so GCC's note that such a call's ABI differs with AVX is moot.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace imagegen {

at::Tensor RmsNormOps(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  return y.to(x.scalar_type()) * weight;
}

at::Tensor RopeOps(const at::Tensor& x, const at::Tensor& table, bool half) {
  const int64_t t = x.size(0), h = x.size(1), hd = x.size(2);
  at::Tensor c = table.select(-1, 0).unsqueeze(1);  // [T, 1, hd/2]
  at::Tensor s = table.select(-1, 1).unsqueeze(1);
  if (half) {
    at::Tensor xf = x.to(at::kFloat);
    at::Tensor x1 = xf.narrow(-1, 0, hd / 2), x2 = xf.narrow(-1, hd / 2, hd / 2);
    return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1).to(x.scalar_type());
  }
  at::Tensor xs = x.to(at::kFloat).reshape({t, h, hd / 2, 2});
  at::Tensor x0 = xs.select(-1, 0), x1 = xs.select(-1, 1);
  at::Tensor out = at::stack({x0 * c - x1 * s, x1 * c + x0 * s}, -1);
  return out.reshape({t, h, hd}).to(x.scalar_type());
}

namespace {

// ATen runs elementwise ops and reductions on one thread below this many elements
// (at::internal::GRAIN_SIZE); the kernels split rows the same way (any split gives the same
// bits: each row is computed alone).
constexpr int64_t kGrain = 32768;

int64_t CeilLog2(int64_t x) {
  if (x <= 2) return 1;
  int64_t b = 0;
  for (uint64_t v = static_cast<uint64_t>(x - 1); v != 0; v >>= 1) ++b;
  return b;
}

// L floats as one value (GCC and Clang vector extensions): every lane runs the same
// instructions, so a lane's sum is the one the scalar loop over that lane gives.
template <int L>
struct Lanes {
  typedef float type __attribute__((vector_size(sizeof(float) * L)));
};

// The sum of x[i]^2 over a row of d, each square rounded, added as ATen's vectorised inner sum
// adds a contiguous row of L-lane vectors: the d / L vectors viewed as groups of four, the four
// partial vectors accumulated through a cascade of four levels of 2^p groups each (p = 4 for
// up to 2^19 groups), the vectors past the last whole group into the first partial, the
// partials added in order, then the elements past the last whole vector, then the lanes in
// order.
template <int L>
float SumOfSquares(const float* x, int64_t d) {
  using V = typename Lanes<L>::type;
  constexpr int kLevels = 4, kIlp = 4;
  const int64_t vectors = d / L, groups = vectors / kIlp;
  const int64_t power = std::max<int64_t>(4, CeilLog2(groups) / kLevels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  auto square = [&](int64_t v) {  // vector v's squares, each rounded
    V a;
    std::memcpy(&a, x + v * L, sizeof(a));
    return a * a;
  };
  auto finish = [&](V first) {  // the elements past the last whole vector, then the lanes
    float total = 0;
    for (int64_t i = vectors * L; i < d; ++i) {
      const float sq = x[i] * x[i];
      total += sq;
    }
    for (int l = 0; l < L; ++l) total += first[l];
    return total;
  };
  if (groups < step) {
    // Fewer groups than one level's count (rows under 64 L floats, the bundled model's and the
    // toy models'): the cascade never runs and its levels above the first stay zero, whose
    // additions change nothing (the partials are sums of squares, never -0).
    V acc[kIlp] = {};
    for (int64_t g = 0; g < groups; ++g) {
      for (int k = 0; k < kIlp; ++k) acc[k] += square(g * kIlp + k);
    }
    for (int64_t v = groups * kIlp; v < vectors; ++v) acc[0] += square(v);
    for (int k = 1; k < kIlp; ++k) acc[0] += acc[k];
    return finish(acc[0]);
  }
  V acc[kLevels][kIlp] = {};
  int64_t g = 0;
  while (g + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++g) {
      for (int k = 0; k < kIlp; ++k) acc[0][k] += square(g * kIlp + k);
    }
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = V{};
      }
      if ((g & (mask << (j * power))) != 0) break;
    }
  }
  for (; g < groups; ++g) {
    for (int k = 0; k < kIlp; ++k) acc[0][k] += square(g * kIlp + k);
  }
  for (int j = 1; j < kLevels; ++j) {
    for (int k = 0; k < kIlp; ++k) acc[0][k] += acc[j][k];
  }
  for (int64_t v = groups * kIlp; v < vectors; ++v) acc[0][0] += square(v);
  for (int k = 1; k < kIlp; ++k) acc[0][0] += acc[0][k];
  return finish(acc[0][0]);
}

template <int L>
void NormRows(const float* x, const float* w, float* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * d;
      float* yr = y + r * d;
      // mean: the sum divided by d (ATen's mean is sum().div_(d)); rsqrt: 1 / sqrt.
      const float mean = SumOfSquares<L>(xr, d) / static_cast<float>(d);
      const float inv = 1.0f / std::sqrt(mean + eps);
      for (int64_t i = 0; i < d; ++i) {
        const float n = xr[i] * inv;
        yr[i] = n * w[i];
      }
    }
  });
}

// Random rows at magnitudes from 1e-3 to 1e3, more of them than ATen reduces on one thread.
at::Tensor ProbeRows(int64_t rows, int64_t d) {
  at::Generator gen = at::detail::createCPUGenerator(20261205);
  at::Tensor x = at::randn({rows, d}, gen, at::kFloat);
  at::Tensor scale = at::pow(10.0, at::rand({rows, 1}, gen, at::kFloat) * 6 - 3);
  return x * scale;
}

}  // namespace

RowNorm RowNorm::WithLanes(int64_t dim, double eps, int lanes) {
  TORCH_CHECK(dim > 0 && (lanes == 8 || lanes == 16), "RowNorm: dim ", dim, ", lanes ", lanes);
  RowNorm n;
  n.dim_ = dim;
  n.eps_ = static_cast<float>(eps);  // ATen adds a double scalar to a float tensor in float
  n.lanes_ = lanes;
  return n;
}

RowNorm RowNorm::Prepare(int64_t dim, double eps) {
  if (dim <= 0) return {};
  const int64_t rows = std::max<int64_t>(64, 2 * kGrain / dim + 1);
  const at::Tensor x = ProbeRows(rows, dim);
  at::Generator gen = at::detail::createCPUGenerator(7);
  const at::Tensor w = at::randn({dim}, gen, at::kFloat);
  const at::Tensor want = RmsNormOps(x, w, eps);
  for (int lanes : {8, 16}) {
    const RowNorm n = WithLanes(dim, eps, lanes);
    if (at::equal(n(x, w), want) && at::equal(n(x.narrow(0, 0, 3), w), want.narrow(0, 0, 3))) {
      return n;
    }
  }
  return {};
}

at::Tensor RowNorm::operator()(const at::Tensor& x_in, const at::Tensor& weight) const {
  TORCH_CHECK(ok(), "RowNorm: not prepared");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == dim_ && x_in.device().is_cpu() &&
                  x_in.scalar_type() == at::kFloat,
              "RowNorm: x must be [T, ", dim_, "] fp32 on the CPU");
  TORCH_CHECK(weight.numel() == dim_ && weight.scalar_type() == at::kFloat,
              "RowNorm: weight must be [", dim_, "] fp32");
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  at::Tensor y = at::empty_like(x);
  const auto rows = x.size(0);
  if (lanes_ == 16) {
    NormRows<16>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, dim_, eps_);
  } else {
    NormRows<8>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, dim_, eps_);
  }
  return y;
}

at::Tensor RopeRows(const at::Tensor& x, const at::Tensor& table_in, bool half) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() && x.scalar_type() == at::kFloat &&
                  x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "RopeRows: x must be [T, H, hd] fp32 on the CPU with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), hd = x.size(2), half_hd = hd / 2;
  const at::Tensor table = table_in.contiguous();
  TORCH_CHECK(table.dim() == 3 && table.size(0) == T && table.size(1) == half_hd &&
                  table.size(2) == 2 && table.scalar_type() == at::kFloat,
              "RopeRows: table must be [T, hd/2, 2] fp32");
  at::Tensor out = at::empty({T, H, hd}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* xp = x.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  at::parallel_for(0, T, std::max<int64_t>(1, kGrain / (H * hd)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cs = tp + t * hd;  // (cos, sin) pairs
      for (int64_t h = 0; h < H; ++h) {
        const float* xi = xp + t * row_stride + h * hd;
        float* o = op + (t * H + h) * hd;
        for (int64_t j = 0; j < half_hd; ++j) {
          const float c = cs[2 * j], s = cs[2 * j + 1];
          // a * c - b * s and b * c + a * s, each product rounded, then the sum.
          const float a = half ? xi[j] : xi[2 * j];
          const float b = half ? xi[j + half_hd] : xi[2 * j + 1];
          const float ac = a * c, bs = b * s, bc = b * c, as = a * s;
          if (half) {
            o[j] = ac - bs;
            o[j + half_hd] = bc + as;
          } else {
            o[2 * j] = ac - bs;
            o[2 * j + 1] = bc + as;
          }
        }
      }
    }
  });
  return out;
}

bool RopeRowsMatch(int64_t heads, int64_t head_dim, bool half) {
  if (heads <= 0 || head_dim <= 0 || head_dim % 2 != 0) return false;
  const int64_t rows = std::max<int64_t>(16, 2 * kGrain / (heads * head_dim) + 1);
  // x as the forward passes it: a view of a wider projection, with its row stride.
  const at::Tensor wide = ProbeRows(rows, 3 * heads * head_dim);
  const at::Tensor x = wide.narrow(1, 0, heads * head_dim).view({rows, heads, head_dim});
  at::Generator gen = at::detail::createCPUGenerator(11);
  const at::Tensor angle = at::rand({rows, head_dim / 2}, gen, at::kFloat) * 100;
  const at::Tensor table = at::stack({at::cos(angle), at::sin(angle)}, -1);
  return at::equal(RopeRows(x, table, half), RopeOps(x, table, half)) &&
         at::equal(RopeRows(x.narrow(0, 0, 2), table.narrow(0, 0, 2), half),
                   RopeOps(x.narrow(0, 0, 2), table.narrow(0, 0, 2), half));
}

}  // namespace imagegen
