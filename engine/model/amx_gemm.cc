#include "engine/model/amx_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define IMAGEGEN_AMX_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace imagegen {
namespace {

constexpr int64_t kRows = 16;   // rows a tile (x's rows, and the output's)
constexpr int64_t kCols = 16;   // output columns a tile: one panel
constexpr int64_t kDepth = 32;  // k a tile: 16 pairs
constexpr int64_t kTile = 512;  // bf16 elements of a weight tile (1 KB)
constexpr int64_t kGroup = 4;   // panels a thread's group: four accumulator tiles

// fp32 -> bf16 bits, rounded to nearest even: LibTorch's own conversion (Tensor.to(bf16) on
// the CPU), so that x and the weights round as PyTorch rounds them.
inline uint16_t ToBf16(float f) { return c10::BFloat16(f).x; }

#ifdef IMAGEGEN_AMX_X86
// A row of x to bf16, as ToBf16 does one value (16 at a time; every AMX CPU has AVX-512). The
// zero-masked forms: GCC 12 warns that the plain ones' undefined source may be used.
__attribute__((target("avx512f"))) void RowToBf16(const float* src, int64_t K, uint16_t* dst) {
  int64_t k = 0;
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
  const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i qnan = _mm512_set1_epi32(0x7fc0);
  for (; k + 16 <= K; k += 16) {
    const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(src + k));
    const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, b, 16), one);
    __m512i r =
        _mm512_maskz_srli_epi32(0xffff, _mm512_add_epi32(b, _mm512_add_epi32(lsb, half)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, abs), inf);
    r = _mm512_mask_mov_epi32(r, nan, qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                        _mm512_maskz_cvtepi32_epi16(0xffff, r));
  }
  for (; k < K; ++k) dst[k] = ToBf16(src[k]);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A pass computes one or two blocks of up to 16 rows of x against a group of panels, reading
