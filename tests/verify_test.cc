// The exact acceptance rule is lossless: draft from q, keep with min(1, p/q), else resample from
// the residual, and the result is distributed as p, for any q (chi-square over 200,000 seeded
// trials). Resampling from p instead of the residual (a departure found in the SJD authors' code,
// shared/docs/algorithms.md) is caught by the same test.
#include "engine/decoding/verify.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "engine/decoding/philox.h"
#include "engine/decoding/sampling.h"
#include "tests/stats.h"

namespace imagegen {
namespace {

constexpr int64_t kTrials = 200000;

at::Tensor Uniforms(Purpose purpose) {
  std::vector<double> u(kTrials);
  for (int64_t i = 0; i < kTrials; ++i) u[i] = Uniform(17, static_cast<uint32_t>(i), 0, purpose);
  return at::tensor(u);
}

// One speculative step per trial; returns the histogram of the token that comes out.
std::vector<int64_t> SpeculativeStep(const at::Tensor& p, const at::Tensor& q, bool residual) {
  const int64_t V = p.size(0);
  at::Tensor P = p.expand({kTrials, V}), Q = q.expand({kTrials, V});
  at::Tensor drafts = SampleInverseCdf(Q, Uniforms(Purpose::kDraft));
  at::Tensor keep = Uniforms(Purpose::kAccept) < AcceptProbability(P, Q, drafts);
  at::Tensor fallback =
      SampleInverseCdf(residual ? ResidualDistribution(P, Q) : P, Uniforms(Purpose::kResample));
  at::Tensor out = at::where(keep, drafts, fallback);
  std::vector<int64_t> counts(V);
  auto acc = out.accessor<int64_t, 1>();
  for (int64_t i = 0; i < kTrials; ++i) counts[acc[i]]++;
  return counts;
}

std::vector<double> AsVector(const at::Tensor& p) {
  at::Tensor d = p.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

TEST(VerifyTest, AcceptProbabilityAndResidual) {
  at::Tensor p = at::tensor(std::vector<float>{0.5f, 0.3f, 0.2f, 0.0f});
  at::Tensor q = at::tensor(std::vector<float>{0.25f, 0.6f, 0.0f, 0.15f});
  at::Tensor a = AcceptProbability(p, q, at::scalar_tensor(0, at::kLong));
  EXPECT_DOUBLE_EQ(a.item<double>(), 1.0);
  EXPECT_NEAR(AcceptProbability(p, q, at::scalar_tensor(1, at::kLong)).item<double>(), 0.5, 1e-7);
  EXPECT_DOUBLE_EQ(AcceptProbability(p, q, at::scalar_tensor(2, at::kLong)).item<double>(), 1.0);
  EXPECT_DOUBLE_EQ(AcceptProbability(p, q, at::scalar_tensor(3, at::kLong)).item<double>(), 0.0);
  at::Tensor r = ResidualDistribution(p, q);  // max(p - q, 0) = .25, 0, .2, 0 -> / .45
  EXPECT_NEAR(r[0].item<float>(), 0.25 / 0.45, 1e-6);
  EXPECT_NEAR(r[2].item<float>(), 0.2 / 0.45, 1e-6);
  EXPECT_EQ(r[1].item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(ResidualDistribution(p, p), p));
}

// VerifyWindows leaves out work that cannot change a value: no removal mask before the first
// sibling, no COOL-SD weight of 1. Both give the same bits as the full form.
TEST(VerifyTest, ShortcutsGiveTheSameBits) {
  at::manual_seed(7);
  at::Tensor q = at::rand({6, 37}, at::kDouble);
  q.select(0, 2).zero_();  // a row with no mass
  q = q / q.sum(-1, true).clamp_min(1e-300);
  const at::Tensor none = at::zeros({6, 37}, at::kBool);
  EXPECT_TRUE(at::equal(RemoveAndNormalise(q, at::Tensor()), RemoveAndNormalise(q, none)));
  at::Tensor mask = none.clone();
  mask.select(1, 3).fill_(true);
  EXPECT_FALSE(at::equal(RemoveAndNormalise(q, at::Tensor()), RemoveAndNormalise(q, mask)));
  at::Tensor p = at::softmax(at::randn({6, 37}, at::kDouble), -1);
  const at::Tensor ones = at::ones({6}, at::kDouble);
  const at::Tensor x = at::randint(37, {6}, at::kLong);
  EXPECT_TRUE(at::equal(AcceptRatio(p, q, x, ones), AcceptRatio(p, q, x)));
  EXPECT_TRUE(at::equal(ResidualDistribution(p, q, ones), ResidualDistribution(p, q)));
}

struct Case {
  const char* name;
  std::vector<float> p, q;
};

class LosslessTest : public ::testing::TestWithParam<Case> {};

TEST_P(LosslessTest, OutputIsDistributedAsP) {
  at::Tensor p = at::tensor(GetParam().p), q = at::tensor(GetParam().q);
  auto r = testing::ChiSquareTest(SpeculativeStep(p, q, /*residual=*/true), AsVector(p));
  std::printf("%s: chi2 %.1f df %d p %.4f\n", GetParam().name, r.statistic, r.df, r.p_value);
  EXPECT_GT(r.p_value, 0.001);
}

INSTANTIATE_TEST_SUITE_P(
    Drafts, LosslessTest,
    ::testing::Values(
        Case{"generic", {0.1f, 0.4f, 0.2f, 0.25f, 0.05f}, {0.3f, 0.1f, 0.1f, 0.1f, 0.4f}},
        Case{"one-hot draft (random init)", {0.1f, 0.4f, 0.2f, 0.25f, 0.05f}, {0, 0, 1, 0, 0}},
        Case{"uniform draft", {0.1f, 0.4f, 0.2f, 0.25f, 0.05f}, {0.2f, 0.2f, 0.2f, 0.2f, 0.2f}},
        Case{"disjoint supports", {0.0f, 0.0f, 0.5f, 0.5f, 0.0f}, {0.6f, 0.4f, 0, 0, 0}},
        Case{"identical", {0.1f, 0.4f, 0.2f, 0.25f, 0.05f}, {0.1f, 0.4f, 0.2f, 0.25f, 0.05f}}),
    [](const auto& info) {
      std::string n = info.param.name;
      for (char& c : n) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
      return n;
    });

TEST(LosslessPowerTest, ResamplingFromPInsteadOfTheResidualFails) {
  at::Tensor p = at::tensor(std::vector<float>{0.1f, 0.4f, 0.2f, 0.25f, 0.05f});
  at::Tensor q = at::tensor(std::vector<float>{0.3f, 0.1f, 0.1f, 0.1f, 0.4f});
  auto r = testing::ChiSquareTest(SpeculativeStep(p, q, /*residual=*/false), AsVector(p));
  std::printf("resample from p: chi2 %.1f p %.3g\n", r.statistic, r.p_value);
  EXPECT_LT(r.p_value, 1e-6);
}

}  // namespace
}  // namespace imagegen
