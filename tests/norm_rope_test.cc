// RowNorm and RopeRows (the reference layer's RMSNorm and rotary embedding on the CPU in fp32 as
// one kernel each): where Prepare accepts a width, the kernel's outputs are the ATen ops' bits
// on other rows too (few rows, more rows than ATen reduces on one thread, every magnitude), and
// the other width rounds differently (so the check at load can tell); the rotary kernel equals
// the ops in both layouts; and a model's logits are the same bits with the kernels and with the
// ops, for LlamaGen's layout (the bundled model) and Janus's (a tiny random one).
#include "engine/model/norm_rope.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/model/gpt.h"
#include "tests/build_paths.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

// Where the kernels have been seen to reproduce the ops: the LibTorch wheel's ATen on x86-64
// (its reductions at 8 lanes on the dev VM's AVX-512 Xeon). Elsewhere (another architecture,
// whose vectors have other widths) Prepare may legitimately decline, and the forward then runs
// the ops.
constexpr bool kExpectReproduced =
#if defined(__x86_64__)
    true;
#else
    false;
#endif

at::Tensor Rows(int64_t rows, int64_t d, uint64_t seed, double lo_exp, double hi_exp) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  at::Tensor x = at::randn({rows, d}, gen, at::kFloat);
  at::Tensor e = at::rand({rows, 1}, gen, at::kFloat) * (hi_exp - lo_exp) + lo_exp;
  return x * at::pow(10.0, e);
}

// The bundled model's dim (192), GPT-B's, -L's and -XL's (768, 1024, 1280), one with elements
// past the last whole vector (100), and one whose vectors fill the sum's cascade (4096: 64
// groups of four vectors of 16, or 128 of 8, past the first level's 16).
const int64_t kDims[] = {192, 768, 1024, 1280, 100, 4096};

TEST(RowNormTest, EqualsTheOpsBitForBitAndTheOtherWidthDoesNot) {
  for (int64_t d : kDims) {
    SCOPED_TRACE("dim " + std::to_string(d));
    const RowNorm norm = RowNorm::Prepare(d, 1e-5);
    if (!norm.ok()) {
      EXPECT_FALSE(kExpectReproduced) << "no lane count reproduces ATen's RMSNorm here";
      continue;
    }
    std::printf("dim %lld: %d lanes\n", static_cast<long long>(d), norm.lanes());
    at::Generator gen = at::detail::createCPUGenerator(99);
    const at::Tensor w = at::randn({d}, gen, at::kFloat);
    // Other rows than Prepare's: 1 to 3 rows, magnitudes 1e-6 to 1e6, rows of zeros, and more
    // rows than ATen reduces on one thread (32768 elements), so that both split their rows.
    std::vector<at::Tensor> cases = {Rows(1, d, 1, -1, 1), Rows(2, d, 2, -6, 6),
                                     Rows(3, d, 3, -3, 3), Rows(2 * 32768 / d + 5, d, 4, -6, 6),
                                     at::zeros({2, d})};
    for (const at::Tensor& x : cases) {
      EXPECT_TRUE(at::equal(norm(x, w), RmsNormOps(x, w, 1e-5))) << x.size(0) << " rows";
    }
    // The other width rounds some of 64 rows differently: Prepare's comparison has power.
    const at::Tensor x = Rows(64, d, 5, -3, 3);
    const RowNorm other = RowNorm::WithLanes(d, 1e-5, norm.lanes() == 8 ? 16 : 8);
    EXPECT_FALSE(at::equal(other(x, w), RmsNormOps(x, w, 1e-5))) << other.lanes() << " lanes";
  }
}

TEST(RowNormTest, TakesOnlyFp32RowsOfItsDim) {
  const RowNorm norm = RowNorm::WithLanes(192, 1e-5, 8);
  EXPECT_THROW(norm(at::zeros({2, 100}), at::ones({192})), c10::Error);
  EXPECT_THROW(norm(at::zeros({2, 192}, at::kDouble), at::ones({192})), c10::Error);
  EXPECT_THROW(RowNorm()(at::zeros({2, 192}), at::ones({192})), c10::Error);
}

