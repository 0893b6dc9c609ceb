#include "engine/model/row_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

// The vector helpers below pass eight-float vectors by value; they are inlined, internal and
// never cross an ABI boundary, so GCC's note that such a call's ABI differs with AVX is moot.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace imagegen {
namespace {

// Eight floats as one value (GCC and Clang vector extensions): an AVX register where the clone
// below runs with AVX2, two SSE registers otherwise. Every lane runs the same instructions, so
// a key's or a dimension's result does not depend on its lane.
typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef float V8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads and stores

// The clone is picked by an ifunc resolver that runs while the program's relocations are
// processed, before ThreadSanitizer has set up its thread state: under TSan the program
// crashed in libtsan before main (seen in CI), so TSan builds keep the default code only.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define IMAGEGEN_ROW_ATTENTION_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define IMAGEGEN_ROW_ATTENTION_CLONES
#endif

#define IMAGEGEN_INLINE inline __attribute__((always_inline))

IMAGEGEN_INLINE V8 Load(const float* p) { return *reinterpret_cast<const V8u*>(p); }
IMAGEGEN_INLINE void Store(float* p, V8 v) { *reinterpret_cast<V8u*>(p) = v; }
IMAGEGEN_INLINE V8 Splat(float x) { return V8{x, x, x, x, x, x, x, x}; }
// Splat of a float as a shuffle of a one-lane vector: one broadcast. Written as Splat, GCC
// merged the value loop's loads of two neighbouring probabilities into one 8-byte load and built
// both broadcasts from it through the stack (a failed store forward every two keys, about 60%
// of the kernel's time in perf annotate on the dev VM) or through seven lane inserts.
IMAGEGEN_INLINE V8 Broadcast(float x) {
  const V8 v = {x};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}

// exp(x) for x <= 0 (scores minus their maximum), to about 2 ulp: x = n ln 2 + r with
// |r| <= ln 2 / 2, e^r by its degree-6 Taylor polynomial, 2^n through the exponent bits. Below
// -87 (e^x under 1.7e-38) it gives 0.
IMAGEGEN_INLINE V8 ExpNonPositive(V8 x) {
  const V8 lo = Splat(-87.0f);
  const I8 under = x < lo;
  x = x < lo ? lo : x;
  // n = floor(x / ln 2 + 1/2), the nearest integer: the conversion truncates toward zero,
  // which for negative t is one above the floor wherever t is not whole.
  const V8 t = x * Splat(1.44269504088896341f) + Splat(0.5f);
  const I8 n = __builtin_convertvector(t, I8);
  const I8 above = __builtin_convertvector(n, V8) > t;  // -1 where true
  const I8 nn = n + above;
  const V8 nnf = __builtin_convertvector(nn, V8);
  const V8 r = (x - nnf * Splat(0.693359375f)) + nnf * Splat(2.12194440e-4f);
  V8 p = Splat(1.0f / 720);
  p = p * r + Splat(1.0f / 120);
  p = p * r + Splat(1.0f / 24);
  p = p * r + Splat(1.0f / 6);
  p = p * r + Splat(0.5f);
  p = p * r + Splat(1.0f);
  p = p * r + Splat(1.0f);
  const I8 scale = (nn + 127) << 23;
  V8 two_n;
  __builtin_memcpy(&two_n, &scale, sizeof(two_n));
  const V8 e = p * two_n;
  return under ? Splat(0.0f) : e;
}

struct Geometry {
  const float *q, *k, *v;
  float* out;
  int64_t q_t, q_h;  // q's strides (elements) for a token and a head
  int64_t capacity, H, hd;
  float scale;
};

IMAGEGEN_INLINE float Sum8(V8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// Sum8 of each of eight vectors, as one vector: lanes paired, then pairs of pairs, then halves
// (the same additions in the same order as Sum8, eight at once).
IMAGEGEN_INLINE V8 Sum8Each(const V8 (&a)[8]) {
  V8 t[4], u[2];
  for (int k = 0; k < 4; ++k) {
    t[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int k = 0; k < 2; ++k) {
    u[k] = __builtin_shufflevector(t[2 * k], t[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(t[2 * k], t[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Query i's softmax numerators in place over its scores' first `visible` (then -inf past them,
// up to the next multiple of 8, and where its row's mask hides a new key): exp(score - max),
// the maximum found in eight lanes (exact in any order). Returns their sum in eight lanes (each
// lane over its keys in order).
IMAGEGEN_INLINE V8 Softmax(const RowAttentionSpan& s, int64_t i, int64_t visible, float* scores) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t vb = (visible + 7) / 8;
  for (int64_t j = visible; j < vb * 8; ++j) scores[j] = kNone;
  if (s.mask != nullptr) {
    const uint8_t* mrow = s.mask + i * s.n;
    for (int64_t j = 0; j < s.n; ++j) {
      if (mrow[j] == 0) scores[s.cache_len + j] = kNone;
    }
  }
  V8 mv = Splat(kNone);
  for (int64_t b = 0; b < vb; ++b) {
    const V8 x = Load(scores + 8 * b);
    mv = x > mv ? x : mv;
  }
  const float m = std::max(std::max(std::max(mv[0], mv[1]), std::max(mv[2], mv[3])),
                           std::max(std::max(mv[4], mv[5]), std::max(mv[6], mv[7])));
  const V8 mb = Broadcast(m);
  V8 sum = Splat(0.0f);
  for (int64_t b = 0; b < vb; ++b) {
    const V8 p = ExpNonPositive(Load(scores + 8 * b) - mb);
    Store(scores + 8 * b, p);
    sum += p;
  }
  return sum;
}

// Every query of one row and head, with DV = hd / 8 known at compile time so that the query and
// the output stay in registers (0: any hd, read at run time). A query's score for a key is its
// dot product in eight lanes (the dimensions mod 8, in order) added in a fixed tree; its
// softmax's sum runs over the keys in order (eight lanes, then the tree); its output adds the
// values weighted in key order, even and odd keys apart, then the two. What a query computes
// depends on its own row alone.
template <int DV>
IMAGEGEN_INLINE void RowHeadImpl(const Geometry& g, const RowAttentionSpan& s, int64_t h,
                                 std::vector<float>& scratch) {
  const int64_t stride = g.H * g.hd, keys = s.cache_len + s.n, blocks = (keys + 7) / 8;
  const int64_t dv = DV > 0 ? DV : g.hd / 8;
  const float* kbase = g.k + s.slot * g.capacity * stride + h * g.hd;
  const float* vbase = g.v + s.slot * g.capacity * stride + h * g.hd;
  scratch.resize(static_cast<size_t>(blocks * 8));
  float* scores = scratch.data();
  constexpr int kMax = DV > 0 ? DV : 32;  // hd <= 256
  V8 qv[kMax], even[kMax], odd[kMax];
  const V8 scale = Broadcast(g.scale);  // once: GCC rebuilt it lane by lane every key block
  for (int64_t i = 0; i < s.n; ++i) {
    const float* qp = g.q + (s.t0 + i) * g.q_t + h * g.q_h;
    // Visible keys end at the query's own entry for causal rows.
    const int64_t visible = s.mask != nullptr ? keys : s.cache_len + i + 1;
    for (int64_t c = 0; c < dv; ++c) qv[c] = Load(qp + 8 * c);
    int64_t j = 0;
    for (; j + 8 <= visible; j += 8) {  // eight keys, their lanes summed as Sum8 sums them
      V8 a[8];
      for (int k = 0; k < 8; ++k) {
        const float* kp = kbase + (j + k) * stride;
        a[k] = qv[0] * Load(kp);
        for (int64_t c = 1; c < dv; ++c) a[k] += qv[c] * Load(kp + 8 * c);
      }
      Store(scores + j, Sum8Each(a) * scale);
    }
    for (; j < visible; ++j) {
      const float* kp = kbase + j * stride;
      V8 a = qv[0] * Load(kp);
      for (int64_t c = 1; c < dv; ++c) a += qv[c] * Load(kp + 8 * c);
      scores[j] = Sum8(a) * g.scale;
    }
    const V8 sum = Softmax(s, i, visible, scores);
    for (int64_t c = 0; c < dv; ++c) even[c] = odd[c] = Splat(0.0f);
    for (j = 0; j + 2 <= visible; j += 2) {
      const V8 p0 = Broadcast(scores[j]), p1 = Broadcast(scores[j + 1]);
      const float* v0 = vbase + j * stride;
      const float* v1 = v0 + stride;
      for (int64_t c = 0; c < dv; ++c) {
        even[c] += p0 * Load(v0 + 8 * c);
        odd[c] += p1 * Load(v1 + 8 * c);
      }
    }
    if (j < visible) {
      const V8 p0 = Broadcast(scores[j]);
      const float* v0 = vbase + j * stride;
      for (int64_t c = 0; c < dv; ++c) even[c] += p0 * Load(v0 + 8 * c);
    }
    // Every query sees its own key (the forward checks the mask's diagonal): the sum is >= 1.
    const V8 inv = Broadcast(1.0f / Sum8(sum));
    float* op = g.out + (s.t0 + i) * stride + h * g.hd;
    for (int64_t c = 0; c < dv; ++c) Store(op + 8 * c, (even[c] + odd[c]) * inv);
  }
}

// Any head size (those that are not a multiple of 8, such as the exact-distribution tests'
// toy models' 4): every query of one row and head. The row's keys are first copied transposed
// (dimension-major, keys padded to a multiple of 8), so that a query's scores for eight keys
// are eight lanes, each its key's dot product over the dimensions in order; the softmax as in
// RowHeadImpl; each output dimension's weighted sum over the keys in order, four dimensions a
// vector. What a query computes depends on its own row alone. HD: the head size known at
// compile time (0: read at run time).
typedef float V4 __attribute__((vector_size(16)));
typedef float V4u __attribute__((vector_size(16), aligned(4)));
template <int HD>
IMAGEGEN_INLINE void RowHeadAny(const Geometry& g, const RowAttentionSpan& s, int64_t h,
                                std::vector<float>& scratch) {
  const int64_t hd = HD > 0 ? HD : g.hd, stride = g.H * hd, keys = s.cache_len + s.n;
  const int64_t padded = (keys + 7) / 8 * 8, quads = hd / 4;
  const float* kbase = g.k + s.slot * g.capacity * stride + h * hd;
  const float* vbase = g.v + s.slot * g.capacity * stride + h * hd;
  scratch.resize(static_cast<size_t>(padded * (hd + 1) + hd));
  float* kt = scratch.data();        // [hd][padded]
  float* scores = kt + padded * hd;  // [padded]
  float* tail = scores + padded;     // the output dimensions past the last whole quad
  for (int64_t j = 0; j < keys; ++j) {
    const float* kp = kbase + j * stride;
    for (int64_t d = 0; d < hd; ++d) kt[d * padded + j] = kp[d];
  }
  for (int64_t d = 0; d < hd; ++d) {
    for (int64_t j = keys; j < padded; ++j) kt[d * padded + j] = 0.0f;
  }
  constexpr int kMaxQuads = 64;  // hd <= 256
  V4 acc[kMaxQuads];
  const V8 scale = Broadcast(g.scale);
  for (int64_t i = 0; i < s.n; ++i) {
    const float* qp = g.q + (s.t0 + i) * g.q_t + h * g.q_h;
    const int64_t visible = s.mask != nullptr ? keys : s.cache_len + i + 1;
    const int64_t vb = (visible + 7) / 8;
    for (int64_t b = 0; b < vb; ++b) {
      V8 a = Broadcast(qp[0]) * Load(kt + 8 * b);
      for (int64_t d = 1; d < hd; ++d) a += Broadcast(qp[d]) * Load(kt + d * padded + 8 * b);
      Store(scores + 8 * b, a * scale);
    }
    const V8 sum = Softmax(s, i, visible, scores);
    for (int64_t c = 0; c < quads; ++c) acc[c] = V4{0, 0, 0, 0};
    for (int64_t d = 4 * quads; d < hd; ++d) tail[d - 4 * quads] = 0.0f;
    for (int64_t j = 0; j < visible; ++j) {
      const float p = scores[j];
      const V4 pv = {p, p, p, p};
      const float* vp = vbase + j * stride;
      for (int64_t c = 0; c < quads; ++c) {
        acc[c] += pv * *reinterpret_cast<const V4u*>(vp + 4 * c);
      }
      for (int64_t d = 4 * quads; d < hd; ++d) tail[d - 4 * quads] += p * vp[d];
    }
    // Every query sees its own key (the forward checks the mask's diagonal): the sum is >= 1.
    const float inv = 1.0f / Sum8(sum);
    const V4 iv = {inv, inv, inv, inv};
    float* op = g.out + (s.t0 + i) * stride + h * hd;
    for (int64_t c = 0; c < quads; ++c) *reinterpret_cast<V4u*>(op + 4 * c) = acc[c] * iv;
    for (int64_t d = 4 * quads; d < hd; ++d) op[d] = tail[d - 4 * quads] * inv;
  }
}

IMAGEGEN_ROW_ATTENTION_CLONES
void RowHead(const Geometry& g, const RowAttentionSpan& s, int64_t h, std::vector<float>& scratch) {
  switch (g.hd) {
    case 32:  // the bundled model
      return RowHeadImpl<4>(g, s, h, scratch);
    case 64:  // LlamaGen's GPT-B, L, XL
      return RowHeadImpl<8>(g, s, h, scratch);
    case 128:
      return RowHeadImpl<16>(g, s, h, scratch);
    case 4:  // the exact-distribution tests' toy models
      return RowHeadAny<4>(g, s, h, scratch);
    default:
      if (g.hd % 8 != 0) return RowHeadAny<0>(g, s, h, scratch);
      return RowHeadImpl<0>(g, s, h, scratch);
  }
}

}  // namespace

void RowAttention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const std::vector<RowAttentionSpan>& spans, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.is_cpu(),
              "RowAttention: q must be [T, H, hd] float on the CPU, hd contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "RowAttention: caches must be contiguous float [slots, capacity, H, hd]");
  const int64_t H = q.size(1), hd = q.size(2);
  TORCH_CHECK(k_cache.size(2) == H && k_cache.size(3) == hd, "RowAttention: heads differ");
  TORCH_CHECK(hd > 0 && hd <= kRowAttentionMaxHeadDim,
              "RowAttention: head size must be at most kRowAttentionMaxHeadDim");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                  out.size(0) == q.size(0) && out.size(1) == H * hd,
              "RowAttention: out must be contiguous float [T, H * hd]");
  const int64_t capacity = k_cache.size(1);
  for (const RowAttentionSpan& s : spans) {
    TORCH_CHECK(s.slot >= 0 && s.slot < k_cache.size(0) && s.cache_len >= 0 && s.n > 0 &&
                    s.cache_len + s.n <= capacity && s.t0 >= 0 && s.t0 + s.n <= q.size(0),
                "RowAttention: a span is out of range");
  }
  const Geometry g{q.data_ptr<float>(),
                   k_cache.data_ptr<float>(),
                   v_cache.data_ptr<float>(),
                   out.data_ptr<float>(),
                   q.stride(0),
                   q.stride(1),
                   capacity,
                   H,
                   hd,
                   1.0f / std::sqrt(static_cast<float>(hd))};
  // One task a (span, head); the threads take contiguous runs of tasks of about equal cost.
  // A span's queries each score its cache_len committed keys and up to n new ones (plus a
  // query's fixed work, the softmax's and the output's, counted as 8 keys): spans of one step
  // differ a lot (a request's first tokens against its last, a window of 16 against one token),
  // and an even split of the tasks by count left one thread waiting for the other.
  const int64_t tasks = static_cast<int64_t>(spans.size()) * H;
  if (tasks == 0) return;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;  // one query's scores
    for (int64_t t = begin; t < end; ++t) {
      RowHead(g, spans[static_cast<size_t>(t / H)], t % H, scratch);
    }
  };
  const int64_t parts = std::min<int64_t>(tasks, at::get_num_threads());
  if (parts <= 1) return run(0, tasks);
  // cost[i]: the summed cost of the first i spans' tasks.
  std::vector<int64_t> cost(spans.size() + 1, 0);
  for (size_t i = 0; i < spans.size(); ++i) {
    cost[i + 1] = cost[i] + H * spans[i].n * (spans[i].cache_len + spans[i].n + 8);
  }
  const int64_t total = cost.back();
  // The first task whose preceding tasks cost at least `target`.
  auto first_task_from = [&](int64_t target) {
    const auto it = std::lower_bound(cost.begin(), cost.end(), target);
    const int64_t span = it - cost.begin();  // cost[span] >= target > cost[span - 1]
    if (span == 0) return int64_t{0};
    const int64_t per_task = (cost[span] - cost[span - 1]) / H;  // > 0: n > 0
    // The first of span - 1's tasks that starts at or after the target (H: span's first task).
    const int64_t into = (target - cost[span - 1] + per_task - 1) / per_task;
    return (span - 1) * H + std::min<int64_t>(into, H);
  };
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      run(first_task_from(total * p / parts), first_task_from(total * (p + 1) / parts));
    }
  });
}

}  // namespace imagegen
