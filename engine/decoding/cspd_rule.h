// The verification rule of continuous speculative decoding (CSpD, seed 000): accept a draft
// token x with probability min(1, Sigma * p(x) / q(x)) (Eq. 9, Sigma of Eq. 8), and replace a
// rejected one by acceptance-rejection sampling from the modified distribution
// max(0, Sigma * p - q) with the threshold of Corollary 1 (Eq. 13), proposals drawn from p.
// p and q are the target's and the draft's final reverse-diffusion Gaussians (diagonal);
// Sigma = prod over the earlier steps of sigma_q / sigma_p. With a single denoising step
// Sigma = 1 and this is exact speculative sampling between two Gaussians.
//
// Batched over tokens, on the inputs' device, in log space, with no host readback. The
// authors' code departs from the paper in four ways (shared/docs/algorithms.md 6); each is an
// option, off by default, so that its effect can be measured. Thread-safe (pure functions).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace imagegen {

// One model's Gaussians for N tokens of C latent dimensions.
struct CspdHeads {
  at::Tensor mean;        // [N, C] the final reverse step's mean
  at::Tensor std;         // [N, C] its standard deviation (temperature included)
  at::Tensor acc_logstd;  // [N] sum over the earlier steps (t >= 1) and dims of log std
};

// What a token becomes when no residual proposal was accepted within the bound.
enum class CspdFallback {
  kTargetSample,  // the first proposal, a sample of the target's own Gaussian (default)
  kZero,          // an all-zero latent (the authors' code)
};

struct CspdRuleOptions {
  double inner_temperature = 1.0;  // authors: 42, dividing (x - mu) / sigma in the test only
  bool invert_sigma = false;       // authors: prod sigma_p / sigma_q instead of Eq. 8
  CspdFallback fallback = CspdFallback::kTargetSample;
  bool log_space = true;  // false: the authors' plain fp32 products (over/underflow possible)
};

// Random inputs, drawn by the caller (keyed per token, so that results do not depend on the
// batch). The residual bound is proposal.size(1).
struct CspdNoise {
  at::Tensor accept_u;    // [N] uniforms for the acceptance test
  at::Tensor proposal;    // [N, R, C] standard normals: proposals mean_p + std_p * z
  at::Tensor proposal_u;  // [N, R] uniforms for the residual threshold
};

struct CspdVerdict {
  at::Tensor accepted;   // [N] bool
  at::Tensor tokens;     // [N, C] the draft where accepted, else the residual sample
  at::Tensor rounds;     // [N] int64 residual proposals used (0 where accepted)
  at::Tensor fell_back;  // [N] bool: the bound was hit and the fallback used
};

// log(Sigma * p(x) / q(x)) per token, [N] float32 (the acceptance test is u < exp of it).
at::Tensor CspdLogRatio(const at::Tensor& x, const CspdHeads& q, const CspdHeads& p,
                        const CspdRuleOptions& opts);

CspdVerdict CspdVerify(const at::Tensor& x, const CspdHeads& q, const CspdHeads& p,
                       const CspdNoise& noise, const CspdRuleOptions& opts);

// The residual draws' bound: CspdVerify draws one chunk of proposals per token, and a token
// none of whose proposals was kept (its residual's acceptance rate z is small) goes on with
// further chunks, up to this many proposals in all. The error of the fallback at the bound is
// at most max over z of z (1 - z)^N < 1 / (e N) per verified token: 5.6e-6 (it was 0.0014 with
// 256 proposals and no more). The expected work is at most one proposal per verified token
// however small z is: a token reaches the residual with probability z and then needs 1 / z.
constexpr int64_t kCspdMaxResidualRounds = 65536;

// Chunk `chunk` (>= 1) of residual noise for the token rows `rows`: [rows, R, C] proposals and
// [rows, R] uniforms, R the first chunk's size; the caller's draws keyed by round, so that
// chunk k holds rounds [k R, (k + 1) R) of the same streams as the first.
using CspdMoreNoise = std::function<CspdNoise(int64_t chunk, const std::vector<int64_t>& rows)>;

// Continues the residual sampling of those of `rows` that fell back in `v` (CspdVerify's
// verdict; its tokens, rounds and fell_back are updated) with further chunks from `more`, until
// a proposal is kept or `max_rounds` rounds were drawn in all. With the draws keyed by round
// the result equals one CspdVerify given all the rounds at once. Only with the target-sample
// fallback: the authors' zero fallback keeps their bound (residual_rounds).
void CspdContinueResidual(const CspdHeads& q, const CspdHeads& p, const CspdRuleOptions& opts,
                          const std::vector<int64_t>& rows, int64_t max_rounds,
                          const CspdMoreNoise& more, CspdVerdict* v);

}  // namespace imagegen
