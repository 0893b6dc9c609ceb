// DrawNextDrafts: what each node's output proposes for the next step's window, drawn from P:
// a fresh draw (independent coupling), K - 1 more candidates without replacement for trees,
// and for Gumbel coupling argmax(log P + g) (top-K for trees) with g keyed by (seed, absolute
// position, token) only, which is what couples the iterations.
#include <ATen/ATen.h>

#include "engine/decoding/philox.h"
#include "engine/decoding/sampling.h"
#include "engine/decoding/step_phases.h"
#include "engine/model/transfer.h"

namespace imagegen {
namespace {

struct DrawInputs {
  std::vector<double> ufresh;  // [A, K]: uniforms of the fresh draws
  std::vector<int64_t> maximal, gumbel_nodes;
  std::vector<double> gumbel_u;  // [Ag, V]
};

DrawInputs BuildDrawInputs(const StepContext& ctx) {
  const int64_t K = ctx.tree_k, V = ctx.cfg().vocab_size;
  DrawInputs in;
  in.ufresh.assign(ctx.nodes * K, 0.0);
  in.maximal.assign(ctx.nodes, 0);
  for (const Sequence* s : ctx.live) {
    const Coupling coupling = s->r.policy.coupling;
    for (size_t i = 0; i < s->nodes.size(); ++i) {
      const int64_t a = s->node_off + static_cast<int64_t>(i);
      const auto t = static_cast<uint32_t>(s->n() + s->nodes[i].col + 1);
      in.maximal[a] = coupling == Coupling::kMaximal ? 1 : 0;
      if (coupling == Coupling::kGumbel) {
        in.gumbel_nodes.push_back(a);
        const uint32_t g = ctx.rules.GumbelPosition(t);
        for (int64_t v = 0; v < V; ++v) {
          in.gumbel_u.push_back(
              Uniform(s->r.seed, g, 0, Purpose::kGumbel, static_cast<uint32_t>(v)));
        }
      } else {
        for (int64_t k = 0; k < K; ++k) {
          in.ufresh[a * K + k] =
              Uniform(s->r.seed, t, s->iter, Purpose::kDraft, static_cast<uint32_t>(k));
        }
      }
    }
  }
  return in;
}

// Gumbel top-K of the Gumbel-coupled nodes, written into their rows of d.
void GumbelDraws(const StepContext& ctx, const DrawInputs& in, NextDrafts& d) {
  const int64_t K = ctx.tree_k, V = ctx.cfg().vocab_size;
  at::Tensor gi = UploadLongs(in.gumbel_nodes, ctx.dev());
  const auto Ag = static_cast<int64_t>(in.gumbel_nodes.size());
  at::Tensor gu = UploadDoubles(in.gumbel_u, ctx.dev()).view({Ag, V});
  auto [first, rest] = GumbelTopK(ctx.p.index_select(0, gi), gu, K);
  d.fresh = d.fresh.index_copy(0, gi, first);
  if (K > 1) d.extra = d.extra.index_copy(0, gi, rest);
}

}  // namespace

NextDrafts DrawNextDrafts(const StepContext& ctx, const Verdicts& v) {
  const int64_t A = ctx.nodes, K = ctx.tree_k, V = ctx.cfg().vocab_size;
  const at::Tensor& kept = v.kept;
  NextDrafts d;
  if (v.fresh.defined()) {  // drawn by the fused verification, with the same uniforms and keys
    d.fresh = v.fresh;
    d.extra = v.extra;
    return d;
  }
  const DrawInputs in = BuildDrawInputs(ctx);
  at::Tensor uf = UploadDoubles(in.ufresh, ctx.dev()).view({A, K});
  d.fresh = SampleInverseCdf(ctx.p, uf.select(1, 0));
  d.extra = at::full({A, K - 1}, -1, d.fresh.options());
  if (K > 1) {
    // Tree candidates exclude the column's first candidate: the kept token under maximal
    // coupling, else the fresh draw.
    at::Tensor maximal = UploadLongs(in.maximal, ctx.dev()) > 0;
    at::Tensor mask = OneHot(at::where(maximal, kept, d.fresh), V, at::kBool);
    for (int64_t k = 1; k < K; ++k) {
      at::Tensor pm = RemoveAndNormalise(ctx.p, mask);
      at::Tensor ok = pm.sum(1) > 0;
      at::Tensor e = at::where(ok, SampleInverseCdf(pm, uf.select(1, k)), at::full_like(kept, -1));
      d.extra.select(1, k - 1).copy_(e);
      mask = mask | (OneHot(e.clamp_min(0), V, at::kBool) & ok.unsqueeze(1));
    }
  }
  if (!in.gumbel_nodes.empty()) GumbelDraws(ctx, in, d);
  return d;
}

}  // namespace imagegen
