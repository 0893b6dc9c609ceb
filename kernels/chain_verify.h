// Fused verification: a node's whole verification in one pass over its rows, for every node of
// a step at once (one CUDA block per node, kernels/chain_verify.cu; on the CPU the same
// functions in the same order, ChainVerifyNodeOnHost). It replaces the eager loop of
// verify_windows.cc (verify.h's AcceptRatio, ResidualDistribution, SampleInverseCdf, ...:
// about 30 launches for a chain, about 20 more per tree sibling) and DrawNextDrafts' draws
// (about 5, and about 15 per tree candidate) with one launch, and makes the same decisions.
// For a chain node (one child x):
//
//   q'  = q / sum(q)                                (RemoveAndNormalise with nothing removed)
//   acc = x >= 0 and u_acc < min(1, w p(x) / q'(x))  (q'(x) = 0: 1 if p(x) > 0, else 0)
//         (a GSD node: u_acc < min(1, p(C) / q(C)) over its cluster C, ChainGroupedRatioOnHost)
//   r   = [p - min(q', w p)]_+, or p where r has no mass or the node has no draft
//   res = the first v with r_0 + ... + r_v > u_res * sum(r)   (inverse CDF)
//   kept = acc ? x : res
//   fresh = the first v with p_0 + ... + p_v > u_fresh * sum(p)   (the next draft)
//
// A tree node's children x_0..x_{K-1} are verified in turn (multi-draft speculative sampling):
// child k against p_k (p_0 = p, p_{k+1} = the normalised residual of child k) and q_k (q without
// x_0..x_{k-1}, renormalised); the residual draw is from the last child's residual; kept is the
// first accepted child, else the residual. p_k is not stored: a level's value at v is p(v) taken
// through the residuals before it (ChainPAt), with each level's two sums S_k and T_k from its
// own passes, so a node of K children makes 2K + 1 passes. Its D - 1 extra next drafts are drawn
// from p without replacement, after the kept token (maximal coupling) or the fresh draft.
//
// Sums are taken in a fixed order: kChainVerifyChunks contiguous chunks, each summed left to
// right, then the chunk sums left to right. Device and host therefore add the same doubles in
// the same order and draw bit-identical tokens (tests/kernels_test.cc). Against the eager
// reduction order of verify.h a draw differs only where u lands within rounding of a CDF
// boundary. Header-only and free of CUDA: the engine's CPU path includes it.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "kernels/philox_rounds.h"  // IMAGEGEN_HD

