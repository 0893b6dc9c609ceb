// The fused final distributions (kernels/guided_probs.h: CFG combine, temperature and softmax
// in one pass per row) against the eager path of GuidedBatch::Probs, on the host. The GPU
// kernel is checked against the same host functions in kernels_test.cc; the engine runs it by
// default on CUDA, and speculative_test.cc samples the lossless methods through the host path
// (SpecOptions::fused_probs = 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "tests/guided_probs_cases.h"

namespace imagegen {
namespace {

using guided_test::GuidedCase;

constexpr int64_t kRows = 120;
// float32's softmax against float64's: a few float32 ulps (its exp and its sum), and values
// that float32 holds only as subnormals or zero.
constexpr double kRel = 1e-5, kAbs = 1e-35;

// z = (u + (c - u) * scale) / temperature is the eager path's, bit for bit: the fused pass
// changes only the softmax's precision.
TEST(GuidedProbsTest, FusedLogitsAreTheEagerOnesBitForBit) {
  for (const int64_t V : {7, 512, 1000}) {
    const GuidedCase c = guided_test::RandomGuidedCase(kRows, V, 3 + V);
    const at::Tensor z = guided_test::EagerLogits(c);
    const std::vector<double> meta = guided_test::GuidedMeta(c);
    at::Tensor out;
    const kernels::GuidedProbsArgs a = guided_test::GuidedArgs(c, c.logits, meta.data(), out);
    int64_t differ = 0;
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t v = 0; v < V; ++v) {
        const float want = z[r][v].item<float>(), got = kernels::GuidedLogit(a, r, v);
        differ += std::memcmp(&want, &got, sizeof(float)) != 0 ? 1 : 0;
      }
    }
    EXPECT_EQ(differ, 0) << "V " << V;
  }
}

TEST(GuidedProbsTest, FusedDistributionsAreTheEagerOnes) {
  for (const int64_t V : {7, 512, 1000, 16384}) {  // fewer ids than chunks, ragged chunks
    const GuidedCase c = guided_test::RandomGuidedCase(kRows, V, 3 + V);
    const at::Tensor eager = guided_test::EagerGuidedProbs(c);
    const at::Tensor fused = guided_test::HostGuidedProbs(c);
    EXPECT_EQ(guided_test::ProbsMismatches(eager, fused, kRel, kAbs), 0) << "V " << V;
    const double worst = (fused.sum(1) - 1).abs().max().item<double>();
    EXPECT_LT(worst, 1e-12) << "V " << V;  // float64 rows sum to 1
    EXPECT_EQ(fused.argmax(1).equal(eager.argmax(1)), true) << "V " << V;
    // The cases reach the extremes: nearly one-hot rows (temperature 1e-5, a far id) and flat
    // ones.
    EXPECT_GT(fused.max().item<double>(), 1 - 1e-9) << "V " << V;
    EXPECT_LT((fused.amax(1) - fused.amin(1)).min().item<double>(), 1e-12);
    // Top-k keeps FinalProbs' ids, ties included: none beyond them, and every one of them
    // where float64 does not underflow (the float32 softmax underflows more).
    const at::Tensor keep = guided_test::EagerKeep(c);
    EXPECT_EQ(((fused > 0) & ~keep).sum().item<int64_t>(), 0) << "V " << V;
    EXPECT_EQ(((fused == 0) & (eager != 0)).sum().item<int64_t>(), 0) << "V " << V;
    EXPECT_GT((~keep).sum().item<int64_t>(), kRows) << "V " << V;  // the cases cut ids
  }
}

// Power: the comparison sees CFG applied the wrong way round, the temperature left out, a
// row's logits read from its neighbour, top-k left out, and top-k one id short or long.
TEST(GuidedProbsPowerTest, ABrokenFusedPassDiffers) {
  const int64_t V = 512;
  const GuidedCase c = guided_test::RandomGuidedCase(kRows, V, 5);
  const at::Tensor eager = guided_test::EagerGuidedProbs(c);
  const at::Tensor keep = guided_test::EagerKeep(c);
  auto run = [&](const std::function<void(std::vector<double>&)>& breakit) {
    std::vector<double> meta = guided_test::GuidedMeta(c);
    breakit(meta);
    at::Tensor out;
    const kernels::GuidedProbsArgs a = guided_test::GuidedArgs(c, c.logits, meta.data(), out);
    for (int64_t r = 0; r < kRows; ++r) kernels::GuidedProbsRowOnHost(a, r);
    return guided_test::ProbsMismatches(eager, out, kRel, kAbs) +
           ((out > 0) & ~keep).sum().item<int64_t>();
  };
  EXPECT_EQ(run([](std::vector<double>&) {}), 0);
  EXPECT_GT(run([](std::vector<double>& m) {
              std::swap_ranges(m.begin(), m.begin() + kRows, m.begin() + kRows);
            }),
            0)
      << "cond and uncond swapped";
  EXPECT_GT(run([](std::vector<double>& m) { std::fill(m.begin() + 3 * kRows, m.end(), 1.0); }), 0)
      << "temperature ignored";
  EXPECT_GT(run([](std::vector<double>& m) {
              for (int64_t r = 0; r + 1 < kRows; ++r) m[r] = m[r + 1];
            }),
            0)
      << "the neighbour's row";
  EXPECT_GT(run([&](std::vector<double>& m) {
              std::fill(m.begin() + 4 * kRows, m.end(), static_cast<double>(V));
            }),
            0)
      << "top-k ignored";
  EXPECT_GT(run([&](std::vector<double>& m) {
              for (int64_t r = 0; r < kRows; ++r)
                m[4 * kRows + r] = std::max(1.0, m[4 * kRows + r] - 1);
            }),
            0)
      << "top-k one short";
  EXPECT_GT(run([&](std::vector<double>& m) {
              for (int64_t r = 0; r < kRows; ++r) {
                m[4 * kRows + r] = std::min(static_cast<double>(V), m[4 * kRows + r] + 1);
              }
            }),
            0)
      << "top-k one long";
}

}  // namespace
}  // namespace imagegen
