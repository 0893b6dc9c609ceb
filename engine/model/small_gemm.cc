#include "engine/model/small_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "engine/model/gpt.h"  // kInvariantMinRows
#include "engine/util/json.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define IMAGEGEN_SMALL_GEMM_X86 1
#include <immintrin.h>
#endif

namespace imagegen {
namespace {

constexpr int64_t kPanel = 16;                     // output columns a panel: two AVX registers
constexpr int64_t kProbeRows = kInvariantMinRows;  // the rows the padded forward gives the BLAS
constexpr int64_t kTileRows = 6;   // rows a tile: 12 accumulators, 2 weights, 1 broadcast
constexpr int64_t kGroupK = 1024;  // k a run of blocks spans (Panels), where it has a choice

#ifdef IMAGEGEN_SMALL_GEMM_X86
// Rows i0 .. i0 + R - 1 of panel p over k-blocks b0 .. b1 - 1 (starting at k0): for each
// k-block, sums from zero by fused multiply-adds in ascending k, then added to the previous
// blocks' sum (the order the BLAS uses; Prepare checks it). The previous blocks' sum is `init`
// (same layout as `out`) where the blocks before b0 were summed by an earlier call, else the
// first block's sum itself. `out` is 16 floats a row (the panel's columns).
template <int R>
__attribute__((target("avx2,fma"))) void Tile(const float* x, int64_t K, const float* wp,
                                              const std::vector<int64_t>& blocks, size_t b0,
                                              size_t b1, int64_t k0, const float* init,
                                              float* out) {
  __m256 sum[R][2];
  for (int r = 0; r < R; ++r) {
    sum[r][0] = init ? _mm256_loadu_ps(init + r * kPanel) : _mm256_setzero_ps();
    sum[r][1] = init ? _mm256_loadu_ps(init + r * kPanel + 8) : _mm256_setzero_ps();
  }
  for (size_t b = b0; b < b1; ++b) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t k1 = k0 + blocks[b];
    for (int64_t k = k0; k < k1; ++k) {
      const __m256 w0 = _mm256_loadu_ps(wp + k * kPanel);
      const __m256 w1 = _mm256_loadu_ps(wp + k * kPanel + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
    const bool first = b == 0;
    for (int r = 0; r < R; ++r) {
      sum[r][0] = first ? acc[r][0] : _mm256_add_ps(sum[r][0], acc[r][0]);
      sum[r][1] = first ? acc[r][1] : _mm256_add_ps(sum[r][1], acc[r][1]);
    }
    k0 = k1;
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, sum[r][0]);
    _mm256_storeu_ps(out + r * kPanel + 8, sum[r][1]);
  }
}

// The same with AVX-512: P panels (one register each) at once, rows i0 .. i0 + R - 1; `init`
// and `out` are 16 * P floats a row. Lane for lane the same operations as Tile: the same bits.
template <int R, int P>
__attribute__((target("avx512f"))) void Tile512(const float* x, int64_t K, const float* wp,
                                                const std::vector<int64_t>& blocks, size_t b0,
                                                size_t b1, int64_t k0, const float* init,
                                                float* out) {
  __m512 sum[R][P];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      sum[r][p] = init ? _mm512_loadu_ps(init + (r * P + p) * kPanel) : _mm512_setzero_ps();
    }
  }
  for (size_t b = b0; b < b1; ++b) {
    __m512 acc[R][P];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    }
    const int64_t k1 = k0 + blocks[b];
    for (int64_t k = k0; k < k1; ++k) {
      __m512 w[P];
      for (int p = 0; p < P; ++p) w[p] = _mm512_loadu_ps(wp + (p * K + k) * kPanel);
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * K + k]);
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xb, w[p], acc[r][p]);
      }
    }
    const bool first = b == 0;
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) {
        sum[r][p] = first ? acc[r][p] : _mm512_add_ps(sum[r][p], acc[r][p]);
      }
    }
    k0 = k1;
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(out + (r * P + p) * kPanel, sum[r][p]);
  }
}

