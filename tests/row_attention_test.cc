// RowAttention (the CPU forward's attention in fp32): softmax attention within rounding, every
// row's output the same bits alone, among other rows and on one thread, and the forwards that use
// it (batch-invariant or padded) equal to their SDPA calls within rounding, the first invariant.
#include "engine/model/row_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>

#include "engine/model/amx_gemm.h"
#include "engine/model/gpt.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

struct Caches {
  int64_t slots = 6, capacity = 40, H = 3, hd = 32;
  at::Tensor k, v, q;  // caches [slots, capacity, H, hd]; q [T, H, hd]
};

Caches Make(int64_t hd, int64_t T, uint64_t seed) {
  Caches s;
  s.hd = hd;
  at::manual_seed(seed);
  s.k = at::randn({s.slots, s.capacity, s.H, hd});
  s.v = at::randn({s.slots, s.capacity, s.H, hd});
  s.q = at::randn({T, s.H, hd}) * 2;  // scores of a few units: a softmax far from uniform
  return s;
}

// Softmax attention of one span in doubles, from the definition.
at::Tensor Reference(const Caches& s, const RowAttentionSpan& sp) {
  const int64_t keys = sp.cache_len + sp.n;
  at::Tensor q = s.q.narrow(0, sp.t0, sp.n).to(at::kDouble).transpose(0, 1);  // [H, n, hd]
  at::Tensor k = s.k[sp.slot].narrow(0, 0, keys).to(at::kDouble).transpose(0, 1);
  at::Tensor v = s.v[sp.slot].narrow(0, 0, keys).to(at::kDouble).transpose(0, 1);
  at::Tensor scores = at::matmul(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(s.hd));
  at::Tensor allow = at::ones({sp.n, keys}, at::kBool);
  for (int64_t i = 0; i < sp.n; ++i) {
    for (int64_t j = 0; j < sp.n; ++j) {
      const bool on = sp.mask != nullptr ? sp.mask[i * sp.n + j] != 0 : j <= i;
      allow[i][sp.cache_len + j] = on;
    }
  }
  scores = scores.masked_fill(allow.logical_not(), -INFINITY);
  return at::matmul(at::softmax(scores, -1), v).transpose(0, 1).reshape({sp.n, s.H * s.hd});
}

// A mask over n new tokens with its diagonal set and about half the rest.
std::vector<uint8_t> RandomMask(int64_t n, uint64_t seed) {
  std::vector<uint8_t> m(static_cast<size_t>(n * n));
  uint64_t x = seed;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      m[static_cast<size_t>(i * n + j)] = i == j || (x >> 33) % 2 == 0 ? 1 : 0;
    }
  }
  return m;
}

TEST(RowAttentionTest, EqualsSoftmaxAttentionWithinRounding) {
  const std::vector<uint8_t> mask6 = RandomMask(6, 3), mask8 = RandomMask(8, 5);
  // hd 32, 64 and 128 take the compiled-in sizes, 8 and 24 the run-time one, 4 (the toy
  // models') and 12 the path for other sizes (keys in vectors), as do 1, 3, 5 and 7, which the
  // forward gives it too (RowAttentionTakes): outputs in no four-float vector, or with a tail.
  for (int64_t hd : {1, 3, 4, 5, 7, 8, 12, 24, 32, 64, 128}) {
    SCOPED_TRACE("hd " + std::to_string(hd));
    // Causal rows of 1, 5 and 8 tokens at cache lengths that put the visible keys on both sides
    // of a group of eight, a masked row of 6 and one of 8 over the whole capacity.
    const std::vector<RowAttentionSpan> spans = {
        {0, 0, 1, 0, nullptr},       {1, 17, 1, 1, nullptr},  {2, 9, 5, 2, nullptr},
        {3, 23, 6, 7, mask6.data()}, {4, 24, 8, 13, nullptr}, {5, 32, 8, 21, mask8.data()}};
    const int64_t T = 30;  // rows 29 and after: no span
    Caches s = Make(hd, T, 11 + static_cast<uint64_t>(hd));
    // The threads split the 18 (span, head) tasks by their cost, some inside a span: each
    // must be done once, whatever the split.
    for (const int threads : {1, 2, 3, 5}) {
      at::Tensor out = at::full({T, s.H * hd}, 7.0f);
      {
        const testing::ScopedIntraOpThreads set(threads);
        RowAttention(s.q, s.k, s.v, spans, out);
      }
      for (const RowAttentionSpan& sp : spans) {
        const double err = (out.narrow(0, sp.t0, sp.n).to(at::kDouble) - Reference(s, sp))
                               .abs()
                               .max()
                               .item<double>();
        EXPECT_LT(err, 2e-6) << "span at t0 " << sp.t0 << ", " << threads << " thread(s)";
      }
      EXPECT_TRUE(out.narrow(0, 29, 1).eq(7.0f).all().item<bool>())
          << "a row outside the spans, " << threads << " thread(s)";
    }
  }
}

