// VerifyWindows: every node whose children are drafts for the next column verifies them with
// the rule of verify.h, siblings in candidate order (a chain is the case K = 1): with
// p^(1) = P_a, sibling k is accepted with probability min(1, w p^(k)(c_k) / q^(k)(c_k)), where
// q^(k) is q with c_1..c_{k-1} removed and renormalised, and p^(k+1) is the residual of p^(k)
// and q^(k). The first node with no accepted child commits a token from its final residual
// (or, at a leaf, the bonus from P_a). Under the match rule (ar-gm, scd-gm) a node's token is
// instead g* = argmax(log P_a + g), with the Gumbel keys of its next drafts, and a child is
// accepted iff it is g*. All nodes of all requests at once, on the device.
#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "engine/decoding/fused_kernels.h"
#include "engine/decoding/philox.h"
#include "engine/decoding/sampling.h"
#include "engine/decoding/step_phases.h"
#include "engine/model/cuda_stream.h"
#include "engine/model/transfer.h"

namespace imagegen {
namespace {

static_assert(kernels::kChainGumbelPurpose == static_cast<uint32_t>(Purpose::kGumbel),
              "the fused pass keys Gumbel noise as DrawNextDrafts does");

// Per-node inputs, built on the host: children, uniforms, q rows, COOL weights, GSD nodes.
struct VerifyInputs {
  std::vector<int64_t> qrow, kid;
  std::vector<double> w, uacc, ures;
  std::vector<double> ufresh;    // [A, tree_k]: the next drafts' uniforms (DrawNextDrafts's)
  std::vector<int64_t> maximal;  // [A] with trees: 1 under maximal coupling (DrawNextDrafts's)
  // [A] where a node is Gumbel-coupled: the flag, its request's seed and the position its
  // output predicts (GumbelDraws' keys).
  std::vector<int64_t> gumbel, seed, position;
  std::vector<int64_t> match;  // [A] where a request takes the match rule: 1 at its nodes
  std::vector<int64_t> grouped, group_size;
  std::vector<double> group_delta, group_dist;
};

VerifyInputs BuildInputs(const StepContext& ctx) {
  const int64_t A = ctx.nodes, K = ctx.max_kids, D = ctx.tree_k;
  VerifyInputs in;
  in.qrow.assign(A, 0);
  in.kid.assign(A * K, -1);
  in.w.assign(A, 1.0);
  in.uacc.assign(A * K, 0.0);
  in.ures.assign(A, 0.0);
  in.ufresh.assign(A * D, 0.0);
  if (D > 1) in.maximal.assign(A, 0);
  if (std::any_of(ctx.live.begin(), ctx.live.end(),
                  [](const Sequence* s) { return s->r.policy.coupling == Coupling::kGumbel; })) {
    in.gumbel.assign(A, 0);
    in.seed.assign(A, 0);
    in.position.assign(A, 0);
  }
  if (std::any_of(ctx.live.begin(), ctx.live.end(),
                  [](const Sequence* s) { return s->r.policy.acceptance == Acceptance::kMatch; })) {
    in.match.assign(A, 0);
  }
  for (const Sequence* s : ctx.live) {
    const DecodingPolicy& p = s->r.policy;
    for (size_t i = 0; i < s->nodes.size(); ++i) {
      const Node& nd = s->nodes[i];
      const int64_t a = s->node_off + static_cast<int64_t>(i);
      const int64_t col = nd.col + 1;  // the column this node's output predicts
      const auto t = static_cast<uint32_t>(s->n() + col);
      in.ures[a] = Uniform(s->r.seed, t, s->iter, Purpose::kResample);
      for (int64_t k = 0; k < D; ++k) {
        in.ufresh[a * D + k] =
            Uniform(s->r.seed, t, s->iter, Purpose::kDraft, static_cast<uint32_t>(k));
      }
      if (D > 1) in.maximal[a] = p.coupling == Coupling::kMaximal ? 1 : 0;
      if (p.coupling == Coupling::kGumbel) {
        in.gumbel[a] = 1;
        in.seed[a] = static_cast<int64_t>(s->r.seed);
        in.position[a] = ctx.rules.GumbelPosition(t);
      }
      if (p.acceptance == Acceptance::kMatch) in.match[a] = 1;
      if (nd.kids.empty()) continue;
      in.qrow[a] = s->q_off + col;
      for (size_t k = 0; k < nd.kids.size(); ++k) {
        // With node tokens on the device, the child's node index (its token is looked up there).
        in.kid[a * K + static_cast<int64_t>(k)] =
            ctx.node_tokens.defined() ? s->node_off + nd.kids[k] : s->nodes[nd.kids[k]].token;
        in.uacc[a * K + static_cast<int64_t>(k)] =
            Uniform(s->r.seed, t, s->iter, Purpose::kAccept, static_cast<uint32_t>(k));
      }
      if (p.acceptance == Acceptance::kRelaxed) in.w[a] = s->cool_w[static_cast<size_t>(col)];
      if (p.acceptance == Acceptance::kGrouped) {
        in.grouped.push_back(a);
        in.group_size.push_back(std::min<int64_t>(p.gsd_group, ctx.cfg().vocab_size));
        in.group_delta.push_back(p.gsd_delta);
        in.group_dist.push_back(p.gsd_distance);
      }
    }
  }
  return in;
}

// GSD (seed 004 Alg. 3; verify.h) for the grouped nodes: their cluster ratio. `gi`: in.grouped
// on the device.
at::Tensor GroupedRatio(const StepContext& ctx, const VerifyInputs& in, const at::Tensor& gi,
                        const at::Tensor& Qa, const at::Tensor& x) {
  const at::Device dev = ctx.dev();
  return GroupedAcceptRatio(ctx.p.index_select(0, gi), Qa.index_select(0, gi),
                            x.index_select(0, gi), UploadLongs(in.group_size, dev),
                            *std::max_element(in.group_size.begin(), in.group_size.end()),
                            UploadDoubles(in.group_delta, dev), UploadDoubles(in.group_dist, dev),
                            ctx.embeddings);
}

// Whether this step's verification can run fused (SpecOptions::fused_verify): chains and trees
// of at most kernels::kChainMaxKids children (and next drafts) per node, the exact rules, GSD
// clusters of at most kernels::kChainGroupMax ids, and on CUDA the kernel (FusedKernelsOn).
bool CanFuse(const StepContext& ctx, const VerifyInputs& in) {
  if (!ctx.opts.fused_verify) return false;
  if (ctx.max_kids > kernels::kChainMaxKids || ctx.tree_k > kernels::kChainMaxKids) return false;
  if (&ctx.rules != &ExactRules()) return false;
  if (std::any_of(in.group_size.begin(), in.group_size.end(),
                  [](int64_t g) { return g > kernels::kChainGroupMax; })) {
    return false;
  }
  const at::Device dev = ctx.dev();
  return dev.is_cpu() || (dev.is_cuda() && FusedKernelsOn());
}

// Several host arrays joined into one, for one upload: Add appends an array and records which
// argument pointer points at it and where; Bind sets every recorded pointer from the joined
// array's base (host or device), so no offset is computed twice.
template <typename T>
class HostPack {
 public:
  void Add(const std::vector<T>& v, const T** at) {
    slots_.emplace_back(at, data_.size());
    data_.insert(data_.end(), v.begin(), v.end());
  }
  void Bind(const T* base) const {
    for (const auto& [at, offset] : slots_) *at = base + offset;
  }
  const std::vector<T>& data() const { return data_; }