bool HasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// f(std::integral_constant<int, rows>) for rows in 1 .. kTileRows: the tile's rows as a
// compile-time count (its accumulators stay in registers).
template <typename F>
void WithRows(int64_t rows, F&& f) {
  switch (rows) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    default:
      return f(std::integral_constant<int, 6>{});
  }
}

// Panels p0 .. p0 + P - 1 (P = 1 or 2) of every row into y [m, N]. `groups`: the k-blocks in
// consecutive runs (block indices, ascending, ending at blocks.size()), each run summed over
// every row tile before the next, so that a run's weights stay in the core's cache while the
// row tiles reuse them; the runs' sums carried in y. The same operations in the same order as
// one run: the same bits.
template <int P>
void Panels(const float* x, int64_t m, int64_t K, const float* wp,
            const std::vector<int64_t>& blocks, const std::vector<size_t>& groups, float* y,
            int64_t N, int64_t col0, bool avx512) {
  float tile[kTileRows * kPanel * P];
  float init[kTileRows * kPanel * P];
  const int64_t cols = std::min(kPanel * P, N - col0);
  size_t b0 = 0;
  int64_t k0 = 0;
  for (size_t b1 : groups) {
    for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, m - i0);
      const float* xi = x + i0 * K;
      const float* in = nullptr;
      if (b0 > 0) {  // the earlier runs' sums of these rows (zero in the padding columns)
        std::memset(init, 0, sizeof(init));
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(init + r * P * kPanel, y + (i0 + r) * N + col0, cols * sizeof(float));
        }
        in = init;
      }
      if (avx512) {
        WithRows(rows, [&](auto r) {
          Tile512<decltype(r)::value, P>(xi, K, wp, blocks, b0, b1, k0, in, tile);
        });
      } else {
        for (int p = 0; p < P; ++p) {
          float one[kTileRows * kPanel];
          float one_in[kTileRows * kPanel];
          const float* wpp = wp + p * K * kPanel;
          if (in) {
            for (int64_t r = 0; r < rows; ++r) {
              std::memcpy(one_in + r * kPanel, in + (r * P + p) * kPanel, kPanel * sizeof(float));
            }
          }
          WithRows(rows, [&](auto r) {
            Tile<decltype(r)::value>(xi, K, wpp, blocks, b0, b1, k0, in ? one_in : nullptr, one);
          });
          for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(tile + (r * P + p) * kPanel, one + r * kPanel, kPanel * sizeof(float));
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(y + (i0 + r) * N + col0, tile + r * P * kPanel, cols * sizeof(float));
      }
    }
    for (size_t b = b0; b < b1; ++b) k0 += blocks[b];
    b0 = b1;
  }
}
#endif

// Deterministic probe inputs in [-2, 2) (splitmix64), so that Prepare does not draw from
// LibTorch's global generator (Gpt::Random seeds and draws from it around the load).
at::Tensor ProbeRows(int64_t K, int64_t rows = kProbeRows) {
  at::Tensor x = at::empty({rows, K}, at::kFloat);
  float* p = x.data_ptr<float>();
  uint64_t s = 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(K);
  for (int64_t i = 0; i < rows * K; ++i) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    p[i] = static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 24) * 4.0 -
                              2.0);
  }
  return x;
}

// The k-blockings to try, the likeliest first: one block, then blocks of a fixed size with the
// rest last, then K split into equal blocks. (MKL 2024.2 on the dev VM's AVX-512 Xeon, 16-row
// products: one block up to K = 384, 256 + 256 for K = 512, 384 + 384 for 768; for K = 1024
// no blocking reproduces them, though its 512-row products are 384 + 384 + 256.)
std::vector<std::vector<int64_t>> Candidates(int64_t K) {
  std::vector<std::vector<int64_t>> out{{K}};
  auto add = [&](std::vector<int64_t> b) {
    if (std::find(out.begin(), out.end(), b) == out.end()) out.push_back(std::move(b));
  };
  for (int64_t kc : {384, 256, 192, 128, 512, 320, 448, 64, 96, 160, 224, 288, 352, 416, 480, 576,
                     640, 768, 1024}) {
    if (kc >= K) continue;
    std::vector<int64_t> b;
    for (int64_t k = 0; k < K; k += kc) b.push_back(std::min(kc, K - k));
    add(std::move(b));
  }
  for (int64_t nb = 2; nb <= 8; ++nb) {
    if (K % nb == 0) add(std::vector<int64_t>(nb, K / nb));
  }
  return out;
}