TEST(RowAttentionTest, ARowsOutputIsTheSameBitsAloneAmongOtherRowsAndOnOneThread) {
  const std::vector<uint8_t> mask = RandomMask(7, 9);
  for (int64_t hd : {4, 24, 64}) {
    SCOPED_TRACE("hd " + std::to_string(hd));
    Caches s = Make(hd, 40, 21);
    // The row under test, alone: slot 2, 19 committed entries, 7 new tokens with a mask.
    const RowAttentionSpan alone{2, 19, 7, 0, mask.data()};
    at::Tensor a = at::zeros({40, s.H * hd});
    RowAttention(s.q, s.k, s.v, {alone}, a);
    // The same row (its keys, values and queries copied) in slot 5 at query row 13, after and
    // before other rows, on two threads and on one.
    s.k[5].copy_(s.k[2]);
    s.v[5].copy_(s.v[2]);
    s.q.narrow(0, 13, 7).copy_(s.q.narrow(0, 0, 7));
    const std::vector<RowAttentionSpan> crowd = {{0, 3, 4, 8, nullptr},
                                                 {1, 30, 1, 12, nullptr},
                                                 {5, 19, 7, 13, mask.data()},
                                                 {3, 0, 8, 20, nullptr},
                                                 {4, 12, 5, 28, nullptr}};
    // Two threads set, not the default: ctest runs with OMP_NUM_THREADS=1.
    for (int threads : {2, 1}) {
      at::Tensor b = at::zeros({40, s.H * hd});
      {
        const testing::ScopedIntraOpThreads set(threads);
        RowAttention(s.q, s.k, s.v, crowd, b);
      }
      EXPECT_TRUE(at::equal(a.narrow(0, 0, 7), b.narrow(0, 13, 7)))
          << "on " << threads << " thread(s): max difference "
          << (a.narrow(0, 0, 7) - b.narrow(0, 13, 7)).abs().max().item<float>();
    }
  }
}

// A tiny random model of 25 image tokens (room for a row of 20) loaded twice, with RowAttention
// and without it.
struct WithAndWithout {
  testing::TinyGptSpec spec;
  std::unique_ptr<Gpt> with, without;
  WithAndWithout(const std::string& name, uint64_t seed, int64_t dim = 32) {
    spec.grid = 5;
    spec.dim = dim;  // four heads: a head size of dim / 4
    const std::string dir = testing::WriteTinyGpt(testing::TempDir(name) + "/m", spec, seed);
    LoadOptions off;
    off.row_attention = false;
    auto a = Gpt::Load(dir, LoadOptions{});
    auto b = Gpt::Load(dir, off);
    if (!a.ok() || !b.ok()) throw std::runtime_error("the tiny model did not load");
    with = std::move(a).value();
    without = std::move(b).value();
  }
};