TEST(RopeRowsTest, EqualsTheOpsBitForBitInBothLayouts) {
  // [T, 2H, hd] views of a [T, 3 * H * hd] projection, as the forward passes q and k: the
  // bundled model's 2 x 6 heads of 32, GPT-B's 2 x 12 heads of 64, a head dim of 2, and one
  // step of more rows than a thread's share.
  struct Case {
    int64_t rows, heads, hd;
  };
  for (const Case& c : {Case{1, 12, 32}, Case{3, 24, 64}, Case{40, 2, 2}, Case{600, 24, 64}}) {
    for (const bool half : {false, true}) {
      SCOPED_TRACE(std::to_string(c.rows) + " rows, " + std::to_string(c.heads) + " heads of " +
                   std::to_string(c.hd) + (half ? ", rotate-half" : ", interleaved"));
      const at::Tensor wide = Rows(c.rows, 3 * c.heads * c.hd / 2, 7, -3, 3);
      const at::Tensor x = wide.narrow(1, 0, c.heads * c.hd).view({c.rows, c.heads, c.hd});
      at::Generator gen = at::detail::createCPUGenerator(8);
      const at::Tensor angle = at::rand({c.rows, c.hd / 2}, gen, at::kFloat) * 50;
      const at::Tensor table = at::stack({at::cos(angle), at::sin(angle)}, -1);
      const at::Tensor got = RopeRows(x, table, half);
      EXPECT_TRUE(at::equal(got, RopeOps(x, table, half)));
      EXPECT_TRUE(got.is_contiguous());
      if (kExpectReproduced) {
        EXPECT_TRUE(RopeRowsMatch(c.heads, c.hd, half));
      }
    }
  }
}

// A model's forward with the kernels and with the ops: each request's logits the same bits,
// alone and among others, batch-invariant and not, over a prefill long enough that the kernels
// split their rows over threads.
void ExpectSameLogits(const std::string& dir, const std::vector<std::vector<BatchRow>>& requests) {
  LoadOptions on, off;
  off.fused_norm_rope = false;
  auto with = Gpt::Load(dir, on);
  auto without = Gpt::Load(dir, off);
  ASSERT_TRUE(with.ok() && without.ok());
  EXPECT_FALSE((*without)->norm_kernel() || (*without)->rope_kernel());
  if (kExpectReproduced) {
    EXPECT_TRUE((*with)->norm_kernel());
    EXPECT_TRUE((*with)->rope_kernel());
  }
  int64_t rows = 0;
  for (const auto& r : requests) rows += static_cast<int64_t>(r.size());
  for (const bool invariant : {true, false}) {
    ForwardOptions fo;
    fo.batch_invariant = invariant;
    std::vector<BatchRow> all;
    for (size_t i = 0; i < requests.size(); ++i) {
      all.insert(all.end(), requests[i].begin(), requests[i].end());
      KvCache c1 = (*with)->NewCache(rows), c2 = (*without)->NewCache(rows);
      auto a = (*with)->Forward(requests[i], c1, {}, fo);
      auto b = (*without)->Forward(requests[i], c2, {}, fo);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_TRUE(at::equal(*a, *b)) << "request " << i << " alone, invariant " << invariant;
    }
    KvCache c1 = (*with)->NewCache(rows), c2 = (*without)->NewCache(rows);
    auto a = (*with)->Forward(all, c1, {}, fo);
    auto b = (*without)->Forward(all, c2, {}, fo);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(at::equal(*a, *b)) << "all together, invariant " << invariant;
  }
}

TEST(NormRopeForwardTest, TheBundledModelsLogitsAreTheOpsBitForBit) {
  const std::string dir = std::string(testing::TestModelsDir()) + "/fmnist-gpt";
  auto probe = Gpt::Load(dir, {});
  ASSERT_TRUE(probe.ok());
  const GptConfig& cfg = (*probe)->config();
  auto request = [&](int64_t r, int64_t n) { return testing::CfgRequestRows(cfg, r, n); };
  // 1, 3 and 8 tokens a row, and the whole image: 2 * 197 rows, more than a thread's share.
  ExpectSameLogits(dir,
                   {request(0, 0), request(1, 2), request(2, 7), request(3, cfg.block_size - 1)});
}

TEST(NormRopeForwardTest, APromptedModelsLogitsAreTheOpsBitForBit) {
  const std::string dir = testing::WriteTinyJanus(testing::TempDir("norm-rope-janus") + "/m",
                                                  testing::TinyJanusSpec{}, 5);
  // Text ids below 8 at the prompt's positions, image ids below 3 after them.
  auto prompted = [](int64_t slot, int64_t prefix, std::vector<int64_t> tokens) {
    BatchRow r;
    r.slot = slot;
    r.group = slot;
    r.prefix = prefix;
    for (size_t i = 0; i < tokens.size(); ++i) r.positions.push_back(static_cast<int64_t>(i));
    r.tokens = std::move(tokens);
    return r;
  };
  ExpectSameLogits(dir, {{prompted(0, 4, {1, 2, 3, 4, 0, 1})}, {prompted(1, 2, {5, 6, 2})}});
}

}  // namespace
}  // namespace imagegen
