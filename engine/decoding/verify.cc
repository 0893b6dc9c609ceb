#include "engine/decoding/verify.h"

#include <ATen/ATen.h>

namespace imagegen {

at::Tensor AcceptRatio(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts,
                       const at::Tensor& w) {
  at::Tensor idx = drafts.to(at::kLong).unsqueeze(-1);
  at::Tensor px = p.gather(-1, idx).squeeze(-1).to(at::kDouble);
  at::Tensor qx = q.gather(-1, idx).squeeze(-1).to(at::kDouble);
  at::Tensor num = w.defined() ? w * px : px;
  return at::where(qx > 0, num / qx.clamp_min(1e-300), (px > 0).to(at::kDouble));
}

at::Tensor GroupedAcceptRatio(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts,
                              const at::Tensor& group, int64_t max_group, const at::Tensor& delta,
                              const at::Tensor& dist, const at::Tensor& embeddings) {
  const int64_t V = p.size(1), G = max_group;
  at::Tensor x = drafts.to(at::kLong);
  // Ascending, ties by id (a stable sort; `sort(true, 1)` would pick the (dim, descending)
  // overload).
  at::Tensor order = std::get<1>(p.sort(std::optional<bool>(true), 1, /*descending=*/false));
  at::Tensor rank = order.argsort(int64_t{1}).gather(1, x.unsqueeze(1));  // [A, 1]
  at::Tensor offs =
      at::arange(-(G / 2), G - G / 2, at::TensorOptions().dtype(at::kLong).device(p.device()))
          .unsqueeze(0);
  at::Tensor gn = group.unsqueeze(1);
  at::Tensor rk = rank + offs;
  // Each row's own G: ranks r - G/2 .. r + G - G/2 - 1 (7 below, 6 above for G = 14).
  at::Tensor inside = (rk >= 0) & (rk < V) & (offs >= -at::floor_divide(gn, 2)) &
                      (offs < gn - at::floor_divide(gn, 2));
  at::Tensor ids = order.gather(1, rk.clamp(0, V - 1));
  at::Tensor pids = p.gather(1, ids), qids = q.gather(1, ids);
  at::Tensor px = p.gather(1, x.unsqueeze(1));
  at::Tensor ex = embeddings.index_select(0, x).unsqueeze(1);
  at::Tensor ej = embeddings.index_select(0, ids.reshape(-1)).view({ids.size(0), G, -1});
  at::Tensor d = (ej - ex).pow(2).sum(-1);
  at::Tensor keep = inside & ((pids - px).abs() < delta.unsqueeze(1)) & (d < dist.unsqueeze(1));
  at::Tensor num = (pids * keep).sum(1), den = (qids * keep).sum(1);
  return at::where(den > 0, num / den.clamp_min(1e-300), (num > 0).to(at::kDouble));
}

at::Tensor AcceptProbability(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts) {
  return AcceptRatio(p, q, drafts).clamp_max(1.0);
}

at::Tensor ResidualDistribution(const at::Tensor& p, const at::Tensor& q, const at::Tensor& w) {
  at::Tensor pd = p.to(at::kDouble), qd = q.to(at::kDouble);
  at::Tensor cap = w.defined() ? at::minimum(qd, w.unsqueeze(-1) * pd) : at::minimum(qd, pd);
  at::Tensor r = (pd - cap).clamp_min(0);
  at::Tensor total = r.sum(-1, /*keepdim=*/true);
  return at::where(total > 0, r / total.clamp_min(1e-300), pd).to(p.scalar_type());
}

at::Tensor RemoveAndNormalise(const at::Tensor& probs, const at::Tensor& removed) {
  at::Tensor r = removed.defined() ? probs.masked_fill(removed, 0.0) : probs;
  at::Tensor tot = r.sum(-1, true);
  return at::where(tot > 0, r / tot.clamp_min(1e-300), at::Scalar(0.0));
}

at::Tensor VerifyRules::Accept(const at::Tensor& u, const at::Tensor& prob) const {
  return u < prob;
}

const VerifyRules& ExactRules() {
  static const VerifyRules rules;
  return rules;
}

}  // namespace imagegen