// The forward: with RowAttention its logits equal those with one SDPA call per row group within
// rounding, and a row's logits are the same bits alone and in a ragged batch of rows of 1 to 21
// tokens (RowAttention takes every row; until 2026-12-06 the longest, above 16 new tokens, went
// to SDPA).
TEST(RowAttentionTest, TheBatchInvariantForwardMatchesSdpaAndStaysInvariant) {
  const WithAndWithout models("rowattn", 4);
  const testing::TinyGptSpec& spec = models.spec;
  const Gpt &with = *models.with, &without = *models.without;
  ASSERT_TRUE(with.row_attention());
  ASSERT_FALSE(without.row_attention());
  const int64_t long_row = 20;
  auto row = [&](int64_t slot, int64_t cls, int64_t n, int64_t group) {
    BatchRow r;
    r.slot = slot;
    r.group = group;
    for (int64_t i = 0; i <= n; ++i) {  // the class token, then n image tokens
      r.tokens.push_back(i == 0 ? cls : (slot * 5 + i * 3) % spec.vocab);
      r.positions.push_back(i);
    }
    return r;
  };
  const std::vector<BatchRow> batch = {row(0, 1, 0, 0), row(1, 1, 0, 0), row(2, 2, 3, 1),
                                       row(3, 0, long_row, 2), row(4, 2, 6, 3)};
  ForwardOptions inv;
  inv.batch_invariant = true;
  for (const Gpt* m : {&with, &without}) {
    KvCache c1 = m->NewCache(8), c2 = m->NewCache(8);
    auto all = m->Forward(batch, c1, {}, inv);
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    // Each request (a row group) alone, in other slots.
    int64_t t = 0;
    for (size_t r0 = 0; r0 < batch.size();) {
      size_t r1 = r0 + 1;
      while (r1 < batch.size() && batch[r1].group == batch[r0].group) ++r1;
      std::vector<BatchRow> request(batch.begin() + static_cast<std::ptrdiff_t>(r0),
                                    batch.begin() + static_cast<std::ptrdiff_t>(r1));
      int64_t n = 0;
      for (BatchRow& r : request) {
        r.slot = 7 - r.slot;
        n += static_cast<int64_t>(r.tokens.size());
      }
      auto alone = m->Forward(request, c2, {}, inv);
      ASSERT_TRUE(alone.ok()) << alone.status().ToString();
      EXPECT_TRUE(at::equal(all->narrow(0, t, n), *alone))
          << "request of row " << r0 << (m->row_attention() ? " with" : " without")
          << " RowAttention";
      t += n;
      r0 = r1;
    }
  }
  KvCache c1 = with.NewCache(8), c2 = without.NewCache(8);
  auto a = with.Forward(batch, c1, {}, inv);
  auto b = without.Forward(batch, c2, {}, inv);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_LT((*a - *b).abs().max().item<float>(), 1e-4f);
}

// The batched forward (ForwardOptions::batch_invariant off) sends every row through RowAttention
// too, in place of one SDPA call over the batch padded to its longest row: the same logits within
// rounding on a ragged batch with a row of its own mask (a tree's), a row in a non-adjacent slot
// and rows of 1 to 21 tokens. Heads of 8 (the vector path) and of 4 (the exact-distribution
// tests' toy models: the path for sizes that are not a multiple of 8).
class RowAttentionHeads : public ::testing::TestWithParam<int64_t> {};

TEST_P(RowAttentionHeads, TheBatchedForwardTakesEveryRowAndMatchesPaddedSdpa) {
  const WithAndWithout models("rowattn_batched", 9, 4 * GetParam());
  const testing::TinyGptSpec& spec = models.spec;
  const Gpt &with = *models.with, &without = *models.without;
  ASSERT_EQ(with.config().head_dim(), GetParam());
  ASSERT_TRUE(with.row_attention());
  auto row = [&](int64_t slot, int64_t cls, int64_t n) {
    BatchRow r;
    r.slot = slot;
    for (int64_t i = 0; i <= n; ++i) {
      r.tokens.push_back(i == 0 ? cls : (slot * 7 + i * 5) % spec.vocab);
      r.positions.push_back(i);
    }
    return r;
  };
  std::vector<BatchRow> prefill = {row(0, 1, 0), row(1, 1, 0), row(2, 2, 3), row(6, 0, 20),
                                   row(4, 2, 6)};
  // Then a step on top of the cache: a tree row whose fourth new token does not see its second,
  // and plain rows of 1 and 4 tokens.
  std::vector<BatchRow> step = {row(2, 2, 3), row(6, 0, 0), row(4, 2, 3)};
  for (BatchRow& r : step) {
    const int64_t len = static_cast<int64_t>(r.tokens.size());
    r.cache_len = r.slot == 2 ? 4 : r.slot == 6 ? 21 : 7;
    for (int64_t i = 0; i < len; ++i) {
      r.tokens[i] = (r.slot + 3 * i) % spec.vocab;
      r.positions[i] = r.cache_len + i;
    }
  }
  step[0].mask.assign(16, 0);
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j <= i; ++j) step[0].mask[i * 4 + j] = !(i == 3 && j == 1);
  }
  const ForwardOptions batched;  // batch_invariant off
  KvCache c1 = with.NewCache(8), c2 = without.NewCache(8);
  for (const auto* batch : {&prefill, &step}) {
    auto a = with.Forward(*batch, c1, {}, batched);
    auto b = without.Forward(*batch, c2, {}, batched);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
    ASSERT_EQ(a->sizes(), b->sizes());
    EXPECT_LT((*a - *b).abs().max().item<float>(), 1e-4f)
        << (batch == &prefill ? "prefill" : "step with a tree row");
  }
}

