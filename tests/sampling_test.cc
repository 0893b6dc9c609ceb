#include "engine/decoding/sampling.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>

#include "engine/decoding/philox.h"

namespace imagegen {
namespace {

at::Tensor Row(std::vector<float> v) { return at::tensor(v).unsqueeze(0); }

TEST(SamplingTest, CfgIsOnRawLogits) {
  at::Tensor c = Row({1, 2, 3}), u = Row({0, 1, 5});
  at::Tensor g = CfgCombine(c, u, at::tensor(std::vector<float>{4.0f}));
  EXPECT_TRUE(at::allclose(g, Row({4, 5, -3})));
}

TEST(SamplingTest, TemperatureMatchesSoftmaxOfScaledLogits) {
  SamplingParams p;
  p.temperature = 0.5;
  at::Tensor l = Row({0.1f, 0.7f, -1.0f, 2.0f});
  EXPECT_TRUE(at::allclose(FinalProbs(l, {p}), at::softmax(l / 0.5, -1)));
}

TEST(SamplingTest, TopKKeepsTies) {
  SamplingParams p;
  p.top_k = 2;
  at::Tensor probs = FinalProbs(Row({1, 3, 3, 2, 3}), {p});
  // The 2nd largest is 3, tied three ways: all three stay.
  EXPECT_EQ((probs > 0).sum().item<int64_t>(), 3);
  EXPECT_NEAR(probs[0][1].item<float>(), 1.0 / 3, 1e-6);
}

TEST(SamplingTest, TopPKeepsTheCrossingToken) {
  SamplingParams p;
  p.top_p = 0.6;
  // softmax of log-probabilities gives back 0.5, 0.3, 0.15, 0.05.
  at::Tensor l = at::log(Row({0.15f, 0.5f, 0.05f, 0.3f}));
  at::Tensor probs = FinalProbs(l, {p});
  // 0.5 < 0.6 so 0.3 is kept too (cum before it 0.5 <= 0.6); then 0.8 > 0.6 removes the rest.
  EXPECT_NEAR(probs[0][1].item<float>(), 0.5 / 0.8, 1e-6);
  EXPECT_NEAR(probs[0][3].item<float>(), 0.3 / 0.8, 1e-6);
  EXPECT_EQ(probs[0][0].item<float>(), 0);
  EXPECT_EQ(probs[0][2].item<float>(), 0);
}

TEST(SamplingTest, TopPOneKeepsEverythingEvenWithRounding) {
  SamplingParams p;
  at::Tensor l = at::randn({3, 1000});
  EXPECT_TRUE(((FinalProbs(l, {p, p, p}) > 0).all()).item<bool>());
}

TEST(SamplingTest, RowsUseTheirOwnParameters) {
  SamplingParams a, b;
  b.top_k = 1;
  at::Tensor l = at::cat({Row({1, 2, 3}), Row({1, 2, 3})});
  at::Tensor probs = FinalProbs(l, {a, b});
  EXPECT_TRUE(at::allclose(probs[0], at::softmax(Row({1, 2, 3}), -1)[0]));
  EXPECT_EQ(probs[1][2].item<float>(), 1.0f);
}

TEST(SamplingTest, InverseCdfFrequenciesMatchProbabilities) {
  at::Tensor probs = Row({0.1f, 0.0f, 0.6f, 0.3f});
  const int n = 60000;
  std::vector<int> counts(4);
  std::vector<double> us;
  for (int i = 0; i < n; ++i)
    us.push_back(Uniform(3, static_cast<uint32_t>(i), 0, Purpose::kSample));
  at::Tensor ids = SampleInverseCdf(probs.expand({n, 4}), at::tensor(us));
  for (int i = 0; i < n; ++i) counts[ids[i].item<int64_t>()]++;
  EXPECT_EQ(counts[1], 0);
  EXPECT_NEAR(counts[0] / double(n), 0.1, 0.006);
  EXPECT_NEAR(counts[2] / double(n), 0.6, 0.006);
  EXPECT_NEAR(counts[3] / double(n), 0.3, 0.006);
}

TEST(SamplingTest, InverseCdfNeverPicksZeroProbabilityAtTheEdges) {
  at::Tensor probs = Row({0.0f, 0.5f, 0.5f, 0.0f});
  at::Tensor ids = SampleInverseCdf(probs.expand({3, 4}),
                                    at::tensor(std::vector<double>{0.0, 0.5, 0.999999999}));
  EXPECT_EQ(ids[0].item<int64_t>(), 1);
  EXPECT_EQ(ids[1].item<int64_t>(), 2);
  EXPECT_EQ(ids[2].item<int64_t>(), 2);
}

TEST(SamplingTest, ValidationNamesTheField) {
  SamplingParams p;
  p.temperature = std::nan("");
  EXPECT_NE(ValidateSampling(p, 10).message().find("temperature"), std::string::npos);
  p = {};
  p.top_k = 11;
  EXPECT_NE(ValidateSampling(p, 10).message().find("top_k"), std::string::npos);
  p = {};
  p.top_p = 0;
  EXPECT_NE(ValidateSampling(p, 10).message().find("top_p"), std::string::npos);
  p = {};
  p.cfg_scale = -1;
  EXPECT_NE(ValidateSampling(p, 10).message().find("cfg_scale"), std::string::npos);
  p = {};
  p.cfg_interval = -2;
  EXPECT_NE(ValidateSampling(p, 10).message().find("cfg_interval"), std::string::npos);
  EXPECT_TRUE(ValidateSampling(SamplingParams{}, 10).ok());
}

}  // namespace
}  // namespace imagegen
