// The acceptance rule of speculative sampling, vectorised over rows and window positions, and
// the one the engine runs: a draft x drawn from q is kept with probability
// min(1, w p(x) / q(x)); on rejection the replacement is drawn from the residual
// norm([p - min(q, w p)]_+). With w = 1 (the exact rule) kept-or-replaced tokens are
// distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023; seed 001 Alg. 1);
// w != 1 is COOL-SD's relaxed rule (seed 003). Everything stays on the tensors' device.
// Thread-safe (pure functions; VerifyRules implementations must be too).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

namespace imagegen {

// p, q [..., V] probabilities; drafts [...] ids -> w p(x) / q(x) as float64 [...], not
// clipped. q(x) = 0 (a draft q could not have produced) gives 0 unless p(x) > 0 too, in which
// case 1. `w` [...] (float64) may be undefined: w = 1.
at::Tensor AcceptRatio(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts,
                       const at::Tensor& w = at::Tensor());

// GSD's ratio (seed 004 Alg. 3): for rows p, q [A, V] and drafts x [A], the cluster of ids
// around x in p's ascending order (ties by id: a stable sort), at ranks r(x) - G/2 ..
// r(x) + G - G/2 - 1 with G = group[a] (int64 [A], each in [1, max_group], max_group <= V: the
// bound the host knows, so that no readback is needed), kept where
// |p(j) - p(x)| < delta[a] and |e_j - e_x|^2 < dist[a] (float64 [A]; `embeddings` float64
// [V, D]), and its masses' ratio p(C) / q(C) as float64 [A] (q(C) = 0: 1 if p(C) > 0, else 0),
// not clipped. q is the proposal row as drawn from, not renormalised. kernels/chain_verify.h
// computes the same in the fused verification.
at::Tensor GroupedAcceptRatio(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts,
                              const at::Tensor& group, int64_t max_group, const at::Tensor& delta,
                              const at::Tensor& dist, const at::Tensor& embeddings);

// min(1, p(x) / q(x)): the exact rule's acceptance probability.
at::Tensor AcceptProbability(const at::Tensor& p, const at::Tensor& q, const at::Tensor& drafts);

// norm([p - min(q, w p)]_+) over the last dimension (w undefined: norm(max(p - q, 0))). Where
// it is empty a rejection is impossible, and p itself is returned so the result is always a
// distribution.
at::Tensor ResidualDistribution(const at::Tensor& p, const at::Tensor& q,
                                const at::Tensor& w = at::Tensor());

// Rows of `probs` with the ids in `removed` ([R, V] bool) taken out and renormalised; rows with
// no mass left are all zero. Siblings of a tree node are drawn without replacement: the k-th
// is verified against q with the first k - 1 removed. `removed` undefined: none removed.
at::Tensor RemoveAndNormalise(const at::Tensor& probs, const at::Tensor& removed);

// The two decisions on which losslessness rests, as the engine makes them. Tests of the
// exact-distribution harness inject broken ones to show that it detects them.
class VerifyRules {
 public:
  virtual ~VerifyRules() = default;
  // Accept bits from uniforms u and acceptance probabilities (same shape): u < prob.
  virtual at::Tensor Accept(const at::Tensor& u, const at::Tensor& prob) const;
  // Under maximal coupling an accepted draft after the first rejection stays the next step's
  // draft. true: its q is the P row it was verified at, the distribution it now follows
  // (lossless). false would keep the q it was drawn from (the Lumina/Janus SCD-MC code,
  // algorithms.md 3a: not lossless).
  virtual bool KeptDraftFollowsP() const { return true; }
  // The position whose Gumbel noise a node predicting position t draws with (Gumbel coupling,
  // the match rule): t itself. Noise shared by positions (a key without the position) would
  // make each token's draw depend on the tokens before it, which the match rule's exactness
  // rests on not happening.
  virtual uint32_t GumbelPosition(uint32_t t) const { return t; }
};

// The exact rules; shared, immutable.
const VerifyRules& ExactRules();

}  // namespace imagegen