// The forward takes RowAttention for heads of multiples of 8 and under 8, where it was measured
// faster than SDPA, and keeps SDPA for other sizes (row_attention.h).
TEST(RowAttentionTest, HeadsOfOtherSizesKeepSdpa) {
  for (int64_t hd : {1, 4, 8, 32, 64, 256}) EXPECT_TRUE(RowAttentionTakes(hd)) << hd;
  for (int64_t hd : {0, 12, 20, 100, 264}) EXPECT_FALSE(RowAttentionTakes(hd)) << hd;
  const WithAndWithout twelve("rowattn_hd12", 3, 48);
  EXPECT_EQ(twelve.with->config().head_dim(), 12);
  EXPECT_FALSE(twelve.with->row_attention());
}

INSTANTIATE_TEST_SUITE_P(HeadSize, RowAttentionHeads, ::testing::Values(8, 4),
                         [](const ::testing::TestParamInfo<int64_t>& i) {
                           return "hd" + std::to_string(i.param);
                         });

}  // namespace

// The bundled model's batch-invariant forward, every CPU kernel of the engine in it (RowAttention,
// the few-row GEMM, the norm and rotary kernels; the AMX products where the CPU has them), gives
// the same logits bit for bit on one thread and on two: a prefill of four requests of 4-61
// tokens, then a step of 1-16 tokens a row over those caches. The kernels split their work over
// the intra-op threads (DeviceTest.TheEnginesKernelsRunOnTheIntraOpThreads), and ctest runs
// with OMP_NUM_THREADS=1, so the threads are set here.
TEST(RowAttentionTest, TheBundledForwardIsTheSameBitsOnOneThreadAndOnTwo) {
  std::vector<LoadOptions> loads(1);
  if (AmxBf16Linear::Supported()) loads.emplace_back().bf16_matmul = true;
  for (const LoadOptions& load : loads) {
    SCOPED_TRACE(load.bf16_matmul ? "bf16 products" : "fp32");
    auto gpt = Gpt::Load(std::string(testing::TestModelsDir()) + "/fmnist-gpt", load);
    ASSERT_TRUE(gpt.ok()) << gpt.status().message();
    ASSERT_TRUE((*gpt)->row_attention());
    const GptConfig& cfg = (*gpt)->config();
    ForwardOptions inv;
    inv.batch_invariant = true;
    const std::vector<int64_t> prefill = {30, 3, 60, 15}, step = {1, 4, 8, 16};
    auto run = [&](int threads) {
      const testing::ScopedIntraOpThreads set(threads);
      KvCache cache = (*gpt)->NewCache(2 * prefill.size());
      std::vector<BatchRow> first, second;
      for (size_t r = 0; r < prefill.size(); ++r) {
        for (BatchRow& b : testing::CfgRequestRows(cfg, static_cast<int64_t>(r), prefill[r])) {
          BatchRow next = b;  // the step after: step[r] tokens over the prefill's entries
          next.cache_len = prefill[r] + 1;
          next.tokens.clear();
          next.positions.clear();
          for (int64_t i = 0; i < step[r]; ++i) {
            next.tokens.push_back((r * 13 + i * 7) % cfg.vocab_size);
            next.positions.push_back(prefill[r] + 1 + i);
          }
          first.push_back(std::move(b));
          second.push_back(std::move(next));
        }
      }
      auto a = (*gpt)->Forward(first, cache, {}, inv);
      auto b = (*gpt)->Forward(second, cache, {}, inv);
      EXPECT_TRUE(a.ok() && b.ok());
      return a.ok() && b.ok() ? at::cat({*a, *b}) : at::Tensor();
    };
    const at::Tensor one = run(1), two = run(2);
    ASSERT_TRUE(one.defined() && two.defined());
    EXPECT_TRUE(at::equal(one, two)) << "max difference " << (one - two).abs().max().item<float>();
  }
}

}  // namespace imagegen
