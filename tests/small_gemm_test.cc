// SmallRowsLinear (the batch-invariant forward's linear layers on fewer than 16 rows, on the
// CPU): where Prepare accepts a weight, every row's product is the BLAS's own bits for that row
// in a matrix of 16 or more rows, with the AVX-512 tiles and the AVX2 ones; a wrong k-blocking
// rounds differently (so the check at load can tell); and the forward's logits are the same bits
// with the kernel and with the padded products, alone and among enough rows for the BLAS.
#include "engine/model/small_gemm.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "engine/model/gpt.h"
#include "tests/build_paths.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

// Where the kernel has been seen to reproduce the BLAS for every shape below: MKL 2024.2 (the
// LibTorch wheel's) on Intel CPUs with AVX-512 (the dev VM's Xeon). Elsewhere Prepare may
// legitimately decline, and the forward then pads as before.
bool KnownToReproduce() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return at::hasMKL() && __builtin_cpu_is("intel") && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

std::string Blocks(const std::vector<int64_t>& b) {
  std::string s;
  for (int64_t k : b) {
    if (!s.empty()) s.push_back('+');
    s.append(std::to_string(k));
  }
  return s.empty() ? "none" : s;
}

// The bundled model's shapes (wqkv, wo, w1/w3, w2, output), an odd N, a K the BLAS takes in
// two blocks (on the dev VM 256 + 256), and one whose 16-row products it computes otherwise
// (K 1024: on the dev VM no blocking reproduces them, and MKL's rows at 16 to 128 rows differ
// from its rows at 512), which Prepare may decline.
struct Shape {
  int64_t K, N;
  bool expected;  // reproduced where KnownToReproduce()
};
const Shape kShapes[] = {{192, 576, true}, {192, 192, true}, {192, 512, true}, {512, 192, true},
                         {192, 100, true}, {512, 40, true},  {1024, 48, false}};

TEST(SmallRowsLinearTest, EveryRowIsTheBlasRowOfALargerMatrixBitForBit) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  at::manual_seed(11);
  int accepted = 0;
  for (const Shape& s : kShapes) {
    const at::Tensor w = at::randn({s.N, s.K}) * 0.05;
    const at::Tensor x = at::randn({64, s.K});
    const SmallRowsLinear small = SmallRowsLinear::Prepare(w);
    const std::string what = "K " + std::to_string(s.K) + ", N " + std::to_string(s.N);
    std::printf("%s: blocks %s\n", what.c_str(), Blocks(small.blocks()).c_str());
    if (KnownToReproduce() && s.expected) {
      EXPECT_TRUE(small.ok()) << what;
    }
    if (!small.ok()) continue;
    ++accepted;
    const at::Tensor many = at::linear(x, w);  // 64 rows: the BLAS's large-matrix kernels
    // The AVX2 tiles, which run where the CPU has no AVX-512: the same bits.
    const SmallRowsLinear avx2 = SmallRowsLinear::WithBlocks(w, small.blocks(), false);
    for (int64_t m = 1; m < 16; ++m) {
      const at::Tensor padded = at::zeros({16, s.K});
      padded.narrow(0, 0, m).copy_(x.narrow(0, 0, m));
      const at::Tensor got = small(x.narrow(0, 0, m));
      EXPECT_TRUE(at::equal(got, at::linear(padded, w).narrow(0, 0, m))) << what << ", m " << m;
      EXPECT_TRUE(at::equal(got, many.narrow(0, 0, m))) << what << ", m " << m;
      EXPECT_TRUE(at::equal(avx2(x.narrow(0, 0, m)), got)) << what << ", m " << m << ", AVX2";
      // Rows from the middle of a larger input (a strided view is made contiguous).
      EXPECT_TRUE(at::equal(small(x.narrow(0, 40, m)), many.narrow(0, 40, m))) << what;
    }
  }
  std::printf("%d of %zu shapes reproduced\n", accepted, std::size(kShapes));
}

