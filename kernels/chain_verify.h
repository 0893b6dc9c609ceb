// Fused chain verification: a chain node's whole verification in one pass over its rows,
// for every node of a step at once (one CUDA block per node, kernels/chain_verify.cu; on the
// CPU the same functions in the same order, ChainVerifyNodeOnHost). It replaces about 30
// eager launches (verify.h's AcceptRatio, ResidualDistribution, SampleInverseCdf, ...) with
// one, and makes the same decision:
//
//   q'  = q / sum(q)                                (RemoveAndNormalise with nothing removed)
//   acc = x >= 0 and u_acc < min(1, w p(x) / q'(x))  (q'(x) = 0: 1 if p(x) > 0, else 0)
//         (a GSD node: u_acc < min(1, p(C) / q(C)) over its cluster C, ChainGroupedRatioOnHost)
//   r   = [p - min(q', w p)]_+, or p where r has no mass or the node has no draft
//   res = the first v with r_0 + ... + r_v > u_res * sum(r)   (inverse CDF)
//   kept = acc ? x : res
//   fresh = the first v with p_0 + ... + p_v > u_fresh * sum(p)   (optional: the next draft)
//
// Sums are taken in a fixed order: kChainVerifyChunks contiguous chunks, each summed left to
// right, then the chunk sums left to right. Device and host therefore add the same doubles in
// the same order and draw bit-identical tokens (tests/kernels_test.cc). Against the eager
// reduction order of verify.h a draw differs only where u lands within rounding of a CDF
// boundary. Header-only and free of CUDA: the engine's CPU path includes it.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "kernels/philox_rounds.h"  // IMAGEGEN_HD

