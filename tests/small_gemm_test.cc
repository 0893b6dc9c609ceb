// SmallRowsLinear (the batch-invariant forward's linear layers on fewer than 16 rows, on the
// CPU): where Prepare accepts a weight, every row's product is the BLAS's own bits for that row
// in a matrix of 16 or more rows, with the AVX-512 tiles and the AVX2 ones; a wrong k-blocking
// rounds differently (so the check at load can tell); and the forward's logits are the same bits
// with the kernel and with the padded products, alone and among enough rows for the BLAS. The
// kernel on every row count (EveryRow, LoadOptions::engine_linear): a row's bits the same at any
// row count, the forward batch-invariant by construction.
#include "engine/model/small_gemm.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/gpt.h"
#include "engine/scheduler/engine.h"
#include "engine/util/read_file.h"
#include "tests/build_paths.h"
#include "tests/temp_dir.h"
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

// The kernel's runs of k-blocks (Panels, for more than one row tile and K over 1,024) carry
// their sums in the output: a row's bits are the same at every row count, with the AVX-512
// tiles and the AVX2 ones, for the blockings of EveryRow and of the BLAS-matching kernel. A
// run that dropped the earlier runs' sums, or added them in another order, fails here.
TEST(SmallRowsLinearTest, ARowsBitsAreTheSameAtEveryRowCount) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  at::manual_seed(13);
  for (const int64_t K : {192, 1000, 2816, 5000}) {
    const at::Tensor w = at::randn({72, K}) * 0.05;  // 4.5 panels: a pair, a pair, a single
    const at::Tensor x = at::randn({41, K});
    for (const bool avx512 : {true, false}) {
      SmallRowsLinear every = SmallRowsLinear::EveryRow(w);
      ASSERT_TRUE(every.ok());
      EXPECT_TRUE(every.every_row());
      SmallRowsLinear few = SmallRowsLinear::WithBlocks(w, {K / 2, K - K / 2}, avx512);
      SmallRowsLinear again = SmallRowsLinear::WithBlocks(w, every.blocks(), avx512);
      for (const SmallRowsLinear* s : {&few, &again}) {
        const at::Tensor all = (*s)(x);
        EXPECT_LT((all - at::linear(x, w)).abs().max().item<float>(), 1e-3f * std::sqrt(K));
        for (const int64_t m : {1, 5, 6, 7, 13, 40}) {
          for (const int64_t from : {int64_t{0}, 41 - m}) {
            EXPECT_TRUE(at::equal((*s)(x.narrow(0, from, m)), all.narrow(0, from, m)))
                << "K " << K << ", blocks " << Blocks(s->blocks()) << ", rows " << from << ".."
                << from + m - 1 << " of 41, avx512 " << avx512;
          }
        }
      }
      // The AVX2 tiles compute the AVX-512 tiles' bits.
      EXPECT_TRUE(at::equal(every(x), again(x))) << "K " << K << ", avx512 " << avx512;
    }
  }
}

// EveryRow rounds other than the BLAS where their blocks differ (no check against it): its
// products equal the BLAS's within fp32 rounding, and on a K that MKL sums in one block on the
// dev VM's Xeon (384) not bit for bit. Its blocks are kEveryRowBlock, the last the rest.
TEST(SmallRowsLinearTest, EveryRowsBlocksAreFixedAndItsProductsTheBlasWithinRounding) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  at::manual_seed(17);
  const at::Tensor w = at::randn({100, 384}) * 0.05;
  const SmallRowsLinear s = SmallRowsLinear::EveryRow(w);
  EXPECT_EQ(Blocks(s.blocks()), "256+128");
  EXPECT_EQ(s.max_rows(), std::numeric_limits<int64_t>::max());
  const at::Tensor x = at::randn({300, 384});
  const at::Tensor got = s(x), want = at::linear(x, w);
  EXPECT_LT((got - want).abs().max().item<float>(), 1e-4f);
  if (KnownToReproduce()) {
    EXPECT_FALSE(at::equal(got, want)) << "MKL's blocks here are not 256+128";
  }
}

