// AmxBf16Linear (the CPU forward's linear layers in bf16 on the AMX tiles, matmul precision
// "medium"): the product is bf16(x) bf16(w)^T summed in fp32 (against the same product in
// double, and not the fp32 product: the rounding is there); each row's outputs are the same bits
// at any row count and any thread split; and the bundled model's forward with it is
// batch-invariant, its logits close to fp32's but not equal. Skipped where the CPU has no AMX.
#include "engine/model/amx_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/model/gpt.h"
#include "engine/scheduler/engine.h"
#include "engine/util/read_file.h"
#include "tests/temp_dir.h"
#include "tests/build_paths.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

#define SKIP_WITHOUT_AMX()                                                            \
  if (!AmxBf16Linear::Supported()) {                                                  \
    GTEST_SKIP() << "no bf16 products on AMX here: " << AmxBf16Linear::Unsupported(); \
  }

// The bundled model's shapes (wqkv, wo, w1/w3, w2), an N that is not a multiple of 16 and a K
// that is not one of 32, and one output column.
struct Shape {
  int64_t N, K;
};
const Shape kShapes[] = {{576, 192}, {192, 192}, {512, 192}, {192, 512}, {100, 200}, {1, 40}};

at::Tensor Bf16(const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kDouble); }

TEST(AmxBf16LinearTest, IsTheBf16ProductSummedInFp32) {
  SKIP_WITHOUT_AMX();
  at::manual_seed(21);
  for (const Shape& s : kShapes) {
    const std::string what = "N " + std::to_string(s.N) + ", K " + std::to_string(s.K);
    const at::Tensor w = at::randn({s.N, s.K}) * 0.05;
    const at::Tensor x = at::randn({37, s.K});
    const AmxBf16Linear amx = AmxBf16Linear::Prepare(w);
    ASSERT_TRUE(amx.ok()) << what;
    const at::Tensor got = amx(x);
    ASSERT_EQ(got.sizes(), (std::vector<int64_t>{37, s.N})) << what;
    EXPECT_TRUE(got.is_contiguous()) << what;
    // Sums of products of bf16 inputs (exact in fp32) rounded K times in fp32: within a few
    // fp32 ulps of the magnitudes summed.
    const at::Tensor want = at::linear(Bf16(x), Bf16(w));
    const at::Tensor scale = at::linear(Bf16(x).abs(), Bf16(w).abs());
    const double err = ((got.to(at::kDouble) - want).abs() / (scale + 1e-30)).max().item<double>();
    EXPECT_LT(err, 1e-5) << what;
    // And not the fp32 product: the inputs' rounding to bf16 moves it by about 2^-9 relative
    // (the power of the comparison above: a kernel that skipped the rounding would fail it).
    const double off =
        ((got.to(at::kDouble) - at::linear(x.to(at::kDouble), w.to(at::kDouble))).abs() /
         (scale + 1e-30))
            .max()
            .item<double>();
    EXPECT_GT(off, 1e-4) << what;
    std::printf("%s: %.1e of the summed magnitudes from the bf16 product, %.1e from fp32's\n",
                what.c_str(), err, off);
  }
}

// x is rounded as Tensor.to(bf16) rounds it, in the vector loop and its scalar tail alike: an
// identity weight hands each rounded input back (exactly: one product by 1, the rest by 0),
// ties to even both ways included. (Not NaN, infinities or subnormals: the tiles multiply those
// by the zeros too, and flush subnormal inputs.)
TEST(AmxBf16LinearTest, XIsRoundedAsTensorToBf16) {
  SKIP_WITHOUT_AMX();
  at::manual_seed(23);
  const int64_t K = 40;  // two vectors of 16 and a tail of 8
  const AmxBf16Linear amx = AmxBf16Linear::Prepare(at::eye(K));
  at::Tensor x = at::randn({3, K});
  // Row 1: halfway between two bf16 values, with an even and an odd upper half in turn.
  at::Tensor bits = x.narrow(0, 1, 1).view(at::kInt);
  bits.copy_(at::bitwise_or(at::bitwise_and(bits, ~0xffff), 0x8000));
  bits.narrow(1, 0, K / 2).copy_(at::bitwise_and(bits.narrow(1, 0, K / 2), ~0x10000));
  bits.narrow(1, K / 2, K / 2).copy_(at::bitwise_or(bits.narrow(1, K / 2, K / 2), 0x10000));
  const at::Tensor got = amx(x), want = x.to(at::kBFloat16).to(at::kFloat);
  EXPECT_TRUE(at::equal(got.view(at::kInt), want.view(at::kInt)));
  EXPECT_FALSE(at::equal(got, x));  // it did round
}

// Batch invariance by construction: a row's outputs do not depend on how many rows are computed
// with it, where it stands among them (a block of 16 or the padded last one), or the threads.
TEST(AmxBf16LinearTest, EveryRowIsTheSameBitsAtAnyRowCountAndThreads) {
  SKIP_WITHOUT_AMX();
  at::manual_seed(22);
  const int threads = at::get_num_threads();
  for (const Shape& s : kShapes) {
    const std::string what = "N " + std::to_string(s.N) + ", K " + std::to_string(s.K);
    const AmxBf16Linear amx = AmxBf16Linear::Prepare(at::randn({s.N, s.K}) * 0.05);
    const at::Tensor x = at::randn({70, s.K});
    at::set_num_threads(1);
    const at::Tensor one_thread = amx(x);
    at::set_num_threads(2);
    EXPECT_TRUE(at::equal(amx(x), one_thread)) << what << ", two threads";
    for (int64_t m : {1, 2, 5, 15, 16, 17, 33}) {
      for (int64_t at_row : {int64_t{0}, 70 - m, int64_t{3}}) {
        EXPECT_TRUE(at::equal(amx(x.narrow(0, at_row, m)), one_thread.narrow(0, at_row, m)))
            << what << ", rows " << at_row << " .. " << at_row + m - 1;
      }
    }
    // A strided x (a column slice) is read as its values.
    const at::Tensor wide = at::randn({4, 2 * s.K});
    const at::Tensor view = wide.narrow(1, s.K / 2, s.K);
    EXPECT_TRUE(at::equal(amx(view), amx(view.contiguous()))) << what;
  }
  at::set_num_threads(threads);
}

