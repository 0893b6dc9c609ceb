#include "engine/decoding/sampling.h"

#include <ATen/ATen.h>

#include "engine/model/transfer.h"

#include <cmath>
#include <limits>

namespace imagegen {

Status ValidateSampling(const SamplingParams& p, int64_t vocab_size) {
  if (!std::isfinite(p.cfg_scale) || p.cfg_scale < 0 || p.cfg_scale > 100) {
    return FieldError("cfg_scale", "must be a finite number in [0, 100]");
  }
  if (!std::isfinite(p.temperature) || p.temperature < 0 || p.temperature > 100) {
    return FieldError("temperature", "must be a finite number in [0, 100]");
  }
  if (p.top_k < 0 || p.top_k > vocab_size) {
    return FieldError("top_k", "must be in [0, " + std::to_string(vocab_size) + "]");
  }
  if (!std::isfinite(p.top_p) || p.top_p <= 0 || p.top_p > 1) {
    return FieldError("top_p", "must be in (0, 1]");
  }
  if (p.cfg_interval < -1) return FieldError("cfg_interval", "must be >= -1 (-1: always guide)");
  return OkStatus();
}

at::Tensor CfgCombine(const at::Tensor& cond, const at::Tensor& uncond, const at::Tensor& scale) {
  return uncond + (cond - uncond) * scale.to(cond.scalar_type()).unsqueeze(1);
}

at::Tensor FinalProbs(const at::Tensor& logits_in, const std::vector<SamplingParams>& params) {
  const int64_t R = logits_in.size(0), V = logits_in.size(1);
  // One upload: rows temperature, k - 1 (exact in float: k <= vocab < 2^24) and top-p.
  std::vector<float> host(3 * R);
  bool any_k = false, any_p = false;
  for (int64_t r = 0; r < R; ++r) {
    host[r] = static_cast<float>(std::max(params[r].temperature, 1e-5));
    const int64_t k = params[r].top_k > 0 ? std::min(params[r].top_k, V) : V;
    host[R + r] = static_cast<float>(k - 1);
    any_k |= k < V;
    host[2 * R + r] = params[r].top_p < 1.0 ? static_cast<float>(params[r].top_p)
                                            : std::numeric_limits<float>::infinity();
    any_p |= params[r].top_p < 1.0;
  }
  at::Tensor knobs = UploadFloats(host, logits_in.device()).view({3, R, 1});
  at::Tensor logits = logits_in.to(at::kFloat) / knobs[0];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (any_k || any_p) {
    auto [sorted, order] = logits.sort(-1, /*descending=*/true);
    if (any_k) {
      at::Tensor kk = knobs[1].to(at::kLong);
      at::Tensor kth = sorted.gather(1, kk);  // the k-th largest; ties with it are kept
      logits = logits.masked_fill(logits < kth, neg_inf);
      sorted = sorted.masked_fill(sorted < kth, neg_inf);
    }
    if (any_p) {
      at::Tensor cum = at::softmax(sorted, -1).cumsum(-1);
      at::Tensor remove = cum > knobs[2];
      // Shift right so the token that crosses the threshold stays, and the top token always.
      remove = at::cat({at::zeros({R, 1}, remove.options()), remove.narrow(1, 0, V - 1)}, 1);
      at::Tensor remove_orig = at::zeros_like(remove).scatter(1, order, remove);
      logits = logits.masked_fill(remove_orig, neg_inf);
    }
  }
  return at::softmax(logits, -1);
}

at::Tensor OneHot(const at::Tensor& ids, int64_t classes, at::ScalarType dtype) {
  return at::zeros({ids.size(0), classes}, ids.options().dtype(dtype))
      .scatter_(1, ids.to(at::kLong).unsqueeze(1), 1);
}

std::pair<at::Tensor, at::Tensor> GumbelTopK(const at::Tensor& p, const at::Tensor& u, int64_t k) {
  at::Tensor keys = p / -u.clamp(1e-300, 1.0 - 1e-16).log();
  auto [vals, top] = keys.topk(k, 1);
  if (k == 1) return {top.select(1, 0), at::Tensor()};
  at::Tensor rest = top.narrow(1, 1, k - 1);
  rest = at::where(vals.narrow(1, 1, k - 1) > 0, rest, at::full_like(rest, -1));
  return {top.select(1, 0), rest};
}

at::Tensor SampleInverseCdf(const at::Tensor& probs, const at::Tensor& uniforms) {
  at::Tensor cum = probs.to(at::kDouble).cumsum(-1);
  at::Tensor target = uniforms.to(at::kDouble).unsqueeze(1) * cum.narrow(1, cum.size(1) - 1, 1);
  at::Tensor idx = at::searchsorted(cum, target, /*out_int32=*/false, /*right=*/true);
  return idx.squeeze(1).clamp_max(probs.size(1) - 1);
}

}  // namespace imagegen
