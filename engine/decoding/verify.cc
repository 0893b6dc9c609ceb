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
