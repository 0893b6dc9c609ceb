// SJD is lossless: on a tiny random GPT small enough to enumerate (vocabulary 4, 2x2 grid, two
// classes, CFG and top-k on), 100,000 seeded SJD images pass a chi-square test against the exact
// AR distribution computed from the same model's forward, as does plain AR; an accept-always
// verifier fails it.
#include "engine/decoding/sjd_generator.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "tests/stats.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

constexpr int64_t kImages = 100000, kChunk = 10000;

class SjdExactTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::TinyGptSpec spec;
    spec.vocab = 4;
    spec.grid = 2;
    spec.classes = 2;
    spec.dim = 16;
    auto m = Gpt::Load(testing::WriteTinyGpt(testing::TempDir("sjd") + "/m", spec, 11), {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    gpt_ = std::move(m).value();
    sampling_.cfg_scale = 1.5;
    sampling_.top_k = 3;
  }

  // Exact probability of each of the 4^4 grids: one full forward per grid.
  std::vector<double> Exact(int64_t cls) {
    std::vector<double> out;
    for (int64_t idx = 0; idx < 256; ++idx) {
      std::vector<int64_t> seq = {idx >> 6 & 3, idx >> 4 & 3, idx >> 2 & 3, idx & 3};
      BatchRow c, u;
      c.tokens = {cls, seq[0], seq[1], seq[2]};
      c.positions = {0, 1, 2, 3};
      u = c;
      u.tokens[0] = gpt_->config().null_class();
      u.slot = 1;
      KvCache cache = gpt_->NewCache(2);
      at::Tensor l = *gpt_->Forward({c, u}, cache);
      at::Tensor g = CfgCombine(l.narrow(0, 0, 4), l.narrow(0, 4, 4),
                                at::full({4}, static_cast<float>(sampling_.cfg_scale)));
      at::Tensor p = FinalProbs(g, std::vector<SamplingParams>(4, sampling_)).to(at::kDouble);
      double prob = 1;
      for (int64_t j = 0; j < 4; ++j) prob *= p[j][seq[j]].item<double>();
      out.push_back(prob);
    }
    return out;
  }

  std::vector<ImageRequest> Requests(int64_t cls, int64_t first) {
    std::vector<ImageRequest> r(kChunk);
    for (int64_t i = 0; i < kChunk; ++i) {
      r[i].class_id = cls;
      r[i].seed = static_cast<uint64_t>(first + i);
      r[i].sampling = sampling_;
    }
    return r;
  }

  static int64_t Index(const std::vector<int32_t>& t) {
    return (int64_t{t[0]} << 6) | (t[1] << 4) | (t[2] << 2) | t[3];
  }

  std::unique_ptr<Gpt> gpt_;
  SamplingParams sampling_;
};

TEST_F(SjdExactTest, SjdMatchesTheExactArDistribution) {
  for (bool uniform_q : {false, true}) {
    SjdGenerator gen(*gpt_);
    std::vector<int64_t> counts(256);
    int64_t nfe = 0, verified = 0, accepted = 0;
    for (int64_t first = 0; first < kImages; first += kChunk) {
      auto res = gen.Generate(Requests(0, first), {4, uniform_q});
      ASSERT_TRUE(res.ok()) << res.status().ToString();
      for (const auto& r : *res) {
        ASSERT_EQ(r.image.tokens.size(), 4u);
        counts[Index(r.image.tokens)]++;
        nfe += r.image.nfe;
        verified += r.drafts_verified;
        accepted += r.drafts_accepted;
      }
    }
    auto chi = testing::ChiSquareTest(counts, Exact(0));
    std::printf("sjd L=4 q=%s: chi2 %.1f df %d p %.4f; mean NFE %.3f (AR 4), acceptance %.3f\n",
                uniform_q ? "uniform" : "one-hot", chi.statistic, chi.df, chi.p_value,
                double(nfe) / kImages, double(accepted) / verified);
    EXPECT_GT(chi.p_value, 0.001);
    EXPECT_LT(nfe, 4 * kImages);  // speculation saved forwards
  }
}

TEST_F(SjdExactTest, ArThroughTheGptMatchesTooAndAcceptAlwaysFails) {
  ArGenerator ar(*gpt_);
  std::vector<int64_t> ar_counts(256), bad_counts(256);
  SjdGenerator broken(*gpt_);
  broken.broken_accept_always = true;
  for (int64_t first = 0; first < kImages; first += kChunk) {
    auto a = ar.Generate(Requests(1, first));
    auto b = broken.Generate(Requests(1, first), {4, false});
    ASSERT_TRUE(a.ok() && b.ok());
    for (const auto& r : *a) ar_counts[Index(r.tokens)]++;
    for (const auto& r : *b) bad_counts[Index(r.image.tokens)]++;
  }
  const auto exact = Exact(1);
  auto good = testing::ChiSquareTest(ar_counts, exact);
  auto bad = testing::ChiSquareTest(bad_counts, exact);
  std::printf("ar: chi2 %.1f df %d p %.4f; accept-always sjd: chi2 %.1f p %.3g\n", good.statistic,
              good.df, good.p_value, bad.statistic, bad.p_value);
  EXPECT_GT(good.p_value, 0.001);
  EXPECT_LT(bad.p_value, 1e-6);
}

}  // namespace
}  // namespace imagegen
