// Random chain- and tree-verification inputs with the edge cases the rule has (no draft, a draft
// q could not have drawn, q == p so no residual mass, one-hot proposals, rows with zeros, COOL-SD
// weights, drafts given as node indices, GSD clusters with ties; for trees siblings without
// replacement, missing siblings, and extra candidates under either coupling), and the eager
// verification of verify.h on them (verify_windows.cc's loop and next_drafts.cc's draws): the
// reference the fused verification (kernels/chain_verify.h) is checked against on the host
// (chain_verify_test.cc) and on a GPU (kernels_test.cc).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "engine/decoding/philox.h"
#include "engine/decoding/sampling.h"
#include "engine/decoding/verify.h"
#include "kernels/chain_verify.h"

namespace imagegen::chain_test {

struct ChainCase {
  at::Tensor p, q;               // [A, V], [C, V] float64
  at::Tensor qrow, kid, tokens;  // int64 [A], [A, K], [A * K] (kid indexes tokens)
  at::Tensor w, uacc, ures;      // float64 [A], [A, K], [A]
  at::Tensor ufresh;             // float64 [A, D]: the next drafts' draws from p
  at::Tensor maximal;            // int64 [A] (D > 1): the extras exclude the kept token
  int64_t kids = 1, draws = 1;   // K, D (1, 1: chains)
  bool weighted = false;
  // GSD (AddGroups): cluster sizes (0: the exact rule), gap and distance bounds, embeddings.
  at::Tensor group;          // int64 [A]
  at::Tensor gdelta, gdist;  // float64 [A]
  at::Tensor embed;          // float64 [V, 3]
  bool grouped = false;
  // Gumbel coupling (AddGumbel): the flag, the request's seed and the predicted position.
  at::Tensor gumbel, seed, position;  // int64 [A]
  bool gumbel_on = false;
  // The match rule (AddMatch) on some Gumbel nodes: the node's token is its first Gumbel draft.
  at::Tensor match;  // int64 [A]
  bool match_on = false;
};

inline ChainCase RandomChainCase(int64_t A, int64_t V, bool weighted, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f64 = at::TensorOptions().dtype(at::kDouble);
  ChainCase c;
  c.weighted = weighted;
  at::Tensor p = at::softmax(at::randn({A, V}, g, f64) * 3, 1);
  // A third of the rows keep only their most likely ids (top-k, k = min(20, V - 1)).
  const int64_t k = std::min<int64_t>(20, V - 1);
  at::Tensor keep = p >= std::get<0>(p.topk(k, 1)).narrow(1, k - 1, 1);
  at::Tensor cut = (at::arange(A) % 3 == 0).unsqueeze(1);
  p = at::where(cut & ~keep, at::zeros_like(p), p);
  c.p = p / p.sum(1, true);
  // Proposals, one row per node: independent of p, except a copy of p (every fifth node: the
  // residual is empty) and one-hot rows (every seventh); half zeros where p is cut (every
  // third); then the rows shuffled.
  at::Tensor q = at::softmax(at::randn({A, V}, g, f64) * 2, 1);
  q = at::where(cut & (q < std::get<0>(q.median(1, true))), at::zeros_like(q), q);
  at::Tensor idx = at::arange(A);
  q = at::where((idx % 5 == 0).unsqueeze(1), c.p, q);
  at::Tensor hot = at::randint(V, {A}, g, at::kLong);
  q = at::where((idx % 7 == 0).unsqueeze(1), OneHot(hot, V, at::kDouble), q);
  // Unnormalised rows (sum 0.9-1.1): RemoveAndNormalise renormalises them.
  q = q * (0.9 + 0.2 * at::rand({A, 1}, g, f64));
  at::Tensor perm = at::randperm(A, g, at::TensorOptions().dtype(at::kLong));
  c.q = q.index_select(0, perm);
  c.qrow = at::argsort(perm);  // node a's proposal is q row qrow[a] (= its own row above)
  // Drafts: drawn from q (node % 11 == 3: an id q gives no mass, where there is one and q is
  // not p: a draft q could not have drawn leaves, with q = p, a residual of rounding noise),
  // none for every sixth node.
  at::Tensor x = SampleInverseCdf(q, at::rand({A}, g, f64));
  at::Tensor zero_q = (q == 0).to(at::kDouble);
  at::Tensor has_zero = zero_q.sum(1) > 0;
  at::Tensor x0 =
      SampleInverseCdf(zero_q + (~has_zero).unsqueeze(1).to(at::kDouble), at::rand({A}, g, f64));
  x = at::where((idx % 11 == 3) & (idx % 5 != 0) & has_zero, x0, x);
  x = at::where(idx % 6 == 1, at::full_like(x, -1), x);
  // The drafts as node indices into a token table (as draft-model steps give them).
  at::Tensor slot = at::randperm(A, g, at::TensorOptions().dtype(at::kLong));
  c.tokens = at::zeros({A}, at::kLong).index_copy(0, slot, x.clamp_min(0));
  c.kid = at::where(x >= 0, slot, at::full_like(slot, -1));
  c.w = weighted ? 0.5 + at::rand({A}, g, f64) : at::ones({A}, f64);
  c.uacc = at::rand({A}, g, f64);
  c.ures = at::rand({A}, g, f64);
  c.ufresh = at::rand({A}, g, f64);
  c.maximal = at::zeros({A}, at::kLong);
  c.group = at::zeros({A}, at::kLong);
  c.gdelta = at::zeros({A}, f64);
  c.gdist = at::zeros({A}, f64);
  c.embed = at::zeros({V, 3}, f64);
  c.gumbel = at::zeros({A}, at::kLong);
  c.seed = at::zeros({A}, at::kLong);
  c.position = at::zeros({A}, at::kLong);
  c.match = at::zeros({A}, at::kLong);
  return c;
}

// Gumbel coupling on every third node (scd-gs, pac-gumbel): its next drafts are the top D of
// log p + Gumbel noise keyed by a seed and a position (D <= V).
inline void AddGumbel(ChainCase& c, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t A = c.p.size(0);
  TORCH_CHECK(c.draws <= c.p.size(1), "AddGumbel: more drafts than ids");
  c.gumbel_on = true;
  c.gumbel = (at::arange(A) % 3 == 1).to(at::kLong);
  c.seed = at::randint(1, int64_t{1} << 40, {A}, g, at::TensorOptions().dtype(at::kLong));
  c.position = at::randint(1, 1000, {A}, g, at::TensorOptions().dtype(at::kLong));
}

// The first Gumbel draft g* = argmax p(v) / (-log u_v) of the Gumbel nodes `gi`, the keys
// GumbelDraws uses, and the next D - 1 (undefined for D = 1).
inline std::pair<at::Tensor, at::Tensor> EagerGumbelDraws(const ChainCase& c, const at::Tensor& gi,
                                                          int64_t D) {
  const int64_t V = c.p.size(1), Ag = gi.size(0);
  at::Tensor gu = at::empty({Ag, V}, at::kDouble);
  double* u = gu.data_ptr<double>();
  for (int64_t i = 0; i < Ag; ++i) {
    const int64_t a = gi[i].item<int64_t>();
    const auto seed = static_cast<uint64_t>(c.seed[a].item<int64_t>());
    const auto pos = static_cast<uint32_t>(c.position[a].item<int64_t>());
    for (int64_t t = 0; t < V; ++t) {
      u[i * V + t] = Uniform(seed, pos, 0, Purpose::kGumbel, static_cast<uint32_t>(t));
    }
  }
  return GumbelTopK(c.p.index_select(0, gi), gu, D);
}

// The match rule (ar-gm, scd-gm) on every other Gumbel node of `c` (after AddGumbel): its
// token is g*, a child is accepted iff it is g*. At every other such node with children the
// last child is set to g*, so that acceptances (of a later sibling, in trees) occur.
inline void AddMatch(ChainCase& c) {
  TORCH_CHECK(c.gumbel_on, "AddMatch: after AddGumbel");
  const int64_t A = c.p.size(0), K = c.kids;
  c.match_on = true;
  c.match = ((c.gumbel > 0) & (at::arange(A) % 2 == 0)).to(at::kLong);
  const at::Tensor mi = c.match.nonzero().squeeze(1);
  const at::Tensor g = EagerGumbelDraws(c, mi, 1).first;
  at::Tensor kid = c.kid.reshape({A, K});
  for (int64_t i = 0; i < mi.size(0); i += 2) {
    const int64_t a = mi[i].item<int64_t>();
    const int64_t last = kid[a][K - 1].item<int64_t>();
    if (last >= 0) c.tokens[last] = g[i].item<int64_t>();
  }
}

// GSD on `c` (unweighted: the engine never mixes the two rules on one node): most nodes
// grouped, with cluster sizes 1 to kChainGroupMax (and the whole row where it is shorter), gap
// bounds from 0 (nothing but exact ties) to 1 (all), distance bounds over unit embeddings in 3-D
// (|e_j - e_x|^2 < 0.5 for about 1 pair in 8, < 2 for half, 1e9 for all), and ties: every
// fourth node's draft shares its probability with the next two ids, so the order among equal
// probabilities (by id) decides which ids are in its cluster (as do the zeros of cut rows).
inline void AddGroups(ChainCase& c, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f64 = at::TensorOptions().dtype(at::kDouble);
  const int64_t A = c.p.size(0), V = c.p.size(1);
  TORCH_CHECK(!c.weighted, "AddGroups: an unweighted case");
  c.grouped = true;
  const int64_t sizes[] = {0, 14, 1, 2, 3, 7, kernels::kChainGroupMax, 14};
  const double deltas[] = {0.15, 0.01, 1.0, 0.0, 0.15};
  const double dists[] = {0.5, 2.0, 1e9};
  at::Tensor first = c.kid.reshape({A, -1}).select(1, 0);  // GSD verifies the first child
  at::Tensor x = at::where(first >= 0, c.tokens.index_select(0, first.clamp_min(0)), first);
  at::Tensor p = c.p.clone();
  for (int64_t a = 0; a < A; ++a) {
    c.group[a] = std::min<int64_t>(sizes[a % 8], V);
    c.gdelta[a] = deltas[a % 5];
    c.gdist[a] = dists[a % 3];
    const int64_t xa = x[a].item<int64_t>();
    if (a % 4 == 0 && xa >= 0) {  // ties with the draft
      p[a][(xa + 1) % V] = p[a][xa];
      p[a][(xa + 2) % V] = p[a][xa];
    }
  }
  c.p = p / p.sum(1, true);
  at::Tensor e = at::randn({V, 3}, g, f64);
  c.embed = e / e.norm(2, 1, true);
}
// A tree step's nodes: K siblings per node drawn from q without replacement (as a proactive
// tree's candidates are), the last ones missing on every fourth node and all on every sixth,
// and on every ninth one missing in the middle; a draft q gives no mass (node % 11 == 3), q = p
// (every fifth) and one-hot q (every seventh: its later siblings meet a proposal without mass)
// as for chains; D next drafts per node, maximal coupling on odd nodes.
inline ChainCase RandomTreeCase(int64_t A, int64_t V, int64_t K, int64_t D, bool weighted,
                                uint64_t seed) {
  ChainCase c = RandomChainCase(A, V, weighted, seed);
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
  auto f64 = at::TensorOptions().dtype(at::kDouble);
  c.kids = K;
  c.draws = D;
  at::Tensor qa = c.q.index_select(0, c.qrow);
  at::Tensor first = c.kid >= 0;
  at::Tensor x0 = at::where(first, c.tokens.index_select(0, c.kid.clamp_min(0)), c.kid);
  std::vector<at::Tensor> cols = {x0};
  at::Tensor removed = OneHot(x0.clamp_min(0), V, at::kBool) & first.unsqueeze(1);
  at::Tensor idx = at::arange(A);
  for (int64_t k = 1; k < K; ++k) {
    at::Tensor qk = RemoveAndNormalise(qa, removed);
    at::Tensor ok = (qk.sum(1) > 0) & first;
    if (k > K / 2) ok = ok & (idx % 4 != 0);  // the last siblings missing
    at::Tensor xk = SampleInverseCdf(qk, at::rand({A}, g, f64));
    xk = at::where(ok, xk, at::full_like(xk, -1));
    cols.push_back(xk);
    removed = removed | (OneHot(xk.clamp_min(0), V, at::kBool) & ok.unsqueeze(1));
  }
  at::Tensor x = at::stack(cols, 1);  // [A, K]
  if (K > 2) {                        // a missing sibling in the middle
    x.select(1, 1).copy_(at::where(idx % 9 == 2, at::full_like(x0, -1), x.select(1, 1)));
  }
  // The children as node indices into a token table of A * K entries.
  at::Tensor slot = at::randperm(A * K, g, at::TensorOptions().dtype(at::kLong)).view({A, K});
  c.tokens =
      at::zeros({A * K}, at::kLong).index_copy(0, slot.reshape(-1), x.clamp_min(0).reshape(-1));
  c.kid = at::where(x >= 0, slot, at::full_like(slot, -1));
  c.uacc = at::rand({A, K}, g, f64);
  c.ufresh = at::rand({A, D}, g, f64);
  c.maximal = idx % 2;
  return c;
}

// The nodes whose acceptance ratio is GSD's (a cluster size and a draft), as int64 indices.
inline at::Tensor GroupedNodes(const ChainCase& c) {
  return ((c.group > 0) & (c.kid.reshape({c.kid.size(0), -1}).select(1, 0) >= 0))
      .nonzero()
      .squeeze(1);
}

// verify.h's GroupedAcceptRatio for those nodes, over their raw proposal rows.
inline at::Tensor EagerGroupedRatios(const ChainCase& c) {
  const at::Tensor gi = GroupedNodes(c);
  at::Tensor first = c.kid.reshape({c.kid.size(0), -1}).select(1, 0);
  at::Tensor x = c.tokens.index_select(0, first.index_select(0, gi));
  at::Tensor q = c.q.index_select(0, c.qrow.index_select(0, gi));
  const at::Tensor group = c.group.index_select(0, gi);
  return GroupedAcceptRatio(c.p.index_select(0, gi), q, x, group, group.max().item<int64_t>(),
                            c.gdelta.index_select(0, gi), c.gdist.index_select(0, gi), c.embed);
}

// The eager verification (verify_windows.cc's loop) and next drafts (next_drafts.cc's).
struct ChainVerdicts {
  at::Tensor accepted;               // bool [A] (chains) or [A, K]
  at::Tensor residual, kept, fresh;  // int64 [A]
  at::Tensor extra;                  // int64 [A, D - 1]
  at::Tensor packed;                 // the fused pass's readback rows, float64 [A, K + D + 3]
};

inline ChainVerdicts EagerChainVerify(const ChainCase& c) {
  const int64_t A = c.p.size(0), V = c.p.size(1), K = c.kids, D = c.draws;
  at::Tensor kid = c.kid.reshape({A, K});
  at::Tensor kids =
      at::where(kid >= 0, c.tokens.index_select(0, kid.reshape(-1).clamp_min(0)).view({A, K}), kid);
  at::Tensor uacc = c.uacc.reshape({A, K});
  at::Tensor Qa = c.q.index_select(0, c.qrow);
  at::Tensor pk = c.p, removed;
  std::vector<at::Tensor> acc;
  for (int64_t k = 0; k < K; ++k) {
    at::Tensor xk = kids.select(1, k);
    at::Tensor valid = xk >= 0, x = xk.clamp_min(0);
    at::Tensor qk = RemoveAndNormalise(Qa, removed);
    at::Tensor wk = k == 0 && c.weighted ? c.w : at::Tensor();
    at::Tensor ratio = AcceptRatio(pk, qk, x, wk);
    if (k == 0 && c.grouped) ratio = ratio.index_copy(0, GroupedNodes(c), EagerGroupedRatios(c));
    acc.push_back(valid & ExactRules().Accept(uacc.select(1, k), ratio.clamp_max(1.0)));
    pk = at::where(valid.unsqueeze(1), ResidualDistribution(pk, qk, wk), pk);
    if (k + 1 < K) {
      const at::Tensor drop = OneHot(x, V, at::kBool) & valid.unsqueeze(1);
      removed = removed.defined() ? removed | drop : drop;
    }
  }
  ChainVerdicts v;
  v.residual = SampleInverseCdf(pk, c.ures);
  at::Tensor accepted = at::stack(acc, 1);
  at::Tensor first = accepted.to(at::kByte).argmax(1, true);
  v.kept = at::where(accepted.any(1), kids.gather(1, first).squeeze(1), v.residual);
  v.accepted = K == 1 ? accepted.squeeze(1) : accepted;
  at::Tensor uf = c.ufresh.reshape({A, D});
  v.fresh = SampleInverseCdf(c.p, uf.select(1, 0));  // DrawNextDrafts's fresh draw
  v.extra = at::full({A, D - 1}, -1, at::kLong);
  at::Tensor mask = OneHot(at::where(c.maximal > 0, v.kept, v.fresh), V, at::kBool);
  for (int64_t k = 1; k < D; ++k) {  // its tree candidates, without replacement
    at::Tensor pm = RemoveAndNormalise(c.p, mask);
    at::Tensor ok = pm.sum(1) > 0;
    at::Tensor e = at::where(ok, SampleInverseCdf(pm, uf.select(1, k)), at::full_like(v.kept, -1));
    v.extra.select(1, k - 1).copy_(e);
    mask = mask | (OneHot(e.clamp_min(0), V, at::kBool) & ok.unsqueeze(1));
  }
  if (c.gumbel_on) {  // GumbelDraws: the top D of p / (-log u), u keyed by seed and position
    const at::Tensor gi = c.gumbel.nonzero().squeeze(1);
    auto [first, rest] = EagerGumbelDraws(c, gi, D);
    v.fresh = v.fresh.index_copy(0, gi, first);
    if (D > 1) v.extra = v.extra.index_copy(0, gi, rest);
  }
  if (c.match_on) {  // verify_windows.cc's ApplyMatch: g* is the node's first Gumbel draft
    const at::Tensor mi = c.match.nonzero().squeeze(1);
    const at::Tensor g = v.fresh.index_select(0, mi);
    const at::Tensor acc = kids.index_select(0, mi) == g.unsqueeze(1);
    v.accepted = v.accepted.reshape({A, K}).index_copy(0, mi, acc);
    if (K == 1) v.accepted = v.accepted.squeeze(1);
    v.residual = v.residual.index_copy(0, mi, g);
    v.kept = v.kept.index_copy(0, mi, g);
  }
  return v;
}

// The fused arguments over `c`'s tensors (all on one device, contiguous), writing into `out`.
inline kernels::ChainVerifyArgs FusedArgs(const ChainCase& c, ChainVerdicts& out) {
  kernels::ChainVerifyArgs a;
  a.p = c.p.data_ptr<double>();
  a.q = c.q.data_ptr<double>();
  a.qrow = c.qrow.data_ptr<int64_t>();
  a.kid = c.kid.data_ptr<int64_t>();
  a.tokens = c.tokens.data_ptr<int64_t>();
  a.w = c.weighted ? c.w.data_ptr<double>() : nullptr;
  a.uacc = c.uacc.data_ptr<double>();
  a.ures = c.ures.data_ptr<double>();
  a.ufresh = c.ufresh.data_ptr<double>();
  a.maximal = c.draws > 1 ? c.maximal.data_ptr<int64_t>() : nullptr;
  a.nodes = c.p.size(0);
  a.vocab = c.p.size(1);
  a.kids = c.kids;
  a.draws = c.draws;
  if (c.gumbel_on) {
    a.gumbel = c.gumbel.data_ptr<int64_t>();
    a.seed = c.seed.data_ptr<int64_t>();
    a.position = c.position.data_ptr<int64_t>();
  }
  if (c.match_on) a.match = c.match.data_ptr<int64_t>();
  if (c.grouped) {
    a.group = c.group.data_ptr<int64_t>();
    a.group_delta = c.gdelta.data_ptr<double>();
    a.group_dist = c.gdist.data_ptr<double>();
    a.embed = c.embed.data_ptr<double>();
    a.embed_dim = c.embed.size(1);
  }
  auto opt = c.p.options();
  out.accepted = c.kids == 1 ? at::empty({a.nodes}, opt.dtype(at::kBool))
                             : at::empty({a.nodes, c.kids}, opt.dtype(at::kBool));
  out.residual = at::empty({a.nodes}, opt.dtype(at::kLong));
  out.kept = at::empty({a.nodes}, opt.dtype(at::kLong));
  out.fresh = at::empty({a.nodes}, opt.dtype(at::kLong));
  out.extra = at::empty({a.nodes, c.draws - 1}, opt.dtype(at::kLong));
  a.packed_cols = c.kids + c.draws + 3;
  out.packed = at::empty({a.nodes, a.packed_cols}, opt.dtype(at::kDouble));
  a.packed = out.packed.data_ptr<double>();
  a.accepted = out.accepted.data_ptr<bool>();
  a.residual = out.residual.data_ptr<int64_t>();
  a.kept = out.kept.data_ptr<int64_t>();
  a.fresh = out.fresh.data_ptr<int64_t>();
  a.extra = c.draws > 1 ? out.extra.data_ptr<int64_t>() : nullptr;
  return a;
}

// The fused pass's cluster ratios (ChainGroupedRatioOnHost) for GroupedNodes(c).
inline at::Tensor HostGroupedRatios(const ChainCase& c, const kernels::ChainVerifyArgs& a) {
  const at::Tensor gi = GroupedNodes(c);
  at::Tensor r = at::empty({gi.size(0)}, at::kDouble);
  for (int64_t i = 0; i < gi.size(0); ++i) {
    r[i] = kernels::ChainGroupedRatioOnHost(a, gi[i].item<int64_t>());
  }
  return r;
}

inline ChainVerdicts HostChainVerify(const ChainCase& c) {
  ChainVerdicts v;
  const kernels::ChainVerifyArgs a = FusedArgs(c, v);
  for (int64_t n = 0; n < a.nodes; ++n) kernels::ChainVerifyNodeOnHost(a, n);
  return v;
}

inline ChainCase ChainCaseOn(const ChainCase& c, const at::Device& d) {
  ChainCase o = c;
  for (at::Tensor* t :
       {&o.p, &o.q, &o.qrow, &o.kid, &o.tokens, &o.w, &o.uacc, &o.ures, &o.ufresh, &o.maximal,
        &o.group, &o.gdelta, &o.gdist, &o.embed, &o.gumbel, &o.seed, &o.position, &o.match}) {
    *t = t->to(d).contiguous();
  }
  return o;
}

// Nodes where two verdicts differ in what the engine reads: the acceptances up to the first
// accepted sibling (CommitWindow's walk stops there), the kept token, the next drafts, and the
// residual where no draft was accepted (it is committed only then). `all`: every acceptance and
// the residual everywhere. Past an accepted draft whose q equals p up to rounding, the residual
// is rounding noise, drawn differently by two summation orders, and so are the later siblings'
// verdicts against it; the engine reads neither.
inline int64_t Mismatches(const ChainVerdicts& a, const ChainVerdicts& b, bool all = false) {
  const int64_t A = a.kept.size(0);
  at::Tensor acc = a.accepted.cpu().reshape({A, -1}), acc_b = b.accepted.cpu().reshape({A, -1});
  at::Tensor res = a.residual.cpu().ne(b.residual.cpu());
  if (!all) {
    res = res & ~acc.any(1);
    at::Tensor before = acc.to(at::kInt).cumsum(1) - acc.to(at::kInt);  // accepted before k
    at::Tensor read = before == 0;
    acc = acc & read;
    acc_b = acc_b & read;
  }
  at::Tensor extra = a.extra.cpu().ne(b.extra.cpu()).reshape({A, -1}).any(1);
  return (acc.ne(acc_b).any(1) | res | a.kept.cpu().ne(b.kept.cpu()) |
          a.fresh.cpu().ne(b.fresh.cpu()) | extra)
      .sum()
      .item<int64_t>();
}

// Rows of the fused pass's packed readback that differ from its outputs (and the node tokens).
inline int64_t PackedMismatches(const ChainCase& c, const ChainVerdicts& v) {
  const int64_t A = v.kept.size(0);
  at::Tensor want = at::cat(
      {v.accepted.cpu().reshape({A, -1}).to(at::kDouble),
       v.residual.cpu().unsqueeze(1).to(at::kDouble), v.kept.cpu().unsqueeze(1).to(at::kDouble),
       v.fresh.cpu().unsqueeze(1).to(at::kDouble), v.extra.cpu().to(at::kDouble),
       c.tokens.cpu().narrow(0, 0, A).unsqueeze(1).to(at::kDouble)},
      1);
  return want.ne(v.packed.cpu()).any(1).sum().item<int64_t>();
}

}  // namespace imagegen::chain_test