namespace imagegen::kernels {

// Chunks per row; also the CUDA block size (one thread per chunk).
constexpr int kChainVerifyChunks = 256;

struct ChainVerifyArgs {
  const double* p = nullptr;      // [nodes, V] target distributions, row-major
  const double* q = nullptr;      // [columns, V] proposals
  const int64_t* qrow = nullptr;  // [nodes] each node's q row (read where it has a draft)
  const int64_t* kid = nullptr;   // [nodes, kids] the children (tokens, or node indices), -1: none
  const int64_t* tokens = nullptr;  // optional [nodes]: kid is a node index into it
  const double* w = nullptr;        // optional [nodes] COOL-SD weights of the first child (null: 1)
  const double* uacc = nullptr;     // [nodes, kids] acceptance uniforms
  const double* ures = nullptr;     // [nodes] uniforms of the residual (or bonus) draw
  const double* ufresh = nullptr;   // optional [nodes, draws] uniforms of the next drafts
  const int64_t* maximal = nullptr;  // optional [nodes] (draws > 1): 1 where the extra drafts
                                     // exclude the kept token (maximal coupling), else the fresh
  int64_t nodes = 0, vocab = 0;
  int64_t kids = 1;          // K <= kChainMaxKids: children per node (1: chains)
  int64_t draws = 1;         // D <= kChainMaxKids: next drafts per node (fresh, then D - 1 extras)
  bool* accepted = nullptr;  // [nodes, kids] out
  int64_t* residual = nullptr;  // [nodes] out
  int64_t* kept = nullptr;      // [nodes] out
  int64_t* fresh = nullptr;     // [nodes] out where ufresh is given
  int64_t* extra = nullptr;     // [nodes, draws - 1] out where ufresh is given and draws > 1
  // Optional [nodes, packed_cols] out, float64: accepted (kids columns), residual, kept, fresh,
  // extra (draws - 1; where ufresh is given) and, with packed_cols kids + draws + 3, the node's
  // own token (tokens[n]): the step's readback rows as commit_window.cc's Pack lays them out,
  // without converting and joining the outputs.
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
  // Optional Gumbel coupling (scd-gs, pac-gumbel; DrawNextDrafts's GumbelDraws): where
  // gumbel[n] != 0 the next drafts are instead the `draws` ids with the largest
  // p(v) / (-log u_v), u_v = PhiloxUniform(seed[n], position[n], 0, kGumbel, v) clamped to
  // [1e-300, 1 - 1e-16], in descending order (ties by id); an extra whose key is 0 (p(v) = 0)
  // is -1. (The Gumbel-max key log p(v) - log(-log u_v) in the same order, in one log.)
  const int64_t* gumbel = nullptr;    // [nodes]
  const int64_t* seed = nullptr;      // [nodes] the request's seed (its bits)
  const int64_t* position = nullptr;  // [nodes] the position the node's output predicts
  // Optional match rule (ar-gm, scd-gm): where match[n] != 0 (gumbel[n] != 0 too) the node's
  // token is its first Gumbel draft g* = argmax p(v) / (-log u_v): residual = kept = g*, and
  // child k is accepted iff x_k == g*. No pass over q or the residuals is made.
  const int64_t* match = nullptr;  // [nodes]
};

// Purpose::kGumbel of engine/decoding/philox.h (the engine checks that they agree).
constexpr uint32_t kChainGumbelPurpose = 6;

// The largest GSD cluster the fused pass takes: it walks the cluster one rank at a time, a pass
// over the row per rank. Larger clusters are verified by the eager path.
constexpr int64_t kChainGroupMax = 64;

// The most children a node may have, and the most next drafts it may draw, in the fused pass
// (trees: tree_branches, up to 16 in a policy; wider trees are verified by the eager path).
constexpr int kChainMaxKids = 8;

// What a pass over a node's row sums, at a sibling level k (the k-th child verified):
//   kQ         the proposal row without the siblings before k (RemoveAndNormalise's mass)
//   kResidual  [p_k - min(q_k, w_k p_k)]_+, the residual of sibling k
//   kP         p_k, the distribution sibling k is verified against (p_0 = p)
//   kExcluding p without the ids in `excl` (the next drafts' draws without replacement)
enum class ChainMass : int { kQ = 0, kResidual = 1, kP = 2, kExcluding = 3 };

struct ChainMassSpec {
  ChainMass kind;
  int level;
  int nexcl;
  int64_t excl[kChainMaxKids];
};

IMAGEGEN_HD ChainMassSpec ChainSpec(ChainMass kind, int level) {
  ChainMassSpec m;
  m.kind = kind;
  m.level = level;
  m.nexcl = 0;
  return m;
}

// A node: its rows, its children's tokens, and each verified level's sums (filled in as the
// pass goes): qsum[k] = S_k, the proposal's mass without the siblings before k; rsum[k] = T_k,
// sibling k's residual mass. p_{k+1} = T_k > 0 ? residual_k / T_k : p_k, where child k exists
// (ResidualDistribution); a missing child leaves p as it is.
struct ChainNode {
  const double* p;
  const double* q;  // null without any draft
  int64_t vocab;
  int kids;
  int64_t x[kChainMaxKids];  // the children's tokens, -1: none
  double w;                  // COOL-SD's weight, on the first child only
  double qsum[kChainMaxKids], rsum[kChainMaxKids];
};

IMAGEGEN_HD ChainNode LoadChainNode(const ChainVerifyArgs& a, int64_t n) {
  ChainNode nd;
  nd.p = a.p + n * a.vocab;
  nd.vocab = a.vocab;
  nd.kids = static_cast<int>(a.kids);
  bool any = false;
  for (int k = 0; k < kChainMaxKids; ++k) {
    const int64_t kid = k < nd.kids ? a.kid[n * a.kids + k] : -1;
    nd.x[k] = kid < 0 ? -1 : (a.tokens != nullptr ? a.tokens[kid] : kid);
    any = any || nd.x[k] >= 0;
    nd.qsum[k] = nd.rsum[k] = 0.0;
  }
  nd.q = any ? a.q + a.qrow[n] * a.vocab : nullptr;
  nd.w = a.w != nullptr ? a.w[n] : 1.0;
  return nd;
}

// Whether id v is one of the children before sibling k (removed from q at level k).
IMAGEGEN_HD bool ChainRemoved(const ChainNode& nd, int k, int64_t v) {
  for (int i = 0; i < k; ++i) {
    if (nd.x[i] == v) return true;
  }
  return false;
}

// q_k(v): the proposal without the earlier siblings, renormalised (0 where it has no mass).
IMAGEGEN_HD double ChainQAt(const ChainNode& nd, int k, int64_t v) {
  if (ChainRemoved(nd, k, v)) return 0.0;
  const double s = nd.qsum[k];
  return s > 0 ? nd.q[v] / (s > 1e-300 ? s : 1e-300) : 0.0;
}

// Sibling k's residual at v, given p_k(v).
IMAGEGEN_HD double ChainResidualOf(const ChainNode& nd, int k, int64_t v, double pv) {
  const double qn = ChainQAt(nd, k, v);
  const double wp = (k == 0 ? nd.w : 1.0) * pv;
  const double cap = qn < wp ? qn : wp;
  const double r = pv - cap;
  return r > 0 ? r : 0.0;
}

// p_k(v): p through the residuals of the children before k.
IMAGEGEN_HD double ChainPAt(const ChainNode& nd, int k, int64_t v) {
  double pv = nd.p[v];
  for (int i = 0; i < k; ++i) {
    if (nd.x[i] < 0) continue;
    const double t = nd.rsum[i];
    if (t > 0) pv = ChainResidualOf(nd, i, v, pv) / (t > 1e-300 ? t : 1e-300);
  }
  return pv;
}

IMAGEGEN_HD double ChainMassAt(const ChainNode& nd, const ChainMassSpec& m, int64_t v) {
  switch (m.kind) {
    case ChainMass::kQ:
      return ChainRemoved(nd, m.level, v) ? 0.0 : nd.q[v];
    case ChainMass::kResidual:
      return ChainResidualOf(nd, m.level, v, ChainPAt(nd, m.level, v));
    case ChainMass::kP:
      return ChainPAt(nd, m.level, v);
    default:
      for (int i = 0; i < m.nexcl; ++i) {
        if (m.excl[i] == v) return 0.0;
      }
      return nd.p[v];
  }
}

IMAGEGEN_HD int64_t ChainChunkBegin(int64_t vocab, int chunk) {
  const int64_t len = (vocab + kChainVerifyChunks - 1) / kChainVerifyChunks;
  const int64_t b = len * chunk;
  return b < vocab ? b : vocab;
}

// How many chunks hold ids: those from this one on are empty.
IMAGEGEN_HD int ChainChunksWithIds(int64_t vocab) {
  const int64_t len = (vocab + kChainVerifyChunks - 1) / kChainVerifyChunks;
  return len > 0 ? static_cast<int>((vocab + len - 1) / len) : 0;
}

// Chunk `c`'s sum, left to right.
IMAGEGEN_HD double ChainChunkSum(const ChainNode& nd, const ChainMassSpec& m, int c) {
  const int64_t e = ChainChunkBegin(nd.vocab, c + 1);
  double s = 0.0;
  for (int64_t v = ChainChunkBegin(nd.vocab, c); v < e; ++v) s += ChainMassAt(nd, m, v);
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
IMAGEGEN_HD int64_t ChainDraw(const ChainNode& nd, const ChainMassSpec& m, const double* chunk_sums,
                              double total, double u) {
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
    const double mass = ChainMassAt(nd, m, v);
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
  return a.group != nullptr && a.group[n] > 0 && nd.x[0] >= 0;
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
  const double gap = nd.p[j] - nd.p[nd.x[0]];
  if (!((gap < 0 ? -gap : gap) < a.group_delta[n])) return;
  const double* ex = a.embed + nd.x[0] * a.embed_dim;
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

// The children's acceptances (sibling k against p_k and q_k; GSD's first child against its
// cluster ratio `grouped` where that is >= 0), the residual draw and the kept token: writes
// them and returns the kept token.
// Under the match rule (`matched`: the node's token, else -1) child k is accepted iff it is
// that token, which is also the residual.
IMAGEGEN_HD int64_t ChainFinish(const ChainVerifyArgs& a, int64_t n, const ChainNode& nd,
                                double grouped, int64_t residual, int64_t matched = -1) {
  int first = -1;
  double* row = a.packed != nullptr ? a.packed + n * a.packed_cols : nullptr;
  for (int k = 0; k < nd.kids; ++k) {
    bool acc = false;
    const int64_t x = nd.x[k];
    if (matched >= 0) {
      acc = x >= 0 && x == matched;
    } else if (x >= 0) {
      const double px = ChainPAt(nd, k, x);
      const double qx = ChainQAt(nd, k, x);
      const double num = (k == 0 ? nd.w : 1.0) * px;
      double ratio = k == 0 && grouped >= 0 ? grouped
                     : qx > 0               ? num / (qx > 1e-300 ? qx : 1e-300)
                                            : (px > 0 ? 1.0 : 0.0);
      if (ratio > 1.0) ratio = 1.0;
      acc = a.uacc[n * a.kids + k] < ratio;
    }
    a.accepted[n * a.kids + k] = acc;
    if (acc && first < 0) first = k;
    if (row != nullptr) row[k] = acc ? 1.0 : 0.0;
  }
  const int64_t kept = first >= 0 ? nd.x[first] : residual;
  a.residual[n] = residual;
  a.kept[n] = kept;
  if (row != nullptr) {
    row[a.kids] = static_cast<double>(residual);
    row[a.kids + 1] = static_cast<double>(kept);
    if (a.packed_cols == a.kids + a.draws + 3) {
      row[a.kids + a.draws + 2] = static_cast<double>(a.tokens[n]);
    }
  }
  return kept;
}

// Next draft j of node n (0: the fresh one, else extra j - 1), into its output and packed row.
IMAGEGEN_HD void ChainNextDraft(const ChainVerifyArgs& a, int64_t n, int64_t j, int64_t token) {
  if (j == 0) {
    a.fresh[n] = token;
  } else {
    a.extra[n * (a.draws - 1) + j - 1] = token;
  }
  if (a.packed != nullptr)
    a.packed[n * a.packed_cols + a.kids + 2 + j] = static_cast<double>(token);
}

// A Gumbel-coupled node's key for id v (GumbelTopK's arithmetic, op for op).
IMAGEGEN_HD double ChainGumbelKey(const ChainVerifyArgs& a, int64_t n, const ChainNode& nd,
                                  int64_t v) {
  double u = PhiloxUniform(static_cast<uint64_t>(a.seed[n]), static_cast<uint32_t>(a.position[n]),
                           0, kChainGumbelPurpose, static_cast<uint32_t>(v));
  u = u < 1e-300 ? 1e-300 : (u > 1.0 - 1e-16 ? 1.0 - 1e-16 : u);
  return nd.p[v] / -log(u);
}

// Whether (ka, ia) comes before (kb, ib) among the largest keys: larger key, ties by lower id.
IMAGEGEN_HD bool ChainKeyBefore(double ka, int64_t ia, double kb, int64_t ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Inserts (key, v) into the best-first list keys/ids of *len <= d entries, keeping the best d.
IMAGEGEN_HD void ChainTopInsert(double* keys, int64_t* ids, int* len, int d, double key,
                                int64_t v) {
  int i = *len;
  if (i == d) {
    if (!ChainKeyBefore(key, v, keys[d - 1], ids[d - 1])) return;
    i = d - 1;
  } else {
    *len += 1;
  }
  while (i > 0 && ChainKeyBefore(key, v, keys[i - 1], ids[i - 1])) {
    keys[i] = keys[i - 1];
    ids[i] = ids[i - 1];
    --i;
  }
  keys[i] = key;
  ids[i] = v;
}

// Chunk c's best d ids by Gumbel key (ids -1 past the chunk's length).
IMAGEGEN_HD void ChainChunkGumbelTop(const ChainVerifyArgs& a, int64_t n, const ChainNode& nd,
                                     int c, int d, double* keys, int64_t* ids) {
  int len = 0;
  const int64_t e = ChainChunkBegin(nd.vocab, c + 1);
  for (int64_t v = ChainChunkBegin(nd.vocab, c); v < e; ++v) {
    ChainTopInsert(keys, ids, &len, d, ChainGumbelKey(a, n, nd, v), v);
  }
  for (int i = len; i < d; ++i) ids[i] = -1;
}

// The best d of the chunks' lists: the next drafts.
IMAGEGEN_HD void ChainGumbelMerge(const ChainVerifyArgs& a, int64_t n, const double* ckeys,
                                  const int64_t* cids, int d) {
  double keys[kChainMaxKids];
  int64_t ids[kChainMaxKids];
  int len = 0;
  for (int c = 0; c < kChainVerifyChunks; ++c) {
    for (int i = 0; i < d; ++i) {
      const int64_t v = cids[c * kChainMaxKids + i];
      if (v >= 0) ChainTopInsert(keys, ids, &len, d, ckeys[c * kChainMaxKids + i], v);
    }
  }
  for (int j = 0; j < d; ++j) {
    const bool ok = j < len && (j == 0 || keys[j] > 0.0);  // an extra needs p(v) > 0
    ChainNextDraft(a, n, j, ok ? ids[j] : -1);
  }
}

// A Gumbel-coupled node's next drafts: every chunk's best, then the leader's merge.
template <class Block>
IMAGEGEN_HD void ChainGumbelDrafts(const ChainVerifyArgs& a, int64_t n, const ChainNode& nd,
                                   Block& b) {
  const int d = static_cast<int>(a.draws);
  for (int c = b.ChunkBegin(); c < kChainVerifyChunks; c += b.ChunkStep()) {
    ChainChunkGumbelTop(a, n, nd, c, d, b.ckeys + c * kChainMaxKids, b.cids + c * kChainMaxKids);
  }
  b.Barrier();
  if (b.Leader()) ChainGumbelMerge(a, n, b.ckeys, b.cids, d);
}

// A node's whole pass, for the host (one thread) and for a CUDA block alike. `Block` provides
// Sum(nd, m): every chunk's sum of m into sums (one chunk per thread on the device) and their
// total, returned to every thread; Leader(): the thread that draws and writes; Share(v): the
// leader's v, returned to every thread; ChunkBegin()/ChunkStep(): this thread's chunks;
// Barrier(); ckeys/cids: every chunk's Gumbel candidates. The passes, for children k = 0..K-1
// that exist: S_k, then T_k; the residual draw from the last child's residual (or, without
// residual mass or any child, from the level's p); the fresh draft from p; the extras from p
// without the ids drawn so far (the kept token under maximal coupling, else the fresh draft,
// first); for a Gumbel-coupled node instead its D best Gumbel keys.
// A match node: its Gumbel drafts first, then its verdicts from the first of them.
template <class Block>
IMAGEGEN_HD void ChainVerifyNodeWith(const ChainVerifyArgs& a, int64_t n, ChainNode& nd,
                                     double grouped, Block& b) {
  if (a.match != nullptr && a.match[n] != 0) {
    ChainGumbelDrafts(a, n, nd, b);
    if (b.Leader()) ChainFinish(a, n, nd, -1.0, a.fresh[n], a.fresh[n]);
    return;
  }
  int last = -1;
  for (int k = 0; k < nd.kids; ++k) {
    if (nd.x[k] < 0) continue;
    nd.qsum[k] = b.Sum(nd, ChainSpec(ChainMass::kQ, k));
    nd.rsum[k] = b.Sum(nd, ChainSpec(ChainMass::kResidual, k));
    last = k;
  }
  ChainMassSpec m = ChainSpec(ChainMass::kResidual, last);
  double total = last >= 0 ? nd.rsum[last] : 0.0;  // the last Sum: b.sums holds its chunks
  if (!(total > 0)) {  // no residual mass, or no child: the level's distribution
    m = ChainSpec(ChainMass::kP, last < 0 ? 0 : last);
    total = b.Sum(nd, m);
  }
  int64_t kept = -1, fresh = -1;
  if (b.Leader()) kept = ChainFinish(a, n, nd, grouped, ChainDraw(nd, m, b.sums, total, a.ures[n]));
  if (a.ufresh == nullptr) return;
  if (a.gumbel != nullptr && a.gumbel[n] != 0) {
    ChainGumbelDrafts(a, n, nd, b);
    return;
  }
  const ChainMassSpec p0 = ChainSpec(ChainMass::kP, 0);
  if (!(m.kind == ChainMass::kP && m.level == 0)) total = b.Sum(nd, p0);
  if (b.Leader()) {
    fresh = ChainDraw(nd, p0, b.sums, total, a.ufresh[n * a.draws]);
    ChainNextDraft(a, n, 0, fresh);
  }
  if (a.draws < 2) return;
  ChainMassSpec ex = ChainSpec(ChainMass::kExcluding, 0);
  ex.excl[ex.nexcl++] = b.Share(a.maximal != nullptr && a.maximal[n] != 0 ? kept : fresh);
  for (int64_t j = 1; j < a.draws; ++j) {
    const double t = b.Sum(nd, ex);
    int64_t e = -1;
    if (b.Leader()) {
      e = t > 0 ? ChainDraw(nd, ex, b.sums, t, a.ufresh[n * a.draws + j]) : -1;
      ChainNextDraft(a, n, j, e);
    }
    e = b.Share(e);
    if (e >= 0) ex.excl[ex.nexcl++] = e;
  }
}

// The host's Block: one thread, every chunk in turn (callable on the device too, as the
// template it instantiates must be).
struct ChainHostBlock {
  double sums[kChainVerifyChunks];
  double ckeys[kChainVerifyChunks * kChainMaxKids];  // each chunk's best Gumbel keys and ids
  int64_t cids[kChainVerifyChunks * kChainMaxKids];
  int live = kChainVerifyChunks;  // sums[c] for c >= live are 0
  IMAGEGEN_HD int ChunkBegin() const { return 0; }
  IMAGEGEN_HD int ChunkStep() const { return 1; }
  IMAGEGEN_HD void Barrier() const {}
  // ChainTotal of the chunks' sums. A vocabulary under kChainVerifyChunks ids leaves the chunks
  // past its last id empty: their sums are 0 (set once a node), and adding them to the total
  // changes no bit (x + 0 is x for every x but -0, and a total that starts at +0 is never -0),
  // so only the chunks with ids are summed (the toy models' 3 ids: 3 chunks of 256).
  IMAGEGEN_HD double Sum(const ChainNode& nd, const ChainMassSpec& m) {
    const int used = ChainChunksWithIds(nd.vocab);
    for (int c = used; c < live; ++c) sums[c] = 0.0;
    live = used;
    double total = 0.0;
    for (int c = 0; c < used; ++c) {
      sums[c] = ChainChunkSum(nd, m, c);
      total += sums[c];
    }
    return total;
  }
  IMAGEGEN_HD bool Leader() const { return true; }
  IMAGEGEN_HD int64_t Share(int64_t v) const { return v; }
};

// A GSD node's cluster ratio (-1 for any other node): x's own masses, then the ranks below x
// walking down, then those above walking up, one pass over the row per rank, each chunk's
// nearest id first (the kernel's order of sums).
inline double ChainGroupedRatioOnHost(const ChainVerifyArgs& a, int64_t n) {
  const ChainNode nd = LoadChainNode(a, n);
  if (!ChainIsGrouped(a, n, nd)) return -1.0;
  int64_t cand[kChainVerifyChunks];
  double num = 0.0, den = 0.0;
  ChainGroupAdd(a, n, nd, nd.x[0], &num, &den);
  for (const bool up : {false, true}) {
    int64_t at = nd.x[0];
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
  ChainNode nd = LoadChainNode(a, n);
  const double grouped = ChainGroupedRatioOnHost(a, n);
  ChainHostBlock b;
  ChainVerifyNodeWith(a, n, nd, grouped, b);
}

// Launches the kernel over all nodes on `stream` (a cudaStream_t; null: the default stream).
// Every pointer is device memory. Returns the cudaError_t of the launch (0: none). Defined in
// chain_verify.cu, built only where nvcc is.
int LaunchChainVerify(const ChainVerifyArgs& args, void* stream);

}  // namespace imagegen::kernels