// The rows Prepare's timing lets the kernel take (16 or more where it was faster than the BLAS
// here) are the BLAS's own bits at counts between and at those it timed, for other inputs than
// its probe's (the timing checks the bits itself; this is the check of that check).
TEST(SmallRowsLinearTest, TheRowsTheTimingChoseAreTheBlasRowsBitForBit) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  at::manual_seed(13);
  for (const Shape& s : kShapes) {
    const at::Tensor w = at::randn({s.N, s.K}) * 0.05;
    const SmallRowsLinear small = SmallRowsLinear::Prepare(w);
    if (!small.ok()) continue;
    const std::string what = "K " + std::to_string(s.K) + ", N " + std::to_string(s.N);
    std::printf("%s: up to %lld rows\n", what.c_str(), static_cast<long long>(small.max_rows()));
    EXPECT_GE(small.max_rows(), small.tile_rows()) << what;
    EXPECT_LE(small.max_rows(), kSmallRowsMeasuredMax) << what;
    for (int64_t m = 16; m <= small.max_rows(); m += m < 64 ? 8 : 32) {
      const at::Tensor x = at::randn({m, s.K});
      EXPECT_TRUE(at::equal(small(x), at::linear(x, w))) << what << ", m " << m;
    }
  }
}

// ChooseMaxRows on made-up timings: the kernel takes the rows up to the first count where it
// is not at least 10% faster or not the same bits, and its tile's limit below 16 where the
// first count fails.
TEST(SmallRowsLinearTest, TheKernelTakesRowsUpToWhereItStopsBeingClearlyFaster) {
  auto t = [](int64_t rows, double kernel, double blas, bool same = true) {
    SmallRowsTiming x;
    x.rows = rows;
    x.kernel_seconds = kernel;
    x.blas_seconds = blas;
    x.same_bits = same;
    return x;
  };
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows({}, 11), 11);
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows({t(16, 1.0, 1.0)}, 11), 11);  // not 10% faster
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows({t(16, 0.95, 1.0)}, 15), 15);
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows({t(16, 0.5, 1.0)}, 11), 16);
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows(
                {t(16, 0.5, 1.0), t(32, 0.7, 1.0), t(64, 0.95, 1.0), t(128, 0.5, 1.0)}, 11),
            32);  // the run stops at 64, though 128 is faster again
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows({t(16, 0.5, 1.0), t(32, 0.5, 1.0, false)}, 11), 16);
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows({t(16, 0.5, 1.0, false)}, 11), 11);
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows({t(16, inf, inf)}, 11), 11);
  EXPECT_EQ(SmallRowsLinear::ChooseMaxRows({t(16, std::nan(""), 1.0)}, 11), 11);
}

// The power of Prepare's check: the kernel with another k-blocking than the BLAS's rounds some
// outputs differently, which the bit-for-bit comparison sees.
TEST(SmallRowsLinearTest, AnotherBlockingRoundsDifferently) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  at::manual_seed(12);
  const at::Tensor w = at::randn({576, 192}) * 0.05;
  const at::Tensor x = at::randn({16, 192});
  const at::Tensor want = at::linear(x, w);
  const SmallRowsLinear prepared = SmallRowsLinear::Prepare(w);
  for (const std::vector<int64_t>& other :
       std::vector<std::vector<int64_t>>{{96, 96}, {64, 64, 64}, {128, 64}, {192}}) {
    if (prepared.ok() && other == prepared.blocks()) continue;
    const at::Tensor got = SmallRowsLinear::WithBlocks(w, other)(x);
    EXPECT_LT((got - want).abs().max().item<float>(), 1e-4f) << Blocks(other);  // same sums
    EXPECT_FALSE(at::equal(got, want)) << Blocks(other) << " rounds as the BLAS does";
  }
  if (KnownToReproduce()) {
    EXPECT_EQ(Blocks(prepared.blocks()), "192");
  }
}