 private:
  std::vector<T> data_;
  std::vector<std::pair<const T**, size_t>> slots_;
};

// The fused verification (kernels/chain_verify.h): one kernel over all nodes on CUDA, the same
// per-node arithmetic on the host on the CPU. One "launch" either way, as LaunchCount and
// profilers see it. It also draws every node's next drafts (Verdicts::fresh and, with trees,
// Verdicts::extra; Gumbel-coupled nodes' by their Gumbel keys), which DrawNextDrafts then
// takes, computes GSD nodes' cluster ratios, and writes the step's readback rows
// (Verdicts::packed).
Verdicts FusedChainVerify(const StepContext& ctx, const VerifyInputs& in) {
  RECORD_FUNCTION("imagegen::chain_verify", std::vector<c10::IValue>());
  const at::Device dev = ctx.dev();
  const int64_t A = ctx.nodes, K = ctx.max_kids, D = ctx.tree_k;
  at::Tensor p = ctx.p.contiguous(), q = ctx.q.contiguous();
  TORCH_CHECK(p.scalar_type() == at::kDouble && q.scalar_type() == at::kDouble,
              "fused verification: P and Q must be float64");
  at::Tensor tokens =
      ctx.node_tokens.defined() ? ctx.node_tokens.to(at::kLong).contiguous() : at::Tensor();
  const bool weighted = std::any_of(in.w.begin(), in.w.end(), [](double x) { return x != 1.0; });
  // GSD: every node's cluster size (0: the exact ratio), gap and distance bounds.
  const bool grouped = !in.grouped.empty();
  std::vector<int64_t> group;
  std::vector<double> gdelta, gdist;
  at::Tensor embed;
  if (grouped) {
    group.assign(A, 0);
    gdelta.assign(A, 0.0);
    gdist.assign(A, 0.0);
    for (size_t i = 0; i < in.grouped.size(); ++i) {
      group[in.grouped[i]] = in.group_size[i];
      gdelta[in.grouped[i]] = in.group_delta[i];
      gdist[in.grouped[i]] = in.group_dist[i];
    }
    embed = ctx.embeddings.contiguous();
    TORCH_CHECK(embed.scalar_type() == at::kDouble && embed.size(0) == ctx.cfg().vocab_size,
                "fused verification: GSD needs float64 embeddings [V, D]");
  }
  auto lopt = at::TensorOptions().dtype(at::kLong).device(dev);
  Verdicts v;
  v.accepted = at::empty({A, K}, lopt.dtype(at::kBool));
  v.residual = at::empty({A}, lopt);
  v.kept = at::empty({A}, lopt);
  v.fresh = at::empty({A}, lopt);
  v.extra = at::empty({A, D - 1}, lopt);
  kernels::ChainVerifyArgs a;
  a.p = p.data_ptr<double>();
  a.q = q.data_ptr<double>();
  a.tokens = tokens.defined() ? tokens.data_ptr<int64_t>() : nullptr;
  a.nodes = A;
  a.vocab = ctx.cfg().vocab_size;
  a.kids = K;
  a.draws = D;
  a.accepted = v.accepted.data_ptr<bool>();
  a.residual = v.residual.data_ptr<int64_t>();
  a.kept = v.kept.data_ptr<int64_t>();
  a.fresh = v.fresh.data_ptr<int64_t>();
  a.extra = D > 1 ? v.extra.data_ptr<int64_t>() : nullptr;
  a.packed_cols = K + D + 2 + (tokens.defined() ? 1 : 0);
  v.packed = at::empty({A, a.packed_cols}, lopt.dtype(at::kDouble));
  a.packed = v.packed.data_ptr<double>();
  if (grouped) {
    a.embed = embed.data_ptr<double>();
    a.embed_dim = embed.size(1);
  }
  // The per-node inputs, in two flat arrays whose pointers are bound where each is appended:
  // into the host arrays on the CPU, into their one upload each on CUDA.
  HostPack<int64_t> longs;
  HostPack<double> doubles;
  longs.Add(in.kid, &a.kid);
  longs.Add(in.qrow, &a.qrow);
  doubles.Add(in.uacc, &a.uacc);
  doubles.Add(in.ures, &a.ures);
  doubles.Add(in.ufresh, &a.ufresh);
  if (D > 1) longs.Add(in.maximal, &a.maximal);
  if (weighted) doubles.Add(in.w, &a.w);
  if (!in.gumbel.empty()) {
    longs.Add(in.gumbel, &a.gumbel);
    longs.Add(in.seed, &a.seed);
    longs.Add(in.position, &a.position);
  }
  if (!in.match.empty()) longs.Add(in.match, &a.match);
  if (grouped) {
    longs.Add(group, &a.group);
    doubles.Add(gdelta, &a.group_delta);
    doubles.Add(gdist, &a.group_dist);
  }
  if (dev.is_cpu()) {
    longs.Bind(longs.data().data());
    doubles.Bind(doubles.data().data());
    at::parallel_for(0, A, 1, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) kernels::ChainVerifyNodeOnHost(a, n);
    });
  } else {  // two uploads, then the kernel on the current stream
    at::Tensor l = UploadLongs(longs.data(), dev), d = UploadDoubles(doubles.data(), dev);
    longs.Bind(l.data_ptr<int64_t>());
    doubles.Bind(d.data_ptr<double>());
    const c10::DeviceGuard on(dev);  // a null (default) stream is the current device's
    const int err = LaunchChainVerifyKernel(a, CurrentCudaStream(dev));
    TORCH_CHECK(err == 0, "fused chain verification: CUDA launch failed (error ", err, ")");
  }
  return v;
}

