// Speculative decoding of many requests at once, each with its own policy (policy.h), seed and
// progress: every step packs all active requests' windows (root, proactive tree, chain) into
// one ragged target forward, then verifies all of them with batched tensor operations on the
// model's device, and reads back one small tensor of token ids and accept bits per step. The
// host then walks each request's window (a few integer comparisons per node) to commit tokens,
// choose the next drafts and compact the KV cache. Draft-model requests draft first, with
// batched draft forwards fed by device-sampled tokens (no host round trip per draft).
//
// The verification of a window is one rule applied at every node a whose children are drafts
// for the next column (siblings c_1..c_K drawn without replacement from the column's q, K = 1
// on chains): with p^(1) = P_a, sibling k is accepted with probability
// min(1, w p^(k)(c_k) / q^(k)(c_k)), where q^(k) is q with c_1..c_{k-1} removed and
// renormalised, and p^(k+1) = norm([p^(k) - min(q^(k), w p^(k))]_+). w = 1 is the exact rule
// (seed 002 App. A.3; with K = 1 it is SJD's min(1, p/q)); w != 1 is COOL-SD; GSD replaces the
// ratio by cluster masses. The first node with no accepted child commits a token from its
// final residual (or, at a leaf, the bonus from P_a) and ends acceptance. What follows it
// becomes the next window's drafts, with q = the P row they were drawn from:
//   independent: fresh draws from the stale P rows along the first-candidate path;
//   maximal:     the walk continues, every later node keeping its accepted child or drawing
//                its residual (SCD-MC = SJD-PAC adaptive continuation), following the kept
//                child (or the first candidate after a resample);
//   gumbel:      argmax(log P + g), g keyed by (seed, absolute position, token) only.
// With a tree the first tree_depth - 1 of these columns also get K - 1 extra candidates drawn
// without replacement from the same P (Gumbel top-K under gumbel coupling).
//
// Not thread-safe: one SpecBatch belongs to one thread (the engine's step loop).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/decoding/ar_generator.h"
#include "engine/decoding/policy.h"
#include "engine/model/gpt.h"
#include "engine/util/status.h"

namespace imagegen {

struct SpecRequest {
  ImageRequest image;
  DecodingPolicy policy;
};

struct SpecStats {
  int64_t nfe = 0;             // target forwards (a CFG pair once, the first forward included)
  int64_t draft_forwards = 0;  // draft-model forwards (counted apart from NFE)
  int64_t drafts_verified = 0;  // drafts tested before the first rejection of each step
  int64_t drafts_accepted = 0;
  std::vector<int32_t> step_tokens;  // tokens committed by each step
  std::vector<int32_t> token_step;   // per image token, the step that committed it
  // Per draft depth d (index d - 1: the d-th draft of a step's accepted path), drafts tested
  // there before the step's first rejection (tree siblings each count) and drafts accepted.
  std::vector<int64_t> verified_at_depth, accepted_at_depth;
  double entropy_sum = 0;            // entropy (nats) of p at each committed token,
  int64_t entropy_count = 0;         // when SpecOptions::collect_entropy

  double acceptance_rate() const {
    return drafts_verified > 0 ? static_cast<double>(drafts_accepted) / drafts_verified : 0.0;
  }
};

struct SpecResult {
  std::vector<int32_t> tokens;
  SpecStats stats;
};

struct SpecOptions {
  bool collect_entropy = false;
  // Batch-invariant forwards (ForwardOptions): a request's tokens do not depend on the other
  // requests in the batch. Costs one attention call per request; the serving engine turns it
  // on, offline sampling of thousands of rows at once leaves it off.
  bool batch_invariant = false;
  // Test hooks for the power of the exact-distribution tests (both break losslessness):
  bool broken_accept_always = false;   // every draft accepted
  bool broken_mc_keeps_old_q = false;  // maximal coupling stores the old q for kept drafts
                                       // (the Lumina/Janus SCD-MC code, algorithms.md 3a)
};

// Checks a request against the models: sampling, class, policy; errors name the field.
// Thread-safe (reads only the models' configs).
Status ValidateSpecRequest(const SpecRequest& r, const Gpt& target, const Gpt* draft);

// One batch of in-flight requests over fixed KV slots. Requests are added while slots last.
class SpecBatch {
 public:
  // `slots` KV rows are allocated on the target (and the draft model if given); a request
  // takes one, two with CFG.
  SpecBatch(const Gpt& target, const Gpt* draft, int64_t slots, SpecOptions opts = {});
  ~SpecBatch();
  SpecBatch(const SpecBatch&) = delete;
  SpecBatch& operator=(const SpecBatch&) = delete;

  // Validates the request against the models (fields named in the message) and admits it.
  // ResourceExhausted when no slot is free. Returns a handle.
  StatusOr<int64_t> Add(const SpecRequest& request);
  Status ValidateRequest(const SpecRequest& request) const;

  // One step for every active request: drafting (draft-model requests), one target forward,
  // verification. A failing step leaves every request as it was before the step.
  Status Step();

  int64_t active() const;
  int64_t free_slots() const;
  bool done(int64_t handle) const;

  // Caps the window a request feeds from the next step on (the scheduler's token budget);
  // 0 lifts the cap. Any cap keeps a lossless method lossless; it changes which sample a seed
  // gives, since the drafts change.
  void SetWindowCap(int64_t handle, int64_t cap);
  // Nodes the request would feed the target in its next step without a cap (its window,
  // clipped to the tokens left; 1 for AR), and the forward rows per node (2 with CFG).
  int64_t WantedNodes(int64_t handle) const;
  int64_t RowsPerNode(int64_t handle) const;
  // The request's committed tokens, counters, and the first-candidate drafts it will verify
  // next (Jacobi drafts; empty for AR and draft-model requests, which draft within a step).
  const std::vector<int64_t>& tokens(int64_t handle) const;
  const SpecStats& stats(int64_t handle) const;
  std::vector<int64_t> drafts(int64_t handle) const;
  // The result of a finished request; frees its slots.
  SpecResult Take(int64_t handle);
  // Drops a request (finished or not) and frees its slots.
  void Remove(int64_t handle);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs all requests to completion together (a batch sized for all of them).
StatusOr<std::vector<SpecResult>> GenerateSpeculative(const Gpt& target, const Gpt* draft,
                                                      const std::vector<SpecRequest>& requests,
                                                      SpecOptions opts = {});

}  // namespace imagegen
