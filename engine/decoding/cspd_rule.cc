#include "engine/decoding/cspd_rule.h"

#include <ATen/ATen.h>

#include <algorithm>

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

namespace {

// One chunk of residual proposals for N tokens: the first kept one per token, if any.
struct ResidualDraws {
  at::Tensor any_kept;  // [N] bool
  at::Tensor first;     // [N] int64, the index of the first kept proposal (0 if none)
  at::Tensor chosen;    // [N, C] that proposal
  at::Tensor y;         // [N, R, C] every proposal
};

ResidualDraws Residual(const CspdHeads& q, const CspdHeads& p, const at::Tensor& proposal,
                       const at::Tensor& proposal_u, const CspdRuleOptions& opts) {
  // Proposals y ~ N(mean_p, std_p), kept with probability
  // max(0, Sigma p(y) - q(y)) / (Sigma p(y)) = max(0, 1 - q(y) / (Sigma p(y))). The threshold
  // uses the untempered densities (Corollary 1; the authors' code drops the 42 here too).
  const at::Tensor mp = p.mean.unsqueeze(1), sp = p.std.unsqueeze(1);
  const at::Tensor mq = q.mean.unsqueeze(1), sq = q.std.unsqueeze(1);
  ResidualDraws d;
  d.y = mp + sp * proposal.to(mp.device(), at::kFloat);  // [N, R, C]
  const at::Tensor log_sigma = LogSigma(q, p, opts).unsqueeze(1);
  at::Tensor keep_prob;
  if (opts.log_space) {
    const at::Tensor log_q_over_sp =
        LogDensity(d.y, mq, sq, 1.0) - LogDensity(d.y, mp, sp, 1.0) - log_sigma;
    // 1 - exp(a) for a < 0, accurately; a >= 0 gives 0.
    keep_prob = at::clamp_min(-at::expm1(at::clamp_max(log_q_over_sp, 0.0)), 0.0);
  } else {
    const at::Tensor sigma_p = at::exp(log_sigma) * PlainDensity(d.y, mp, sp, 1.0);
    keep_prob = at::clamp_min(sigma_p - PlainDensity(d.y, mq, sq, 1.0), 0.0) / sigma_p;
  }
  const at::Tensor kept = proposal_u.to(mp.device(), at::kFloat) < keep_prob;  // [N, R]
  d.any_kept = kept.any(1);
  // The first kept proposal (argmax of a bool row returns its first true).
  d.first = kept.to(at::kByte).argmax(1);
  const int64_t n = d.y.size(0), c = d.y.size(2);
  d.chosen = d.y.gather(1, d.first.view({n, 1, 1}).expand({n, 1, c})).squeeze(1);  // [N, C]
  return d;
}

CspdHeads Rows(const CspdHeads& h, const at::Tensor& rows) {
  return {h.mean.index_select(0, rows), h.std.index_select(0, rows),
          h.acc_logstd.index_select(0, rows)};
}

}  // namespace

CspdVerdict CspdVerify(const at::Tensor& x, const CspdHeads& q, const CspdHeads& p,
                       const CspdNoise& noise, const CspdRuleOptions& opts) {
  CspdVerdict v;
  const at::Tensor xf = x.to(at::kFloat);
  // u < min(1, r) is u < r for u in [0, 1); log(u) = -inf for u = 0 accepts, as it should.
  v.accepted = at::log(noise.accept_u.to(at::kFloat)) < CspdLogRatio(xf, q, p, opts);
  const ResidualDraws d = Residual(q, p, noise.proposal, noise.proposal_u, opts);
  at::Tensor fallback =
      opts.fallback == CspdFallback::kZero ? at::zeros_like(d.chosen) : d.y.select(1, 0);
  const at::Tensor residual = at::where(d.any_kept.unsqueeze(1), d.chosen, fallback);
  v.tokens = at::where(v.accepted.unsqueeze(1), xf, residual);
  const int64_t rounds_max = d.y.size(1);
  v.rounds = at::where(v.accepted, at::zeros_like(d.first),
                       at::where(d.any_kept, d.first + 1, at::full_like(d.first, rounds_max)));
  v.fell_back = at::logical_and(at::logical_not(v.accepted), at::logical_not(d.any_kept));
  return v;
}

void CspdContinueResidual(const CspdHeads& q, const CspdHeads& p, const CspdRuleOptions& opts,
                          const std::vector<int64_t>& rows, int64_t max_rounds,
                          const CspdMoreNoise& more, CspdVerdict* v) {
  if (opts.fallback != CspdFallback::kTargetSample) return;  // the authors' bound stays
  if (rows.empty()) return;                                  // every draft accepted: no readback
  const at::Tensor fell = v->fell_back.to(at::kCPU);
  const at::Tensor rounds = v->rounds.to(at::kCPU);
  std::vector<int64_t> open;  // rows still without a kept proposal
  int64_t done = 0;           // rounds drawn for each of them (the first chunk's)
  for (int64_t r : rows) {
    if (!fell[r].item<bool>()) continue;
    open.push_back(r);
    done = rounds[r].item<int64_t>();
  }
  for (int64_t chunk = 1; !open.empty() && done < max_rounds; ++chunk) {
    const CspdNoise nz = more(chunk, open);
    const int64_t r = std::min(nz.proposal.size(1), max_rounds - done);
    const at::Tensor ids = at::tensor(open, at::kLong).to(p.mean.device());
    const ResidualDraws d = Residual(Rows(q, ids), Rows(p, ids), nz.proposal.narrow(1, 0, r),
                                     nz.proposal_u.narrow(1, 0, r), opts);
    const at::Tensor kept = d.any_kept.to(at::kCPU), first = d.first.to(at::kCPU);
    std::vector<int64_t> still;
    for (size_t m = 0; m < open.size(); ++m) {
      const int64_t row = open[m];
      if (kept[static_cast<int64_t>(m)].item<bool>()) {
        v->tokens[row].copy_(d.chosen[static_cast<int64_t>(m)]);
        v->rounds[row].fill_(done + first[static_cast<int64_t>(m)].item<int64_t>() + 1);
        v->fell_back[row].fill_(false);
      } else {
        v->rounds[row].fill_(done + r);
        still.push_back(row);
      }
    }
    open = std::move(still);
    done += r;
  }
}

}  // namespace imagegen