// Prepare's timing of one row count: the fastest of kCalls alternating calls of each (load
// and stalls only make a call slower), after a call of each that checks the bits.
SmallRowsTiming TimeRows(const SmallRowsLinear& s, const at::Tensor& w, int64_t rows) {
  constexpr int kCalls = 5;
  const at::Tensor x = ProbeRows(w.size(1), rows);
  SmallRowsTiming t;
  t.rows = rows;
  t.same_bits = at::equal(s(x), at::linear(x, w));
  t.kernel_seconds = t.blas_seconds = std::numeric_limits<double>::infinity();
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < kCalls; ++i) {
    const auto t0 = Clock::now();
    at::Tensor a = s(x);
    const auto t1 = Clock::now();
    at::Tensor b = at::linear(x, w);
    const auto t2 = Clock::now();
    t.kernel_seconds = std::min(t.kernel_seconds, std::chrono::duration<double>(t1 - t0).count());
    t.blas_seconds = std::min(t.blas_seconds, std::chrono::duration<double>(t2 - t1).count());
  }
  return t;
}

// The rows chosen per weight shape, k-blocking, tile width and thread count in this process
// (SmallRowsLinear::MeasuredRows, RememberRows).
using ChoiceKey = std::tuple<int64_t, int64_t, std::vector<int64_t>, bool, int>;
std::mutex& ChoicesMutex() {
  static std::mutex mu;
  return mu;
}
std::map<ChoiceKey, int64_t>& Choices() {
  static std::map<ChoiceKey, int64_t> choices;
  return choices;
}

}  // namespace

int64_t SmallRowsLinear::ChooseMaxRows(const std::vector<SmallRowsTiming>& timings, int64_t below) {
  int64_t rows = below;
  for (const SmallRowsTiming& t : timings) {
    if (!t.same_bits || !std::isfinite(t.blas_seconds) ||
        !(t.kernel_seconds <= kFaster * t.blas_seconds)) {
      break;
    }
    rows = t.rows;
  }
  return rows;
}

std::vector<SmallRowsChoice> SmallRowsLinear::MeasuredRows() {
  std::lock_guard<std::mutex> lock(ChoicesMutex());
  std::vector<SmallRowsChoice> out;
  for (const auto& [key, rows] : Choices()) {
    const auto& [n, k, blocks, avx512, threads] = key;
    out.push_back({n, k, blocks, avx512, threads, rows});
  }
  return out;
}

void SmallRowsLinear::RememberRows(const std::vector<SmallRowsChoice>& choices) {
  std::lock_guard<std::mutex> lock(ChoicesMutex());
  for (const SmallRowsChoice& c : choices) {
    Choices()[std::make_tuple(c.n, c.k, c.blocks, c.avx512, c.threads)] = c.rows;
  }
}

std::string SerializeSmallRowsChoices(const std::vector<SmallRowsChoice>& choices) {
  Json list = Json::array();
  for (const SmallRowsChoice& c : choices) {
    list.push_back({{"n", c.n},
                    {"k", c.k},
                    {"blocks", c.blocks},
                    {"avx512", c.avx512},
                    {"threads", c.threads},
                    {"rows", c.rows}});
  }
  return Json{{"format", "imagegen-few-row-kernel-rows"}, {"choices", list}}.dump(1) + "\n";
}

