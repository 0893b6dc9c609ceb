#include "engine/decoding/verify.h"

#include <ATen/ATen.h>

namespace imagegen {

at::Tensor AcceptProbability(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts) {
  at::Tensor idx = drafts.to(at::kLong).unsqueeze(-1);
  at::Tensor px = p.gather(-1, idx).squeeze(-1).to(at::kDouble);
  at::Tensor qx = q.gather(-1, idx).squeeze(-1).to(at::kDouble);
  at::Tensor ratio = at::where(qx > 0, px / qx.clamp_min(1e-300), (px > 0).to(at::kDouble));
  return ratio.clamp_max(1.0);
}

at::Tensor ResidualDistribution(const at::Tensor& p, const at::Tensor& q) {
  at::Tensor r = (p.to(at::kDouble) - q.to(at::kDouble)).clamp_min(0);
  at::Tensor total = r.sum(-1, /*keepdim=*/true);
  return at::where(total > 0, r / total.clamp_min(1e-300), p.to(at::kDouble)).to(p.scalar_type());
}

}  // namespace imagegen
