// The exact (lossless) acceptance rule of speculative sampling, vectorised over rows and window
// positions: a draft x drawn from q is kept with probability min(1, p(x) / q(x)); on rejection
// the replacement is drawn from the residual norm(max(p - q, 0)). Kept-or-replaced tokens are
// then distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023; seed 001 Alg. 1).
// Everything stays on the tensors' device. Thread-safe (pure functions).
#pragma once

#include <ATen/Tensor.h>

namespace imagegen {

// p, q [..., V] probabilities; drafts [...] ids -> min(1, p(x) / q(x)) as float64 [...].
// q(x) = 0 (a draft q could not have produced) gives 0 unless p(x) > 0 too, in which case 1.
at::Tensor AcceptProbability(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts);

// norm(max(p - q, 0)) over the last dimension. Where p == q the residual is empty; a rejection
// is then impossible, and p itself is returned so the result is always a distribution.
at::Tensor ResidualDistribution(const at::Tensor& p, const at::Tensor& q);

}  // namespace imagegen