// The match rule on the eager path, over the verdicts of the exact rule: for every match node
// g* (GumbelTopK's first, from the keys DrawNextDrafts' GumbelDraws uses), residual = kept =
// g*, and child k accepted iff it is g*. `kids` [A, K]: the children's tokens (-1: none).
void ApplyMatch(const StepContext& ctx, const VerifyInputs& in, const at::Tensor& kids,
                Verdicts& v) {
  const at::Device dev = ctx.dev();
  const int64_t V = ctx.cfg().vocab_size;
  std::vector<int64_t> nodes;
  std::vector<double> u;
  for (size_t a = 0; a < in.match.size(); ++a) {
    if (in.match[a] == 0) continue;
    nodes.push_back(static_cast<int64_t>(a));
    for (int64_t t = 0; t < V; ++t) {
      u.push_back(Uniform(static_cast<uint64_t>(in.seed[a]), static_cast<uint32_t>(in.position[a]),
                          0, Purpose::kGumbel, static_cast<uint32_t>(t)));
    }
  }
  const at::Tensor mi = UploadLongs(nodes, dev);
  const auto M = static_cast<int64_t>(nodes.size());
  const at::Tensor g =
      GumbelTopK(ctx.p.index_select(0, mi), UploadDoubles(u, dev).view({M, V}), 1).first;  // [M]
  const at::Tensor acc = kids.index_select(0, mi) == g.unsqueeze(1);  // -1 never matches
  v.accepted = v.accepted.index_copy(0, mi, acc);
  v.residual = v.residual.index_copy(0, mi, g);
  v.kept = v.kept.index_copy(0, mi, g);
}

}  // namespace