// each weight tile once for both blocks. Its tile configuration gives the last block only the
// rows it has (a tile of fewer rows multiplies faster: on the dev VM a 512 x 1024 product took
// 20.5 us at 1 row, 30.8 us at 16). Rows are computed alike in every kind of pass: one
// multiply-add of each k-tile after another into each output, in ascending k.
//
// One block (rows i0 .. i0 + r - 1, r <= 16), P <= 4 panels: tiles 0 .. P - 1 accumulate the
// panels, 4 holds the rows, 5 .. 7 the weight tiles in turn. wp: the first panel's first tile,
// `panel` elements to the next panel's; the outputs go to `out` (rows of `ldo` floats).
template <int P>
__attribute__((target("amx-tile,amx-bf16"))) void OneBlock(const uint16_t* xb, int64_t k32,
                                                           const uint16_t* wp, int64_t panel,
                                                           float* out, int64_t ldo) {
  _tile_zero(0);
  if constexpr (P > 1) _tile_zero(1);
  if constexpr (P > 2) _tile_zero(2);
  if constexpr (P > 3) _tile_zero(3);
  for (int64_t kc = 0; kc < k32 / kDepth; ++kc) {
    _tile_loadd(4, xb + kc * kDepth, k32 * 2);
    const uint16_t* b = wp + kc * kTile;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (P > 1) {
      _tile_loadd(6, b + panel, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (P > 2) {
      _tile_loadd(7, b + 2 * panel, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (P > 3) {
      _tile_loadd(5, b + 3 * panel, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, out, ldo * 4);
  if constexpr (P > 1) _tile_stored(1, out + kCols, ldo * 4);
  if constexpr (P > 2) _tile_stored(2, out + 2 * kCols, ldo * 4);
  if constexpr (P > 3) _tile_stored(3, out + 3 * kCols, ldo * 4);
}

// Two blocks (16 rows at xb, then up to 16 at xb + 16 rows), P <= 2 panels: tiles 0 and 1
// accumulate the first block's panels, 2 and 3 the second's; 4 and 5 hold the blocks' rows, 6
// and 7 the panels' weight tiles.
template <int P>
__attribute__((target("amx-tile,amx-bf16"))) void TwoBlocks(const uint16_t* xb, int64_t k32,
                                                            const uint16_t* wp, int64_t panel,
                                                            float* out, int64_t ldo) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (P > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const uint16_t* xb1 = xb + kRows * k32;
  for (int64_t kc = 0; kc < k32 / kDepth; ++kc) {
    _tile_loadd(4, xb + kc * kDepth, k32 * 2);
    _tile_loadd(5, xb1 + kc * kDepth, k32 * 2);
    const uint16_t* b = wp + kc * kTile;
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (P > 1) {
      _tile_loadd(7, b + panel, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* out1 = out + kRows * ldo;
  _tile_stored(0, out, ldo * 4);
  _tile_stored(2, out1, ldo * 4);
  if constexpr (P > 1) {
    _tile_stored(1, out + kCols, ldo * 4);
    _tile_stored(3, out1 + kCols, ldo * 4);
  }
}

// The configurations of both kinds of pass by the last block's rows (1 .. 16). Constants in
// memory: GCC 12 drops stores to a local configuration before _tile_loadconfig (it does not see
// the instruction read them), and the tiles then fault.
constexpr TileConfig MakeConfig(bool two, int last) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kRows;
  }
  if (two) {
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(last);
  } else {
    for (int t = 0; t <= 4; ++t) cfg.rows[t] = static_cast<uint8_t>(last);
  }
  return cfg;
}
template <bool kTwo>
constexpr std::array<TileConfig, kRows + 1> MakeConfigs() {
  std::array<TileConfig, kRows + 1> a{};
  for (int r = 1; r <= kRows; ++r) a[r] = MakeConfig(kTwo, r);
  return a;
}
constexpr std::array<TileConfig, kRows + 1> kOneBlock = MakeConfigs<false>();
constexpr std::array<TileConfig, kRows + 1> kTwoBlocks = MakeConfigs<true>();

__attribute__((target("amx-tile"))) void LoadConfig(const TileConfig& cfg) {
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void ReleaseTiles() { _tile_release(); }

std::string CheckSupport() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return "no CPUID leaf 7";
  if ((d & (1u << 24)) == 0 || (d & (1u << 22)) == 0) return "the CPU has no AMX-BF16";
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) {
    return "the kernel does not let this process use the AMX tiles (Linux 5.16 or later needed)";
  }
  return "";
}
#endif

}  // namespace

std::string AmxBf16Linear::Unsupported() {
#ifdef IMAGEGEN_AMX_X86
  static const std::string why = CheckSupport();
  return why;
#else
  return "not an x86-64 build";
#endif
}

bool AmxBf16Linear::Supported() { return Unsupported().empty(); }

AmxBf16Linear AmxBf16Linear::Prepare(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.device().is_cpu() && w_in.scalar_type() == at::kFloat,
              "AmxBf16Linear: w must be a 2-D fp32 CPU tensor");
  AmxBf16Linear s;
  if (!Supported() || w_in.size(0) == 0 || w_in.size(1) == 0) return s;
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kCols - 1) / kCols, k32 = (K + kDepth - 1) / kDepth * kDepth;
  s.packed_ = at::zeros({panels, k32 / kDepth, kDepth / 2, kCols, 2}, at::kShort);
  auto* p = reinterpret_cast<uint16_t*>(s.packed_.data_ptr<int16_t>());
  const float* wp = w.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t panel = n / kCols, col = n % kCols;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t kc = k / kDepth, pair = (k % kDepth) / 2, e = k % 2;
      p[(((panel * (k32 / kDepth) + kc) * (kDepth / 2) + pair) * kCols + col) * 2 + e] =
          ToBf16(wp[n * K + k]);
    }
  }
  s.n_ = N;
  s.k_ = K;
  s.k32_ = k32;
  return s;
}

at::Tensor AmxBf16Linear::operator()(const at::Tensor& x_in) const {
  TORCH_CHECK(ok(), "AmxBf16Linear: not prepared");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k_ && x_in.device().is_cpu() &&
                  x_in.scalar_type() == at::kFloat,
              "AmxBf16Linear: x must be [m, ", k_, "] fp32 on the CPU");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), N = n_, K = k_, k32 = k32_;
  if (m == 0) return at::empty({0, N}, x.options());