StatusOr<std::vector<SmallRowsChoice>> ParseSmallRowsChoices(const std::string& text,
                                                             const std::string& where) {
  StatusOr<Json> parsed = ParseJson(text);
  if (!parsed.ok()) return DataLoss(where + ": " + std::string(parsed.status().message()));
  const Json& doc = *parsed;
  JsonFields top(doc, where);
  ASSIGN_OR_RETURN(std::string format, top.String("format"));
  if (format != "imagegen-few-row-kernel-rows") {
    return DataLoss(where + ": 'format' is '" + format.substr(0, 64) +
                    "', not imagegen-few-row-kernel-rows");
  }
  const Json* list = top.Find("choices");
  if (list == nullptr || !list->is_array()) return DataLoss(where + ": 'choices' must be a list");
  std::vector<SmallRowsChoice> out;
  for (size_t i = 0; i < list->size(); ++i) {
    JsonFields f((*list)[i], where + ": choices[" + std::to_string(i) + "]");
    SmallRowsChoice c;
    ASSIGN_OR_RETURN(c.n, f.Int("n"));
    ASSIGN_OR_RETURN(c.k, f.Int("k"));
    ASSIGN_OR_RETURN(c.blocks, f.IntList("blocks"));
    ASSIGN_OR_RETURN(c.avx512, f.Bool("avx512", false));
    ASSIGN_OR_RETURN(int64_t threads, f.Int("threads"));
    ASSIGN_OR_RETURN(c.rows, f.Int("rows"));
    const bool blocks_ok =
        std::all_of(c.blocks.begin(), c.blocks.end(), [](int64_t b) { return b > 0; }) &&
        std::accumulate(c.blocks.begin(), c.blocks.end(), int64_t{0}) == c.k;
    if (c.n < 1 || c.k < 1 || !blocks_ok || threads < 1 || threads > 4096 || c.rows < 1) {
      return DataLoss(where + ": choices[" + std::to_string(i) +
                      "]: n, k and rows must be >= 1, the blocks positive and summing to k, "
                      "threads in [1, 4096]");
    }
    c.threads = static_cast<int>(threads);
    out.push_back(std::move(c));
  }
  return out;
}

// Timed once per weight shape, k-blocking, tile width and intra-op thread count in a process (a
// model's layers share a few shapes; the bundled model's 31 weights have four), unless
// remembered: about 70 ms for the bundled model on the dev VM. Under the lock, so that two
// models loading at once do not time each other.
int64_t SmallRowsLinear::MeasureMaxRows(const at::Tensor& w) const {
  const auto key = std::make_tuple(n_, k_, blocks_, avx512_, at::get_num_threads());
  std::lock_guard<std::mutex> lock(ChoicesMutex());
  if (auto it = Choices().find(key); it != Choices().end()) return it->second;
  std::vector<SmallRowsTiming> timings;
  for (int64_t rows = kInvariantMinRows; rows <= kSmallRowsMeasuredMax; rows *= 2) {
    timings.push_back(TimeRows(*this, w, rows));
    if (ChooseMaxRows(timings, 0) != rows) break;  // the kernel stops here
  }
  const int64_t rows = ChooseMaxRows(timings, tile_rows());
  Choices().emplace(key, rows);
  return rows;
}

bool SmallRowsLinear::Supported() {
#ifdef IMAGEGEN_SMALL_GEMM_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

SmallRowsLinear SmallRowsLinear::WithBlocks(const at::Tensor& w, std::vector<int64_t> blocks,
                                            bool avx512) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.scalar_type() == at::kFloat,
              "SmallRowsLinear: w must be a 2-D fp32 CPU tensor");
  SmallRowsLinear s;
  s.n_ = w.size(0);
  s.k_ = w.size(1);
  int64_t total = 0;
  for (int64_t b : blocks) {
    TORCH_CHECK(b > 0, "SmallRowsLinear: empty k-block");
    total += b;
  }
  TORCH_CHECK(total == s.k_, "SmallRowsLinear: k-blocks sum to ", total, ", not K = ", s.k_);
  const int64_t panels = (s.n_ + kPanel - 1) / kPanel;
  // [panels * 16, K] zero-padded, then panel-major: [panels, K, 16].
  at::Tensor wp = at::zeros({panels * kPanel, s.k_}, at::kFloat);
  wp.narrow(0, 0, s.n_).copy_(w);
  s.packed_ = wp.view({panels, kPanel, s.k_}).transpose(1, 2).contiguous();
  s.blocks_ = std::move(blocks);
#ifdef IMAGEGEN_SMALL_GEMM_X86
  s.avx512_ = avx512 && HasAvx512();
#endif
  return s;
}