// The forward with the engine's kernel on every linear product (LoadOptions::engine_linear):
// each request's logits are the same bits alone and among the others, batch-invariant or not
// (the kernel is the forward's only product either way), and within rounding of the BLAS's
// forward. With it off the non-invariant forward's logits depend on the batch (the BLAS on
// other row counts), which is what shows the check has power.
TEST(SmallRowsLinearTest, TheEngineLinearForwardIsBatchInvariantAtAnyRowCount) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  LoadOptions engine, blas;
  engine.engine_linear = true;
  auto own = Gpt::Load(std::string(testing::TestModelsDir()) + "/fmnist-gpt", engine);
  auto ref = Gpt::Load(std::string(testing::TestModelsDir()) + "/fmnist-gpt", blas);
  ASSERT_TRUE(own.ok() && ref.ok());
  EXPECT_TRUE((*own)->engine_linear());
  EXPECT_FALSE((*ref)->engine_linear());
  EXPECT_EQ((*own)->small_rows_linears(), (*own)->small_rows_tried());
  const GptConfig& cfg = (*own)->config();
  const std::vector<int64_t> lengths = {0, 3, 40, 1, 60};  // 2 to 122 rows of new tokens
  std::vector<BatchRow> all;
  std::vector<std::vector<BatchRow>> each;
  for (size_t r = 0; r < lengths.size(); ++r) {
    each.push_back(testing::CfgRequestRows(cfg, static_cast<int64_t>(r), lengths[r]));
    all.insert(all.end(), each.back().begin(), each.back().end());
  }
  int differs_with_blas = 0;
  for (const bool invariant : {true, false}) {
    ForwardOptions fo;
    fo.batch_invariant = invariant;
    for (Gpt* g : {own->get(), ref->get()}) {
      KvCache c = g->NewCache(2 * lengths.size());
      auto together = g->Forward(all, c, {}, fo);
      ASSERT_TRUE(together.ok());
      int64_t t = 0;
      for (size_t r = 0; r < lengths.size(); ++r) {
        KvCache c1 = g->NewCache(2 * lengths.size());
        auto alone = g->Forward(each[r], c1, {}, fo);
        ASSERT_TRUE(alone.ok());
        const int64_t n = alone->size(0);
        const bool same = at::equal(together->narrow(0, t, n), *alone);
        if (g == own->get()) {
          EXPECT_TRUE(same) << "request " << r << " (" << lengths[r] + 1
                            << " tokens a row), invariant " << invariant;
        } else if (!invariant && !same) {
          ++differs_with_blas;
        }
        t += n;
      }
      if (g == own->get()) {
        KvCache c2 = (*ref)->NewCache(2 * lengths.size());
        auto blas_logits = (*ref)->Forward(all, c2, {}, fo);
        ASSERT_TRUE(blas_logits.ok());
        // The bundled model's K (192 and 512) are blocked as MKL blocks them on the dev VM, so
        // there the invariant forward's bits may be the BLAS's; within rounding anywhere.
        EXPECT_LT((*together - *blas_logits).abs().max().item<float>(), 1e-3f);
        std::printf("engine's kernel against the BLAS, invariant %d: %s\n", invariant,
                    at::equal(*together, *blas_logits) ? "the same bits" : "other bits");
      }
    }
  }
  EXPECT_GT(differs_with_blas, 0) << "the BLAS's non-invariant forward was batch-invariant too";
}

// The engine's option: "engine" reaches the model (the step cost's cache key says so, in a file
// of its own beside the BLAS products' calibration). An unknown value is refused naming it:
// EngineTest.BadEngineOptionsAreRejected.
TEST(SmallRowsLinearTest, TheEnginesCpuLinearOption) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  EngineOptions o;
  o.models_dir = testing::TestModelsDir();
  o.cpu_linear = "engine";
  o.cache_dir = testing::TempDir("engine_linear_step_cost") + "/cache";
  const auto [file, text] = testing::StepCostFileAfterAStart(o);
  ASSERT_FALSE(file.empty());
  EXPECT_NE(file.find("threads-enginelinear.json"), std::string::npos) << file;
  EXPECT_NE(text.find("the engine's kernel on every linear product"), std::string::npos) << text;
  EXPECT_EQ(text.find("few-row kernel"), std::string::npos) << text;
  EXPECT_TRUE(testing::FilesStartingWith(o.cache_dir, "few-row-kernel-").empty())
      << "no rows kept for a kernel that is not timed";
}

