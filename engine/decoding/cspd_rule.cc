#include "engine/decoding/cspd_rule.h"

#include <ATen/ATen.h>

namespace imagegen {
namespace {

// log N(x; mean, (std * t)^2 I) up to the constant -C/2 log(2 pi), which cancels in every ratio
// below; the normaliser keeps the untempered std, as the authors' code does. x may carry extra
// leading dimensions ([N, R, C] against heads [N, 1, C]).
at::Tensor LogDensity(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& std,
                      double t) {
  const at::Tensor z = (x - mean) / (std * t);
  return -0.5 * (z * z).sum(-1) - at::log(std).sum(-1);
}

// The same density as a plain fp32 product over dimensions (the authors' form).
at::Tensor PlainDensity(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& std,
                        double t) {
  const at::Tensor z = (x - mean) / (std * t);
  return (at::exp(-0.5 * z * z) / std).prod(-1);
}

// log Sigma: Eq. 8 (sigma_q over sigma_p), or its inverse as the authors' code computes it.
at::Tensor LogSigma(const CspdHeads& q, const CspdHeads& p, const CspdRuleOptions& opts) {
  const at::Tensor s = q.acc_logstd.to(at::kFloat) - p.acc_logstd.to(at::kFloat);
  return opts.invert_sigma ? -s : s;
}

}  // namespace

at::Tensor CspdLogRatio(const at::Tensor& x, const CspdHeads& q, const CspdHeads& p,
                        const CspdRuleOptions& opts) {
  const double t = opts.inner_temperature;
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor log_sigma = LogSigma(q, p, opts);
  if (opts.log_space) {
    return LogDensity(xf, p.mean, p.std, t) - LogDensity(xf, q.mean, q.std, t) + log_sigma;
  }
  return at::log(PlainDensity(xf, p.mean, p.std, t) * at::exp(log_sigma) /
                 PlainDensity(xf, q.mean, q.std, t));
}

CspdVerdict CspdVerify(const at::Tensor& x, const CspdHeads& q, const CspdHeads& p,
                       const CspdNoise& noise, const CspdRuleOptions& opts) {
  CspdVerdict v;
  const at::Tensor xf = x.to(at::kFloat);
  // u < min(1, r) is u < r for u in [0, 1); log(u) = -inf for u = 0 accepts, as it should.
  v.accepted = at::log(noise.accept_u.to(at::kFloat)) < CspdLogRatio(xf, q, p, opts);

  // Residual: proposals y ~ N(mean_p, std_p), kept with probability
  // max(0, Sigma p(y) - q(y)) / (Sigma p(y)) = max(0, 1 - q(y) / (Sigma p(y))). The threshold
  // uses the untempered densities (Corollary 1; the authors' code drops the 42 here too).
  const at::Tensor mp = p.mean.unsqueeze(1), sp = p.std.unsqueeze(1);
  const at::Tensor mq = q.mean.unsqueeze(1), sq = q.std.unsqueeze(1);
  const at::Tensor y = mp + sp * noise.proposal.to(at::kFloat);  // [N, R, C]
  const at::Tensor log_sigma = LogSigma(q, p, opts).unsqueeze(1);
  at::Tensor keep_prob;
  if (opts.log_space) {
    const at::Tensor log_q_over_sp =
        LogDensity(y, mq, sq, 1.0) - LogDensity(y, mp, sp, 1.0) - log_sigma;
    // 1 - exp(a) for a < 0, accurately; a >= 0 gives 0.
    keep_prob = at::clamp_min(-at::expm1(at::clamp_max(log_q_over_sp, 0.0)), 0.0);
  } else {
    const at::Tensor sigma_p = at::exp(log_sigma) * PlainDensity(y, mp, sp, 1.0);
    keep_prob = at::clamp_min(sigma_p - PlainDensity(y, mq, sq, 1.0), 0.0) / sigma_p;
  }
  const at::Tensor kept = noise.proposal_u.to(at::kFloat) < keep_prob;  // [N, R]
  const at::Tensor any_kept = kept.any(1);
  // The first kept proposal (argmax of a bool row returns its first true).
  const at::Tensor first = kept.to(at::kByte).argmax(1);
  const int64_t n = y.size(0), c = y.size(2);
  const at::Tensor chosen =
      y.gather(1, first.view({n, 1, 1}).expand({n, 1, c})).squeeze(1);  // [N, C]
  at::Tensor fallback =
      opts.fallback == CspdFallback::kZero ? at::zeros_like(chosen) : y.select(1, 0);
  const at::Tensor residual = at::where(any_kept.unsqueeze(1), chosen, fallback);
  v.tokens = at::where(v.accepted.unsqueeze(1), xf, residual);
  const int64_t rounds_max = y.size(1);
  v.rounds = at::where(v.accepted, at::zeros_like(first),
                       at::where(any_kept, first + 1, at::full_like(first, rounds_max)));
  v.fell_back = at::logical_and(at::logical_not(v.accepted), at::logical_not(any_kept));
  return v;
}

}  // namespace imagegen