// The bundled model's forward, batch-invariant: each request's logits with the kernel equal
// those with the padded products bit for bit, alone (2 to 14 rows: the kernel) and among other
// requests (36 rows: the BLAS without the kernel; with it, the kernel where the timing at load
// chose it, and the kernel on every row of a model told to give it up to 256).
TEST(SmallRowsLinearTest, TheForwardsLogitsAreThePaddedForwardsBitForBit) {
  LoadOptions on, off, every;
  off.small_rows_gemm = false;
  every.small_rows_gemm_rows = 256;
  auto with = Gpt::Load(std::string(testing::TestModelsDir()) + "/fmnist-gpt", on);
  auto without = Gpt::Load(std::string(testing::TestModelsDir()) + "/fmnist-gpt", off);
  auto always = Gpt::Load(std::string(testing::TestModelsDir()) + "/fmnist-gpt", every);
  ASSERT_TRUE(with.ok() && without.ok() && always.ok());
  EXPECT_EQ((*without)->small_rows_tried(), 0);
  std::printf("kernel on %lld of %lld linear layers, up to %lld-%lld rows\n",
              static_cast<long long>((*with)->small_rows_linears()),
              static_cast<long long>((*with)->small_rows_tried()),
              static_cast<long long>((*with)->small_rows_min()),
              static_cast<long long>((*with)->small_rows_max()));
  if ((*always)->small_rows_linears() > 0) {
    EXPECT_EQ((*always)->small_rows_min(), 256);
    EXPECT_EQ((*always)->small_rows_max(), 256);
  }
  if (KnownToReproduce()) {
    EXPECT_EQ((*with)->small_rows_linears(), (*with)->small_rows_tried());
    EXPECT_EQ((*with)->small_rows_tried(), 6 * 5 + 1);
  }
  const GptConfig& cfg = (*with)->config();
  auto request = [&](int64_t r, int64_t n) { return testing::CfgRequestRows(cfg, r, n); };
  ForwardOptions inv;
  inv.batch_invariant = true;
  const std::vector<int64_t> lengths = {0, 1, 2, 4, 6};  // 2 to 14 rows of new tokens
  std::vector<BatchRow> all;
  std::vector<at::Tensor> alone_with;
  for (size_t r = 0; r < lengths.size(); ++r) {
    const std::vector<BatchRow> rows = request(static_cast<int64_t>(r), lengths[r]);
    all.insert(all.end(), rows.begin(), rows.end());
    KvCache c1 = (*with)->NewCache(2 * lengths.size()),
            c2 = (*without)->NewCache(2 * lengths.size());
    auto a = (*with)->Forward(rows, c1, {}, inv);
    auto b = (*without)->Forward(rows, c2, {}, inv);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(at::equal(*a, *b)) << "request of " << lengths[r] + 1 << " tokens a row, alone";
    alone_with.push_back(*a);
  }
  KvCache c = (*with)->NewCache(2 * lengths.size());
  auto together = (*with)->Forward(all, c, {}, inv);  // 2 + 4 + 6 + 10 + 14 = 36 rows
  ASSERT_TRUE(together.ok());
  KvCache c2 = (*without)->NewCache(2 * lengths.size()),
          c3 = (*always)->NewCache(2 * lengths.size());
  auto blas = (*without)->Forward(all, c2, {}, inv);
  auto kernel = (*always)->Forward(all, c3, {}, inv);
  ASSERT_TRUE(blas.ok() && kernel.ok());
  EXPECT_TRUE(at::equal(*together, *blas)) << "36 rows: as timed at load, against the BLAS";
  EXPECT_TRUE(at::equal(*kernel, *blas)) << "36 rows: the kernel on every row, against the BLAS";
  int64_t t = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    const int64_t n = alone_with[r].size(0);
    EXPECT_TRUE(at::equal(together->narrow(0, t, n), alone_with[r]))
        << "request of " << lengths[r] + 1 << " tokens a row: alone (the kernel) against "
        << "among the others (the BLAS)";
    t += n;
  }
}

}  // namespace
}  // namespace imagegen
