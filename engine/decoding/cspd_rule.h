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

}  // namespace imagegen