namespace imagegen::kernels {

// Chunks per row; also the CUDA block size (one thread per chunk).
constexpr int kChainVerifyChunks = 256;

struct ChainVerifyArgs {
  const double* p = nullptr;        // [nodes, V] target distributions, row-major
  const double* q = nullptr;        // [columns, V] proposals
  const int64_t* qrow = nullptr;    // [nodes] each node's q row (read where it has a draft)
  const int64_t* kid = nullptr;     // [nodes] the draft (its token, or its node index), -1: none
  const int64_t* tokens = nullptr;  // optional [nodes]: kid is a node index into it
  const double* w = nullptr;        // optional [nodes] COOL-SD weights (null: all 1)
  const double* uacc = nullptr;     // [nodes] acceptance uniforms
  const double* ures = nullptr;     // [nodes] uniforms of the residual (or bonus) draw
  const double* ufresh = nullptr;   // optional [nodes] uniforms of a fresh draw from p
  int64_t nodes = 0, vocab = 0;
  bool* accepted = nullptr;     // [nodes] out
  int64_t* residual = nullptr;  // [nodes] out
  int64_t* kept = nullptr;      // [nodes] out
  int64_t* fresh = nullptr;     // [nodes] out where ufresh is given
  // Optional [nodes, packed_cols] out, float64: accepted, residual, kept, fresh (where ufresh is
  // given) and, with packed_cols 5, the node's own token (tokens[n]): the step's readback rows
  // as commit_window.cc's Pack lays them out, without converting and joining the outputs.
  double* packed = nullptr;
  int64_t packed_cols = 0;
  // Optional GSD (seed 004; verify.h's GroupedAcceptRatio): where group[n] > 0 and node n has a
  // draft x, its acceptance ratio is the mass of x's cluster under p over its mass under the raw
  // q row. The cluster: the ids at ranks r(x) - G/2 .. r(x) + G - G/2 - 1 of p's ascending
  // order (ties by id), G = group[n] <= kChainGroupMax, each kept where |p(j) - p(x)| <
  // group_delta[n] and |e_j - e_x|^2 < group_dist[n]. The residual stays the exact rule's.
  const int64_t* group = nullptr;       // [nodes] G, 0: the exact ratio
  const double* group_delta = nullptr;  // [nodes]
  const double* group_dist = nullptr;   // [nodes]
  const double* embed = nullptr;        // [vocab, embed_dim] token embeddings, row-major
  int64_t embed_dim = 0;
};

// The largest GSD cluster the fused pass takes: it walks the cluster one rank at a time, a pass
// over the row per rank. Larger clusters are verified by the eager path.
constexpr int64_t kChainGroupMax = 64;

// What a node's pass sums: its proposal row, its residual, or its target row.
enum class ChainMass : int { kQ = 0, kResidual = 1, kP = 2 };

struct ChainNode {
  const double* p;
  const double* q;  // null without a draft
  int64_t vocab;
  int64_t x;  // the draft's token, -1: none
  double w;
};

IMAGEGEN_HD ChainNode LoadChainNode(const ChainVerifyArgs& a, int64_t n) {
  ChainNode nd;
  nd.p = a.p + n * a.vocab;
  nd.vocab = a.vocab;
  const int64_t k = a.kid[n];
  nd.x = k < 0 ? -1 : (a.tokens != nullptr ? a.tokens[k] : k);
  nd.q = nd.x >= 0 ? a.q + a.qrow[n] * a.vocab : nullptr;
  nd.w = a.w != nullptr ? a.w[n] : 1.0;
  return nd;
}

// q'(v): the proposal renormalised by its sum (RemoveAndNormalise: 0 where it has no mass).
IMAGEGEN_HD double ChainQNorm(const ChainNode& nd, double qsum, int64_t v) {
  return qsum > 0 ? nd.q[v] / (qsum > 1e-300 ? qsum : 1e-300) : 0.0;
}

IMAGEGEN_HD double ChainMassAt(const ChainNode& nd, ChainMass m, double qsum, int64_t v) {
  if (m == ChainMass::kQ) return nd.q[v];
  const double p = nd.p[v];
  if (m == ChainMass::kP) return p;
  const double qn = ChainQNorm(nd, qsum, v);
  const double wp = nd.w * p;
  const double cap = qn < wp ? qn : wp;
  const double r = p - cap;
  return r > 0 ? r : 0.0;
}

IMAGEGEN_HD int64_t ChainChunkBegin(int64_t vocab, int chunk) {
  const int64_t len = (vocab + kChainVerifyChunks - 1) / kChainVerifyChunks;
  const int64_t b = len * chunk;
  return b < vocab ? b : vocab;
}

// Chunk `c`'s sum, left to right.
IMAGEGEN_HD double ChainChunkSum(const ChainNode& nd, ChainMass m, double qsum, int c) {
  const int64_t e = ChainChunkBegin(nd.vocab, c + 1);
  double s = 0.0;
  for (int64_t v = ChainChunkBegin(nd.vocab, c); v < e; ++v) s += ChainMassAt(nd, m, qsum, v);
  return s;
}

// The chunk sums' total, left to right.
IMAGEGEN_HD double ChainTotal(const double* chunk_sums) {
  double s = 0.0;
  for (int c = 0; c < kChainVerifyChunks; ++c) s += chunk_sums[c];
  return s;
}

// The inverse-CDF draw: the chunk whose running total first exceeds u * total, then the first
// id in it whose running total (from the chunk's start) does. Rounding can leave the target
// unreached; then the last id with mass of that chunk, or of the whole row, is drawn, never an
// id without mass (a row with no mass at all gives its last id).
IMAGEGEN_HD int64_t ChainDraw(const ChainNode& nd, ChainMass m, double qsum,
                              const double* chunk_sums, double total, double u) {
  const double target = u * total;
  double run = 0.0;
  int chunk = -1, last_nonzero = -1;
  for (int c = 0; c < kChainVerifyChunks; ++c) {
    if (chunk_sums[c] > 0) last_nonzero = c;
    if (run + chunk_sums[c] > target && chunk_sums[c] > 0) {
      chunk = c;
      break;
    }
    run += chunk_sums[c];
  }
  if (chunk < 0) chunk = last_nonzero;
  if (chunk < 0) return nd.vocab - 1;
  const int64_t e = ChainChunkBegin(nd.vocab, chunk + 1);
  int64_t last = -1;
  for (int64_t v = ChainChunkBegin(nd.vocab, chunk); v < e; ++v) {
    const double mass = ChainMassAt(nd, m, qsum, v);
    if (mass > 0) {
      run += mass;
      last = v;
      if (run > target) return v;
    }
  }
  return last;  // the chunk has mass (its sum is positive), so last >= 0
}

// GSD: whether node n's ratio is its cluster's.
IMAGEGEN_HD bool ChainIsGrouped(const ChainVerifyArgs& a, int64_t n, const ChainNode& nd) {
  return a.group != nullptr && a.group[n] > 0 && nd.x >= 0;
}

// GSD's order over a row: ascending p, ties by id (a stable sort's).
IMAGEGEN_HD bool ChainRankLess(double pa, int64_t ia, double pb, int64_t ib) {
  return pa < pb || (pa == pb && ia < ib);
}

// Whether id v is nearer to id `at` than `best` (-1: none yet) among the ids above `at` in that
// order (up) or below it.
IMAGEGEN_HD bool ChainNearer(const ChainNode& nd, int64_t at, int64_t v, int64_t best, bool up) {
  const double pv = nd.p[v], pa = nd.p[at];
  if (up ? !ChainRankLess(pa, at, pv, v) : !ChainRankLess(pv, v, pa, at)) return false;
  if (best < 0) return true;
  const double pb = nd.p[best];
  return up ? ChainRankLess(pv, v, pb, best) : ChainRankLess(pb, best, pv, v);
}

// Chunk c's nearest id above (or below) `at`; -1: none.
IMAGEGEN_HD int64_t ChainChunkNeighbour(const ChainNode& nd, int c, int64_t at, bool up) {
  const int64_t e = ChainChunkBegin(nd.vocab, c + 1);
  int64_t best = -1;
  for (int64_t v = ChainChunkBegin(nd.vocab, c); v < e; ++v) {
    if (ChainNearer(nd, at, v, best, up)) best = v;
  }
  return best;
}

// The nearest of the chunks' candidates (-1: none anywhere).
IMAGEGEN_HD int64_t ChainNearest(const ChainNode& nd, int64_t at, const int64_t* cand, bool up) {
  int64_t best = -1;
  for (int c = 0; c < kChainVerifyChunks; ++c) {
    if (cand[c] >= 0 && ChainNearer(nd, at, cand[c], best, up)) best = cand[c];
  }
  return best;
}

// Cluster member j's masses, where its probability gap and embedding distance to x are small.
IMAGEGEN_HD void ChainGroupAdd(const ChainVerifyArgs& a, int64_t n, const ChainNode& nd, int64_t j,
                               double* num, double* den) {
  const double gap = nd.p[j] - nd.p[nd.x];
  if (!((gap < 0 ? -gap : gap) < a.group_delta[n])) return;
  const double* ex = a.embed + nd.x * a.embed_dim;
  const double* ej = a.embed + j * a.embed_dim;
  double d = 0.0;
  for (int64_t k = 0; k < a.embed_dim; ++k) d += (ej[k] - ex[k]) * (ej[k] - ex[k]);
  if (!(d < a.group_dist[n])) return;
  *num += nd.p[j];
  *den += nd.q[j];
}

// How many cluster ranks lie below x (up = false) or above it.
IMAGEGEN_HD int64_t ChainGroupSteps(const ChainVerifyArgs& a, int64_t n, bool up) {
  const int64_t g = a.group[n];
  return up ? g - g / 2 - 1 : g / 2;
}

// p(C) / q(C); q(C) = 0: 1 if p(C) > 0, else 0 (AcceptRatio's rule).
IMAGEGEN_HD double ChainGroupRatio(double num, double den) {
  return den > 0 ? num / (den > 1e-300 ? den : 1e-300) : (num > 0 ? 1.0 : 0.0);
}

// The node's acceptance, given its proposal row's sum (and, for a GSD node, its cluster's
// ratio; negative: the exact rule's); writes the three outputs.
IMAGEGEN_HD void ChainFinish(const ChainVerifyArgs& a, int64_t n, const ChainNode& nd, double qsum,
                             int64_t residual, double grouped_ratio = -1.0) {
  bool acc = false;
  if (nd.x >= 0) {
    const double px = nd.p[nd.x];
    const double qx = ChainQNorm(nd, qsum, nd.x);
    const double num = nd.w * px;
    double ratio = grouped_ratio >= 0 ? grouped_ratio
                   : qx > 0           ? num / (qx > 1e-300 ? qx : 1e-300)
                                      : (px > 0 ? 1.0 : 0.0);
    if (ratio > 1.0) ratio = 1.0;
    acc = a.uacc[n] < ratio;
  }
  a.accepted[n] = acc;
  a.residual[n] = residual;
  a.kept[n] = acc ? nd.x : residual;
  if (a.packed != nullptr) {
    double* row = a.packed + n * a.packed_cols;
    row[0] = acc ? 1.0 : 0.0;
    row[1] = static_cast<double>(residual);
    row[2] = static_cast<double>(a.kept[n]);
    if (a.packed_cols > 4) row[4] = static_cast<double>(a.tokens[n]);
  }
}

// Node n's fresh draft, into its output and its packed row.
IMAGEGEN_HD void ChainFresh(const ChainVerifyArgs& a, int64_t n, int64_t fresh) {
  a.fresh[n] = fresh;
  if (a.packed != nullptr) a.packed[n * a.packed_cols + 3] = static_cast<double>(fresh);
}

// The CPU path's chunk loop: every chunk's sum of `m` into `sums`, and their total.
inline double ChainSumsOnHost(const ChainNode& nd, ChainMass m, double qsum, double* sums) {
  for (int c = 0; c < kChainVerifyChunks; ++c) sums[c] = ChainChunkSum(nd, m, qsum, c);
  return ChainTotal(sums);
}

// A GSD node's cluster ratio (-1 for any other node): x's own masses, then the ranks below x
// walking down, then those above walking up, one pass over the row per rank, each chunk's
// nearest id first (the kernel's order of sums).
inline double ChainGroupedRatioOnHost(const ChainVerifyArgs& a, int64_t n) {
  const ChainNode nd = LoadChainNode(a, n);
  if (!ChainIsGrouped(a, n, nd)) return -1.0;
  int64_t cand[kChainVerifyChunks];
  double num = 0.0, den = 0.0;
  ChainGroupAdd(a, n, nd, nd.x, &num, &den);
  for (const bool up : {false, true}) {
    int64_t at = nd.x;
    for (int64_t s = 0; s < ChainGroupSteps(a, n, up); ++s) {
      for (int c = 0; c < kChainVerifyChunks; ++c) cand[c] = ChainChunkNeighbour(nd, c, at, up);
      at = ChainNearest(nd, at, cand, up);
      if (at < 0) break;  // the row's end
      ChainGroupAdd(a, n, nd, at, &num, &den);
    }
  }
  return ChainGroupRatio(num, den);
}

// The CPU path: node n, each chunk in turn where the kernel runs them side by side.
inline void ChainVerifyNodeOnHost(const ChainVerifyArgs& a, int64_t n) {
  double sums[kChainVerifyChunks];
  const ChainNode nd = LoadChainNode(a, n);
  const double grouped = ChainGroupedRatioOnHost(a, n);
  const double qsum = nd.x >= 0 ? ChainSumsOnHost(nd, ChainMass::kQ, 0, sums) : 0.0;
  ChainMass m = nd.x >= 0 ? ChainMass::kResidual : ChainMass::kP;
  double total = ChainSumsOnHost(nd, m, qsum, sums);
  if (m == ChainMass::kResidual && !(total > 0)) {  // no residual mass: draw from p
    m = ChainMass::kP;
    total = ChainSumsOnHost(nd, m, qsum, sums);
  }
  ChainFinish(a, n, nd, qsum, ChainDraw(nd, m, qsum, sums, total, a.ures[n]), grouped);
  if (a.ufresh != nullptr) {  // p's chunk sums, unless the residual draw was from p already
    if (m != ChainMass::kP) total = ChainSumsOnHost(nd, ChainMass::kP, 0, sums);
    ChainFresh(a, n, ChainDraw(nd, ChainMass::kP, 0, sums, total, a.ufresh[n]));
  }
}

// Launches the kernel over all nodes on `stream` (a cudaStream_t; null: the default stream).
// Every pointer is device memory. Returns the cudaError_t of the launch (0: none). Defined in
// chain_verify.cu, built only where nvcc is.
int LaunchChainVerify(const ChainVerifyArgs& args, void* stream);

}  // namespace imagegen::kernels