// The bundled model with every linear layer in bf16: each request's logits are the same bits
// alone and among other requests (rows from 2 to 48: one tile block and several), and close to
// the fp32 forward's without being equal.
TEST(AmxBf16LinearTest, TheForwardIsBatchInvariantAndNearFp32) {
  SKIP_WITHOUT_AMX();
  LoadOptions fp32, medium;
  medium.bf16_matmul = true;
  auto exact = Gpt::Load(std::string(testing::TestModelsDir()) + "/fmnist-gpt", fp32);
  auto bf16 = Gpt::Load(std::string(testing::TestModelsDir()) + "/fmnist-gpt", medium);
  ASSERT_TRUE(exact.ok() && bf16.ok());
  EXPECT_EQ((*exact)->bf16_matmul_tried(), 0);
  EXPECT_EQ((*bf16)->bf16_matmul_tried(), 6 * 5 + 1);
  EXPECT_EQ((*bf16)->bf16_matmul_linears(), (*bf16)->bf16_matmul_tried());
  EXPECT_EQ((*bf16)->small_rows_tried(), 0);  // every product is the tiles'
  const GptConfig& cfg = (*bf16)->config();
  ForwardOptions inv;
  inv.batch_invariant = true;
  const std::vector<int64_t> lengths = {0, 3, 7, 15};  // 1 to 16 tokens a row
  std::vector<BatchRow> all;
  std::vector<at::Tensor> alone;
  double worst = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    const std::vector<BatchRow> rows =
        testing::CfgRequestRows(cfg, static_cast<int64_t>(r), lengths[r]);
    all.insert(all.end(), rows.begin(), rows.end());
    KvCache c1 = (*bf16)->NewCache(2 * lengths.size()), c2 = (*exact)->NewCache(2 * lengths.size());
    auto a = (*bf16)->Forward(rows, c1, {}, inv);
    auto b = (*exact)->Forward(rows, c2, {}, inv);
    ASSERT_TRUE(a.ok() && b.ok());
    alone.push_back(*a);
    EXPECT_FALSE(at::equal(*a, *b)) << "the bf16 products round";
    const double diff = (*a - *b).abs().max().item<double>();
    const double range = b->abs().max().item<double>();
    worst = std::max(worst, diff / range);
    EXPECT_LT(diff, 0.05 * range) << "request of " << lengths[r] + 1 << " tokens a row";
    // The same next token where fp32 is sure of it (its top logit clear of the second).
    const at::Tensor top2 = std::get<0>(b->topk(2, 1));
    const at::Tensor sure = (top2.select(1, 0) - top2.select(1, 1)) > 4 * diff;
    EXPECT_TRUE(at::equal(a->argmax(1).masked_select(sure), b->argmax(1).masked_select(sure)));
  }
  std::printf("bf16 products: logits within %.2f%% of the fp32 forward's range\n", 100 * worst);
  KvCache c = (*bf16)->NewCache(2 * lengths.size());
  auto together = (*bf16)->Forward(all, c, {}, inv);  // 2 + 8 + 16 + 32 = 58 rows of tokens
  ASSERT_TRUE(together.ok());
  int64_t t = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    const int64_t n = alone[r].size(0);
    EXPECT_TRUE(at::equal(together->narrow(0, t, n), alone[r]))
        << "request of " << lengths[r] + 1 << " tokens a row: alone against among the others";
    t += n;
  }
}

// The engine's option: "medium" turns the tiles on for the CPU's fp32 forward, which the step
// cost's cache key says (a calibration of the fp32 products is not reused for them); an unknown
// precision is refused naming the field.
TEST(AmxBf16LinearTest, TheEnginesMatmulPrecisionOption) {
  namespace fs = std::filesystem;
  EngineOptions o;
  o.models_dir = testing::TestModelsDir();
  o.matmul_precision = "low";
  auto bad = Engine::Start(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("matmul_precision"), std::string::npos)
      << bad.status().message();
  SKIP_WITHOUT_AMX();
  o.matmul_precision = "medium";
  o.cache_dir = testing::TempDir("amx_step_cost") + "/cache";
  const auto [file, text] = testing::StepCostFileAfterAStart(o);
  ASSERT_FALSE(file.empty());
  EXPECT_NE(file.find("step-cost-fmnist-gpt-cpu-Float-"), std::string::npos) << file;
  EXPECT_NE(file.find("threads-bf16mm.json"), std::string::npos)
      << file;  // beside the fp32 products' file, not in its place
  EXPECT_NE(text.find("bf16 products (AMX) on 31 of 31 linear layers"), std::string::npos) << text;
  EXPECT_EQ(text.find("few-row kernel"), std::string::npos) << text;
}

}  // namespace
}  // namespace imagegen