SmallRowsLinear SmallRowsLinear::EveryRow(const at::Tensor& w) {
  if (!Supported() || w.dim() != 2 || !w.device().is_cpu() || w.scalar_type() != at::kFloat) {
    return {};
  }
  std::vector<int64_t> blocks;
  for (int64_t k = 0; k < w.size(1); k += kEveryRowBlock) {
    blocks.push_back(std::min(kEveryRowBlock, w.size(1) - k));
  }
  SmallRowsLinear s = WithBlocks(w, std::move(blocks));
  s.max_rows_ = std::numeric_limits<int64_t>::max();
  s.every_row_ = true;
  return s;
}

SmallRowsLinear SmallRowsLinear::Prepare(const at::Tensor& w, int64_t max_rows) {
  if (!Supported() || w.dim() != 2 || !w.device().is_cpu() || w.scalar_type() != at::kFloat) {
    return {};
  }
  const at::Tensor x = ProbeRows(w.size(1));
  const at::Tensor want = at::linear(x, w);
  const at::Tensor want_panel = want.narrow(1, 0, std::min(kPanel, w.size(0)));
  SmallRowsLinear s = WithBlocks(w, {w.size(1)});
  for (std::vector<int64_t>& b : Candidates(w.size(1))) {
    s.blocks_ = std::move(b);
    // The first panel's columns first (cheap), then all of them.
    SmallRowsLinear first;
    first.packed_ = s.packed_.narrow(0, 0, 1);
    first.n_ = want_panel.size(1);
    first.k_ = s.k_;
    first.blocks_ = s.blocks_;
    first.avx512_ = s.avx512_;
    if (!at::equal(first(x), want_panel)) continue;
    if (at::equal(s(x), want)) {
      s.max_rows_ = max_rows > 0 ? max_rows : max_rows < 0 ? 0 : s.MeasureMaxRows(w);
      return s;
    }
  }
  return {};
}

int64_t SmallRowsLinear::tile_rows() const { return avx512_ ? kInvariantMinRows - 1 : 11; }

at::Tensor SmallRowsLinear::operator()(const at::Tensor& x_in) const {
  TORCH_CHECK(ok(), "SmallRowsLinear: not prepared");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k_ && x_in.device().is_cpu() &&
                  x_in.scalar_type() == at::kFloat,
              "SmallRowsLinear: x must be [m, ", k_, "] fp32 on the CPU");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), N = n_, K = k_;
  at::Tensor y = at::empty({m, N}, x.options());
#ifdef IMAGEGEN_SMALL_GEMM_X86
  const float* xp = x.data_ptr<float>();
  const float* wp = packed_.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panels = packed_.size(0), pairs = (panels + 1) / 2;
  // One run of k-blocks for one row tile; for more rows, runs of about kGroupK of k, so that
  // the weights a run reads (32 columns: 128 KB) stay in the core's cache across the row tiles
  // (a weight of large K, as the GPT-L-sized twin's 28,160, is a few MB a pair of panels).
  std::vector<size_t> groups;
  int64_t span = 0;
  for (size_t b = 0; b < blocks_.size(); ++b) {
    if (m > kTileRows && span > 0 && span + blocks_[b] > kGroupK) {
      groups.push_back(b);
      span = 0;
    }
    span += blocks_[b];
  }
  groups.push_back(blocks_.size());
  // Each panel's columns from its own weights and the rows alone: the same bits on any split.
  // Split across the threads at any size: the weights are read once a forward, and two cores
  // read them faster. (The 3-4% once measured for 2 to 14 rows predates the engine's OpenMP
  // build, when the split ran on one thread; with it, a lone fp32 AR step, two rows, takes 0.76x
  // its time without: docs/results-serving.md, "The engine's kernels on every intra-op thread".)
  const int64_t grain = 1;
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t p = 2 * q;
      if (p + 1 < panels) {
        Panels<2>(xp, m, K, wp + p * K * kPanel, blocks_, groups, yp, N, p * kPanel, avx512_);
      } else {
        Panels<1>(xp, m, K, wp + p * K * kPanel, blocks_, groups, yp, N, p * kPanel, avx512_);
      }
    }
  });
#else
  TORCH_CHECK(false, "SmallRowsLinear: not built for this architecture");
#endif
  return y;
}

}  // namespace imagegen