Verdicts VerifyWindows(const StepContext& ctx) {
  const at::Device dev = ctx.dev();
  const int64_t A = ctx.nodes, K = ctx.max_kids, V = ctx.cfg().vocab_size;
  const VerifyInputs in = BuildInputs(ctx);
  if (CanFuse(ctx, in)) return FusedChainVerify(ctx, in);
  Verdicts v;
  if (std::none_of(in.kid.begin(), in.kid.end(), [](int64_t k) { return k >= 0; })) {
    // No drafts in this step (AR requests, or every window held to one token at high load):
    // nothing to verify, each node commits a token drawn from P. The same draws the loop below
    // would make (it leaves P as it is), in 4 launches instead of about 45.
    v.accepted = at::zeros({A, K}, at::TensorOptions().dtype(at::kBool).device(dev));
    v.residual = SampleInverseCdf(ctx.p, UploadDoubles(in.ures, dev));
    v.kept = v.residual;
    if (!in.match.empty()) {
      ApplyMatch(ctx, in, at::full({A, K}, -1, v.residual.options()), v);
    }
    return v;
  }
  // Two uploads: [children | q rows] and [acceptance uniforms | COOL weights | residual uniforms].
  std::vector<int64_t> longs(in.kid);
  longs.insert(longs.end(), in.qrow.begin(), in.qrow.end());
  std::vector<double> doubles(in.uacc);
  doubles.insert(doubles.end(), in.w.begin(), in.w.end());
  doubles.insert(doubles.end(), in.ures.begin(), in.ures.end());
  at::Tensor l = UploadLongs(longs, dev), d = UploadDoubles(doubles, dev);
  at::Tensor kids = l.narrow(0, 0, A * K).view({A, K});
  if (ctx.node_tokens.defined()) {  // child node indices -> their tokens (-1: no child)
    kids = at::where(kids >= 0,
                     ctx.node_tokens.index_select(0, kids.reshape(-1).clamp_min(0)).view({A, K}),
                     kids);
  }
  at::Tensor ures = d.narrow(0, A * K + A, A);
  at::Tensor uacc = d.narrow(0, 0, A * K).view({A, K});
  // COOL-SD's weights; without a relaxed node all are 1, and leaving them out is the same
  // arithmetic (1 * x == x) in fewer launches, as are the skipped steps below.
  const bool weighted = std::any_of(in.w.begin(), in.w.end(), [](double x) { return x != 1.0; });
  at::Tensor w = weighted ? d.narrow(0, A * K, A) : at::Tensor();
  at::Tensor Qa = ctx.q.index_select(0, l.narrow(0, A * K, A));
  at::Tensor pk = ctx.p;  // never written in place
  at::Tensor removed;     // [A, V] bool; undefined while nothing is removed
  std::vector<at::Tensor> acc_cols;
  for (int64_t k = 0; k < K; ++k) {
    at::Tensor xk = kids.select(1, k);
    at::Tensor valid = xk >= 0;
    at::Tensor x = xk.clamp_min(0);
    at::Tensor qk = RemoveAndNormalise(Qa, removed);
    at::Tensor wk = k == 0 ? w : at::Tensor();  // COOL-SD weighs the first sibling only
    at::Tensor ratio = AcceptRatio(pk, qk, x, wk);
    if (k == 0 && !in.grouped.empty()) {
      const at::Tensor gi = UploadLongs(in.grouped, dev);
      ratio = ratio.index_copy(0, gi, GroupedRatio(ctx, in, gi, Qa, x));
    }
    acc_cols.push_back(valid & ctx.rules.Accept(uacc.select(1, k), ratio.clamp_max(1.0)));
    pk = at::where(valid.unsqueeze(1), ResidualDistribution(pk, qk, wk), pk);
    if (k + 1 < K) {  // the next sibling is verified without this one
      const at::Tensor drop = OneHot(x, V, at::kBool) & valid.unsqueeze(1);
      removed = removed.defined() ? removed | drop : drop;
    }
  }
  v.residual = SampleInverseCdf(pk, ures);  // final residual, or the bonus
  if (K == 1) {                             // chains
    v.accepted = acc_cols[0].unsqueeze(1);  // [A, 1]
    v.kept = at::where(acc_cols[0], kids.select(1, 0), v.residual);
  } else {
    v.accepted = at::stack(acc_cols, 1);  // [A, K]
    at::Tensor first = v.accepted.to(at::kByte).argmax(1, true);
    v.kept = at::where(v.accepted.any(1), kids.gather(1, first).squeeze(1), v.residual);
  }
  if (!in.match.empty()) ApplyMatch(ctx, in, kids, v);
  return v;
}

}  // namespace imagegen
