// Exact-distribution tests of AR sampling on the enumerable toy model: 200,000 seeded samples
// pass a chi-square goodness-of-fit test against the exact joint distribution (p > 0.001), and
// deliberately broken samplers fail the same test (so it has power). The speculative methods
// of issue 3 are held to the same test.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <functional>

#include "engine/decoding/philox.h"
#include "engine/decoding/sampling.h"
#include "tests/stats.h"
#include "tests/toy_model.h"

namespace imagegen {
namespace {

using testing::ChiSquareTest;
using testing::ToyModel;

constexpr int64_t kSamples = 200000;

// Per-prefix final distributions, indexed by (length, prefix index); the sampler below reads
// them as a model's forward would produce them.
struct ProbTable {
  std::vector<at::Tensor> by_len;  // by_len[k]: [kVocab^k, kVocab]
};

ProbTable Table(const ToyModel& m, int64_t cls,
                const std::function<at::Tensor(int64_t, const std::vector<int64_t>&)>& probs) {
  ProbTable t;
  for (int64_t k = 0; k < ToyModel::kLen; ++k) {
    int64_t count = 1;
    for (int64_t j = 0; j < k; ++j) count *= ToyModel::kVocab;
    std::vector<at::Tensor> rows;
    for (int64_t i = 0; i < count; ++i) {
      std::vector<int64_t> prefix(k);
      for (int64_t j = k - 1, x = i; j >= 0; --j, x /= ToyModel::kVocab)
        prefix[j] = x % ToyModel::kVocab;
      rows.push_back(probs(cls, prefix));
    }
    t.by_len.push_back(at::stack(rows));
  }
  return t;
}

// AR sampling of n sequences with seeds 0..n-1: one inverse-CDF draw per position from a
// Philox uniform keyed by (seed, position) unless `uniform` says otherwise.
std::vector<int64_t> SampleCounts(const ProbTable& t,
                                  const std::function<double(uint64_t, uint32_t)>& uniform) {
  at::Tensor prefix_idx = at::zeros({kSamples}, at::kLong);
  for (int64_t k = 0; k < ToyModel::kLen; ++k) {
    at::Tensor probs = t.by_len[k].index_select(0, prefix_idx);
    std::vector<double> u(kSamples);
    for (int64_t s = 0; s < kSamples; ++s)
      u[s] = uniform(static_cast<uint64_t>(s), static_cast<uint32_t>(k));
    at::Tensor tok = SampleInverseCdf(probs, at::tensor(u));
    prefix_idx = prefix_idx * ToyModel::kVocab + tok;
  }
  std::vector<int64_t> counts(1 << (2 * ToyModel::kLen));
  auto acc = prefix_idx.accessor<int64_t, 1>();
  for (int64_t s = 0; s < kSamples; ++s) counts[acc[s]]++;
  return counts;
}

double KeyedUniform(uint64_t seed, uint32_t pos) { return Uniform(seed, pos, 0, Purpose::kSample); }

class ExactArTest : public ::testing::TestWithParam<SamplingParams> {};

TEST_P(ExactArTest, ArSamplingMatchesTheExactDistribution) {
  ToyModel m;
  const SamplingParams s = GetParam();
  for (int64_t cls : {0, 1}) {
    auto exact = m.Exact(cls, s);
    ProbTable t =
        Table(m, cls, [&](int64_t c, const std::vector<int64_t>& p) { return m.Probs(c, p, s); });
    auto r = ChiSquareTest(SampleCounts(t, KeyedUniform), exact);
    std::printf("class %lld cfg %.1f top-k %lld: chi2 %.1f df %d p %.4f\n",
                static_cast<long long>(cls), s.cfg_scale, static_cast<long long>(s.top_k),
                r.statistic, r.df, r.p_value);
    EXPECT_GT(r.p_value, 0.001);
  }
}

SamplingParams Params(double cfg, double temperature, int64_t top_k, double top_p) {
  SamplingParams s;
  s.cfg_scale = cfg;
  s.temperature = temperature;
  s.top_k = top_k;
  s.top_p = top_p;
  return s;
}

INSTANTIATE_TEST_SUITE_P(Settings, ExactArTest,
                         ::testing::Values(Params(1.0, 1.0, 0, 1.0), Params(2.0, 0.9, 3, 1.0),
                                           Params(1.5, 1.0, 0, 0.9)));

// Power: the same test rejects samplers that are wrong in ways a bug could make them.
TEST(ExactArPowerTest, BrokenSamplersFail) {
  ToyModel m;
  const SamplingParams s = Params(2.0, 0.9, 3, 1.0);
  auto exact = m.Exact(0, s);
  ProbTable right =
      Table(m, 0, [&](int64_t c, const std::vector<int64_t>& p) { return m.Probs(c, p, s); });
  // 1. The same uniform reused at every position (a counter that forgot the position).
  auto same_u = ChiSquareTest(
      SampleCounts(right, [](uint64_t seed, uint32_t) { return KeyedUniform(seed, 0); }), exact);
  // 2. Top-k forgotten: sampling from the guided softmax without the filter.
  SamplingParams unfiltered = s;
  unfiltered.top_k = 0;
  ProbTable wrong = Table(
      m, 0, [&](int64_t c, const std::vector<int64_t>& p) { return m.Probs(c, p, unfiltered); });
  auto no_topk = ChiSquareTest(SampleCounts(wrong, KeyedUniform), exact);
  // 3. Guidance at scale 1.9 instead of 2.0: a subtle error.
  SamplingParams off = s;
  off.cfg_scale = 1.9;
  ProbTable slightly =
      Table(m, 0, [&](int64_t c, const std::vector<int64_t>& p) { return m.Probs(c, p, off); });
  auto cfg_off = ChiSquareTest(SampleCounts(slightly, KeyedUniform), exact);
  std::printf("broken: same uniform p=%.3g, no top-k p=%.3g, cfg 1.9 p=%.3g\n", same_u.p_value,
              no_topk.p_value, cfg_off.p_value);
  EXPECT_LT(same_u.p_value, 1e-6);
  EXPECT_LT(no_topk.p_value, 1e-6);
  EXPECT_LT(cfg_off.p_value, 0.001);
}

TEST(StatsTest, ChiSquarePValuesMatchTables) {
  // Upper tail of chi-square: P(X > 3.841 | df 1) = 0.05, P(X > 18.307 | df 10) = 0.05,
  // P(X > 124.342 | df 100) = 0.05, P(X > 0 | df 5) = 1.
  EXPECT_NEAR(testing::RegularizedGammaQ(0.5, 3.841 / 2), 0.05, 1e-4);
  EXPECT_NEAR(testing::RegularizedGammaQ(5, 18.307 / 2), 0.05, 1e-4);
  EXPECT_NEAR(testing::RegularizedGammaQ(50, 124.342 / 2), 0.05, 1e-4);
  EXPECT_DOUBLE_EQ(testing::RegularizedGammaQ(2.5, 0), 1.0);
  // Drawing an outcome of probability zero is an immediate rejection.
  EXPECT_EQ(ChiSquareTest({5, 1}, {1.0, 0.0}).p_value, 0.0);
}

}  // namespace
}  // namespace imagegen
