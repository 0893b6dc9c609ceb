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
  int64_t match_nodes = 0, match_accepted = 0, match_differ = 0;
  for (const bool weighted : {false, true}) {
    for (const int64_t V : {7, 512, 1000, 16384}) {  // fewer ids than chunks, ragged chunks
      ChainCase c = chain_test::RandomChainCase(330, V, weighted, 11 + V);
      if (weighted) chain_test::AddGumbel(c, 13 + V);  // and scd-gs's Gumbel drafts
      if (weighted) chain_test::AddMatch(c);           // and the match rule on some of them
      const ChainVerdicts eager = chain_test::EagerChainVerify(c);
      const ChainVerdicts fused = chain_test::HostChainVerify(c);
      EXPECT_EQ(chain_test::Mismatches(eager, fused), 0) << "V " << V << " weighted " << weighted;
      EXPECT_EQ(chain_test::PackedMismatches(c, fused), 0) << "V " << V;  // the readback rows
      if (c.match_on) {  // power: the same nodes under the exact rule decide otherwise
        ChainCase exact = c;
        exact.match_on = false;
        match_differ += chain_test::Mismatches(eager, chain_test::HostChainVerify(exact));
        match_nodes += c.match.sum().item<int64_t>();
        match_accepted += (eager.accepted & (c.match > 0)).sum().item<int64_t>();
      }
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
  std::printf("match rule: %lld nodes, %lld accepted; %lld differ under the exact rule\n",
              static_cast<long long>(match_nodes), static_cast<long long>(match_accepted),
              static_cast<long long>(match_differ));
  EXPECT_GT(match_accepted, match_nodes / 8);
  EXPECT_GT(match_differ, match_nodes / 4);
}

// Trees: siblings verified in turn against the residual of the ones before (q without them),
// the residual draw after the last, and the extra candidates drawn without replacement, as the
// eager loop and DrawNextDrafts make them; with GSD's first-sibling ratio and Gumbel-coupled
// nodes (their drafts the top D of log p + Gumbel noise) mixed in too.
TEST(ChainVerifyTest, FusedTreesDecideAndDrawAsTheEagerVerification) {
  int64_t nodes = 0, later_accepted = 0, none_accepted = 0, extras = 0;
  for (const int64_t V : {7, 512, 1000, 16384}) {
    for (const auto& [K, D] : {std::pair<int64_t, int64_t>{2, 3}, {4, 4}, {3, 1}, {8, 8}}) {
      for (const bool weighted : {false, true}) {
        chain_test::ChainCase c = chain_test::RandomTreeCase(200, V, K, D, weighted, 41 + V + K);
        if (!weighted && K == 4) chain_test::AddGroups(c, 43 + V);
        if (!weighted && K == 2) chain_test::AddGumbel(c, 45 + V);
        if (!weighted && K == 2 && D == 3) chain_test::AddMatch(c);
        const chain_test::ChainVerdicts eager = chain_test::EagerChainVerify(c);
        const chain_test::ChainVerdicts fused = chain_test::HostChainVerify(c);
        EXPECT_EQ(chain_test::Mismatches(eager, fused), 0)
            << "V " << V << " K " << K << " D " << D << " weighted " << weighted;
        EXPECT_EQ(chain_test::PackedMismatches(c, fused), 0) << "V " << V << " K " << K;
        nodes += 200;
        at::Tensor acc = eager.accepted.reshape({200, -1});
        later_accepted +=
            (acc.narrow(1, 1, K - 1).any(1) & ~acc.select(1, 0)).sum().item<int64_t>();
        none_accepted += (~acc.any(1)).sum().item<int64_t>();
        extras += (eager.extra >= 0).sum().item<int64_t>();
      }
    }
  }
  std::printf("%lld tree nodes: %lld accepted a later sibling only, %lld none; %lld extra drafts\n",
              static_cast<long long>(nodes), static_cast<long long>(later_accepted),
              static_cast<long long>(none_accepted), static_cast<long long>(extras));
  EXPECT_GT(later_accepted, nodes / 20);
  EXPECT_GT(none_accepted, nodes / 10);
  EXPECT_GT(extras, nodes);
}

// Power: the tree comparison sees a pass that verifies every sibling against p (no residual
// between them), keeps removed siblings in q, or draws the extras with replacement.
TEST(ChainVerifyPowerTest, ABrokenTreeVerificationDiffers) {
  const chain_test::ChainCase c = chain_test::RandomTreeCase(200, 512, 4, 4, false, 47);
  const chain_test::ChainVerdicts eager = chain_test::EagerChainVerify(c);
  EXPECT_EQ(chain_test::Mismatches(eager, chain_test::HostChainVerify(c)), 0);
  // Each sibling as the first of its own node: verified against p and the whole q.
  chain_test::ChainCase alone = c;
  alone.kids = 1;
  alone.draws = 1;
  const int64_t A = c.p.size(0);
  int64_t differ = 0;
  for (int64_t k = 1; k < 4; ++k) {
    alone.kid = c.kid.select(1, k).contiguous();
    alone.uacc = c.uacc.select(1, k).contiguous();
    alone.ufresh = c.ufresh.select(1, 0).contiguous();
    const chain_test::ChainVerdicts v = chain_test::HostChainVerify(alone);
    differ += (v.accepted.ne(eager.accepted.select(1, k)) & (c.kid.select(1, k) >= 0))
                  .sum()
                  .item<int64_t>();
  }
  // The extras drawn with the draws' uniforms shifted by one node.
  chain_test::ChainCase shifted = c;
  shifted.ufresh = c.ufresh.roll(1, 0);
  const int64_t shifted_differ =
      chain_test::Mismatches(eager, chain_test::HostChainVerify(shifted));
  // Gumbel noise keyed at the next position.
  chain_test::ChainCase gc = c;
  chain_test::AddGumbel(gc, 49);
  const chain_test::ChainVerdicts geager = chain_test::EagerChainVerify(gc);
  EXPECT_EQ(chain_test::Mismatches(geager, chain_test::HostChainVerify(gc)), 0);
  chain_test::ChainCase moved = gc;
  moved.position = gc.position + 1;
  const int64_t gumbel_differ = chain_test::Mismatches(geager, chain_test::HostChainVerify(moved));
  EXPECT_GT(gumbel_differ, 50);  // of 67 Gumbel nodes
  // The extras' exclusion taken from the other coupling.
  chain_test::ChainCase coupling = c;
  coupling.maximal = 1 - c.maximal;
  const int64_t coupling_differ =
      chain_test::Mismatches(eager, chain_test::HostChainVerify(coupling));
  std::printf(
      "of %lld nodes: later siblings decided against p alone %lld, extras' uniforms "
      "shifted %lld, coupling swapped %lld, Gumbel noise at the next position %lld\n",
      static_cast<long long>(A), static_cast<long long>(differ),
      static_cast<long long>(shifted_differ), static_cast<long long>(coupling_differ),
      static_cast<long long>(gumbel_differ));
  EXPECT_GT(differ, 10);
  EXPECT_GT(shifted_differ, 100);
  EXPECT_GT(coupling_differ, 10);
}

// GSD in the fused pass: every grouped node's cluster ratio equals verify.h's eager one (a
// stable sort, gathers and sums) to rounding, and the verdicts are the eager verification's.
TEST(ChainVerifyTest, FusedGsdClustersAreTheEagerOnes) {
  int64_t grouped = 0, accepted = 0, partial = 0;
  for (const int64_t V : {7, 512, 1000, 16384}) {
    chain_test::ChainCase c = chain_test::RandomChainCase(330, V, false, 23 + V);
    chain_test::AddGroups(c, 29 + V);
    const at::Tensor eager_ratio = chain_test::EagerGroupedRatios(c);
    chain_test::ChainVerdicts out;
    const at::Tensor fused_ratio = chain_test::HostGroupedRatios(c, chain_test::FusedArgs(c, out));
    const double err = ((fused_ratio - eager_ratio).abs() / eager_ratio.abs().clamp_min(1e-300))
                           .max()
                           .item<double>();
    EXPECT_LT(err, 1e-12) << "V " << V;
    const chain_test::ChainVerdicts eager = chain_test::EagerChainVerify(c);
    const chain_test::ChainVerdicts fused = chain_test::HostChainVerify(c);
    EXPECT_EQ(chain_test::Mismatches(eager, fused), 0) << "V " << V;
    EXPECT_EQ(chain_test::PackedMismatches(c, fused), 0) << "V " << V;
    grouped += eager_ratio.size(0);
    accepted += eager.accepted.sum().item<int64_t>();
    // Ratios strictly between 0 and 1: clusters that neither cover nor miss the draft's mass.
    partial += ((eager_ratio > 0) & (eager_ratio < 1)).sum().item<int64_t>();
  }
  std::printf("%lld grouped nodes: %lld accepted, %lld with a ratio in (0, 1)\n",
              static_cast<long long>(grouped), static_cast<long long>(accepted),
              static_cast<long long>(partial));
  EXPECT_GT(grouped, 600);
  EXPECT_GT(partial, grouped / 10);
  EXPECT_GT(accepted, grouped / 10);
}

// Power: the cluster comparison sees a fused pass that ignores the embedding distance, walks one
// rank too far, swaps the two bounds, or counts ties in the other order.
TEST(ChainVerifyPowerTest, ABrokenGsdClusterDiffers) {
  chain_test::ChainCase c = chain_test::RandomChainCase(330, 512, false, 31);
  chain_test::AddGroups(c, 37);
  const at::Tensor eager = chain_test::EagerGroupedRatios(c);
  auto differing = [&](const at::Tensor& fused) {
    return ((fused - eager).abs() > 1e-9 * eager.abs()).sum().item<int64_t>();
  };
  chain_test::ChainVerdicts out;
  kernels::ChainVerifyArgs a = chain_test::FusedArgs(c, out);
  EXPECT_EQ(differing(chain_test::HostGroupedRatios(c, a)), 0);
  kernels::ChainVerifyArgs no_distance = a;
  no_distance.embed_dim = 0;  // every distance 0
  EXPECT_GT(differing(chain_test::HostGroupedRatios(c, no_distance)), 10);
  const at::Tensor wider = c.group + (c.group > 0).to(at::kLong);
  kernels::ChainVerifyArgs longer = a;
  longer.group = wider.data_ptr<int64_t>();
  EXPECT_GT(differing(chain_test::HostGroupedRatios(c, longer)), 20);
  kernels::ChainVerifyArgs swapped = a;
  std::swap(swapped.group_delta, swapped.group_dist);
  EXPECT_GT(differing(chain_test::HostGroupedRatios(c, swapped)), 20);
  // Ties by descending id: the eager reference over a row order with ids reversed.
  chain_test::ChainCase flipped = c;
  flipped.p = c.p.flip(1);
  flipped.q = c.q.flip(1);
  flipped.embed = c.embed.flip(0);
  flipped.tokens = (c.p.size(1) - 1) - c.tokens;
  const at::Tensor reversed_ties = chain_test::EagerGroupedRatios(flipped);
  EXPECT_GT(differing(reversed_ties), 5);
  std::printf(
      "of %lld grouped nodes, differing: no distance %lld, one rank more %lld, bounds "
      "swapped %lld, ties reversed %lld\n",
      static_cast<long long>(eager.size(0)),
      static_cast<long long>(differing(chain_test::HostGroupedRatios(c, no_distance))),
      static_cast<long long>(differing(chain_test::HostGroupedRatios(c, longer))),
      static_cast<long long>(differing(chain_test::HostGroupedRatios(c, swapped))),
      static_cast<long long>(differing(reversed_ties)));
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