// Rows remembered for a shape (SmallRowsLinear::RememberRows, what the engine reads from its
// cache directory) are what a later Prepare takes, without timing; MeasuredRows lists them.
TEST(SmallRowsLinearTest, RememberedRowsAreTakenWithoutTiming) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  const std::vector<SmallRowsChoice> saved = SmallRowsLinear::MeasuredRows();
  at::manual_seed(19);
  const at::Tensor w = at::randn({100, 192}) * 0.05;  // one block: where the BLAS has one too
  const SmallRowsLinear first = SmallRowsLinear::Prepare(w);
  if (!first.ok()) GTEST_SKIP() << "the kernel does not reproduce this BLAS";
  SmallRowsChoice c{100, 192, first.blocks(), false, at::get_num_threads(), 48};
  bool found = false;
  for (const SmallRowsChoice& m : SmallRowsLinear::MeasuredRows()) {
    if (m.n == 100 && m.k == 192 && m.threads == c.threads) {
      c.avx512 = m.avx512;
      found = m.rows == first.max_rows();
    }
  }
  EXPECT_TRUE(found) << "the timing's choice is listed";
  for (const int64_t rows : {48, 80}) {
    c.rows = rows;
    SmallRowsLinear::RememberRows({c});
    EXPECT_EQ(SmallRowsLinear::Prepare(w).max_rows(), rows);
  }
  SmallRowsLinear::RememberRows(saved);
}

// The kept file: written and read back the same; a broken one is refused naming the field.
TEST(SmallRowsLinearTest, TheKeptChoicesRoundTripAndBrokenOnesNameTheField) {
  const std::vector<SmallRowsChoice> choices = {{576, 192, {192}, true, 2, 32},
                                                {192, 512, {256, 256}, false, 1, 16}};
  auto back = ParseSmallRowsChoices(SerializeSmallRowsChoices(choices), "rows.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, choices);
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {R"({"format": "other", "choices": []})", "'format'"},
           {R"({"format": "imagegen-few-row-kernel-rows"})", "'choices'"},
           {R"({"format": "imagegen-few-row-kernel-rows", "choices": [{"n": 5, "k": 192,
              "blocks": [100, 100], "avx512": true, "threads": 2, "rows": 16}]})",
            "choices[0]"},
           {R"({"format": "imagegen-few-row-kernel-rows", "choices": [{"n": 5, "k": 192,
              "blocks": [192], "threads": 2}]})",
            "'rows'"},
           {"{", "rows.json"}}) {
    auto bad = ParseSmallRowsChoices(text, "rows.json");
    ASSERT_FALSE(bad.ok()) << text;
    EXPECT_NE(bad.status().message().find(want), std::string::npos)
        << bad.status().message() << " (wanted " << want << ")";
  }
}

// The engine keeps the kernel's rows in its cache directory and takes them on the next start:
// a file whose rows say 48 (a count the timing never chooses) is what the second start uses.
TEST(SmallRowsLinearTest, TheEngineKeepsTheKernelsRowsBesideItsCalibration) {
  if (!SmallRowsLinear::Supported()) GTEST_SKIP() << "no AVX2 and FMA here";
  namespace fs = std::filesystem;
  const std::vector<SmallRowsChoice> saved = SmallRowsLinear::MeasuredRows();
  EngineOptions o;
  o.models_dir = testing::TestModelsDir();
  o.cache_dir = testing::TempDir("small_rows_kept") + "/cache";
  auto engine = Engine::Start(o);
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  engine->reset();
  const std::vector<std::string> kept_files =
      testing::FilesStartingWith(o.cache_dir, "few-row-kernel-");
  ASSERT_EQ(kept_files.size(), 1u) << o.cache_dir;
  const std::string path = kept_files[0];
  auto text = ReadFile(path);
  ASSERT_TRUE(text.ok());
  auto kept = ParseSmallRowsChoices(*text, path);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  EXPECT_GE(kept->size(), 1u);
  for (SmallRowsChoice& c : *kept) c.rows = 48;
  ASSERT_TRUE(WriteFileAtomically(path, SerializeSmallRowsChoices(*kept)).ok());
  auto again = Engine::Start(o);
  ASSERT_TRUE(again.ok()) << again.status().message();
  again->reset();
  int taken = 0;
  for (const SmallRowsChoice& m : SmallRowsLinear::MeasuredRows()) {
    for (const SmallRowsChoice& c : *kept) {
      if (m.n == c.n && m.k == c.k && m.blocks == c.blocks && m.threads == c.threads) {
        EXPECT_EQ(m.rows, 48) << "n " << m.n << ", k " << m.k;
        ++taken;
      }
    }
  }
  EXPECT_EQ(taken, static_cast<int>(kept->size()));
  auto after = ReadFile(path);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*after, SerializeSmallRowsChoices(*kept)) << "the kept file was rewritten";
  SmallRowsLinear::RememberRows(saved);
}

}  // namespace
}  // namespace imagegen
