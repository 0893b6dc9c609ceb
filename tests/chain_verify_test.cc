// The fused chain verification (kernels/chain_verify.h, the engine's default for chain steps)
// against the eager one of verify.h, on the host. The GPU kernel is checked against the same
// host function in kernels_test.cc; the engine-level exact-distribution and golden-grid tests
// run with it on (SpecOptions::fused_verify defaults to true).
#include <gtest/gtest.h>

#include "tests/chain_verify_cases.h"

namespace imagegen {
namespace {

using chain_test::ChainCase;
using chain_test::ChainVerdicts;

TEST(ChainVerifyTest, FusedDecidesAndDrawsAsTheEagerVerification) {
  int64_t nodes = 0, accepted = 0, no_draft = 0, empty_residual = 0;
  for (const bool weighted : {false, true}) {
    for (const int64_t V : {7, 512, 1000, 16384}) {  // fewer ids than chunks, ragged chunks
      const ChainCase c = chain_test::RandomChainCase(330, V, weighted, 11 + V);
      const ChainVerdicts eager = chain_test::EagerChainVerify(c);
      const ChainVerdicts fused = chain_test::HostChainVerify(c);
      EXPECT_EQ(chain_test::Mismatches(eager, fused), 0) << "V " << V << " weighted " << weighted;
      EXPECT_EQ(chain_test::PackedMismatches(c, fused), 0) << "V " << V;  // the readback rows
      nodes += 330;
      accepted += eager.accepted.sum().item<int64_t>();
      no_draft += (c.kid < 0).sum().item<int64_t>();
      empty_residual += ((at::arange(330) % 5 == 0) & (c.kid >= 0)).sum().item<int64_t>();
    }
  }
  // The cases exercise both outcomes and the edge cases.
  std::printf("%lld nodes: %lld accepted, %lld without a draft, %lld with q = p\n",
              static_cast<long long>(nodes), static_cast<long long>(accepted),
              static_cast<long long>(no_draft), static_cast<long long>(empty_residual));
  EXPECT_GT(accepted, nodes / 10);
  EXPECT_LT(accepted, nodes * 9 / 10);
}

// Power: the comparison sees a fused verification that leaves out COOL-SD's weights, reads its
// neighbour's residual uniform (an indexing slip), or draws the fresh draft with the wrong one.
TEST(ChainVerifyPowerTest, ABrokenFusedVerificationDiffers) {
  const ChainCase c = chain_test::RandomChainCase(330, 512, true, 5);
  const ChainVerdicts eager = chain_test::EagerChainVerify(c);
  ChainCase unweighted = c;
  unweighted.weighted = false;  // the fused call without w
  EXPECT_GT(chain_test::Mismatches(eager, chain_test::HostChainVerify(unweighted)), 5);
  ChainCase shifted = c;
  shifted.ures = c.ures.roll(1);
  EXPECT_GT(chain_test::Mismatches(eager, chain_test::HostChainVerify(shifted)), 100);
  ChainCase fresh = c;
  fresh.ufresh = c.ures;  // the fresh draft drawn with the residual's uniform
  EXPECT_GT(chain_test::Mismatches(eager, chain_test::HostChainVerify(fresh)), 100);
  ChainVerdicts swapped = chain_test::HostChainVerify(c);  // readback rows with kept as residual
  swapped.packed.select(1, 1).copy_(swapped.packed.select(1, 2));
  EXPECT_GT(chain_test::PackedMismatches(c, swapped), 20);  // 47: the accepted drafts
}

}  // namespace
}  // namespace imagegen