#ifdef IMAGEGEN_AMX_X86
  // x in bf16, its rows padded to a multiple of 16 and its k to one of 32, with zeros; the
  // output has as many rows and whole panels (the tiles store there directly), of which the
  // first m rows and N columns are returned.
  const int64_t rows = (m + kRows - 1) / kRows * kRows;
  std::vector<uint16_t> xb(static_cast<size_t>(rows * k32), 0);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) RowToBf16(xp + i * K, K, xb.data() + i * k32);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed_.data_ptr<int16_t>());
  const int64_t panels = packed_.size(0), panel = (k32 / kDepth) * kTile;
  const int64_t groups = (panels + kGroup - 1) / kGroup, ldo = panels * kCols;
  at::Tensor y = at::empty({rows, ldo}, x.options());
  float* yp = y.data_ptr<float>();
  // The passes over the rows: two blocks of 16 at a time, then what remains (up to 16 rows:
  // one block; more: two).
  struct Pass {
    int64_t i0, last;
    bool two;
  };
  std::vector<Pass> passes;
  int64_t i0 = 0;
  for (; m - i0 > 2 * kRows; i0 += 2 * kRows) passes.push_back({i0, kRows, true});
  const int64_t rest = m - i0;
  passes.push_back(rest > kRows ? Pass{i0, rest - kRows, true} : Pass{i0, rest, false});
  // Each group of columns from its own weights and the rows alone: the same bits on any split.
  // Split across threads only where each gets several blocks. (The figures that chose this, 43
  // against 20 us for five of the bundled model's layers at one row, were taken before the
  // engine was built with OpenMP, when no split ran on two threads; with the threads real, a
  // split at every size was within the noise of this rule on the dev VM: docs/results-serving.md,
  // "The engine's kernels on every intra-op thread".)
  const int64_t blocks = groups * (rows / kRows);
  const int64_t grain = blocks >= 32 ? 1 : groups;
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    const TileConfig* loaded = nullptr;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * kGroup, np = std::min(kGroup, panels - p0);
      for (const Pass& pass : passes) {
        const TileConfig* cfg = &(pass.two ? kTwoBlocks : kOneBlock)[pass.last];
        if (cfg != loaded) LoadConfig(*(loaded = cfg));
        const uint16_t* xr = xb.data() + pass.i0 * k32;
        if (pass.two) {
          for (int64_t q = 0; q < np; q += 2) {
            float* out = yp + pass.i0 * ldo + (p0 + q) * kCols;
            const uint16_t* w = wp + (p0 + q) * panel;
            if (np - q >= 2) {
              TwoBlocks<2>(xr, k32, w, panel, out, ldo);
            } else {
              TwoBlocks<1>(xr, k32, w, panel, out, ldo);
            }
          }
          continue;
        }
        float* out = yp + pass.i0 * ldo + p0 * kCols;
        const uint16_t* w = wp + p0 * panel;
        switch (np) {
          case 1:
            OneBlock<1>(xr, k32, w, panel, out, ldo);
            break;
          case 2:
            OneBlock<2>(xr, k32, w, panel, out, ldo);
            break;
          case 3:
            OneBlock<3>(xr, k32, w, panel, out, ldo);
            break;
          default:
            OneBlock<4>(xr, k32, w, panel, out, ldo);
        }
      }
    }
    if (loaded != nullptr) ReleaseTiles();
  });
  y = y.narrow(0, 0, m);  // the first rows of a contiguous tensor: contiguous
  return ldo == N ? y : y.narrow(1, 0, N).contiguous();
#else
  TORCH_CHECK(false, "AmxBf16Linear: not built for this architecture");
#endif
}

}  // namespace imagegen
