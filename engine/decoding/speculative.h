// Speculative decoding of many requests at once, each with its own policy (policy.h), seed and
// progress: every step packs all active requests' windows (root, proactive tree, chain) into
// one ragged target forward, then verifies all of them with batched tensor operations on the
// model's device, and reads back one small tensor of token ids and accept bits per step. The
// host then walks each request's window (a few integer comparisons per node) to commit tokens,
// choose the next drafts and compact the KV cache. Draft-model requests draft first, with
// batched draft forwards fed by device-sampled tokens (no host round trip per draft).
//
// A step runs in phases, each in its own file (step_phases.h lists them): draft-model
// drafting, window planning, one gather of proposals, one target forward, batched
// verification (the exact rule of verify.h), next drafts, one readback, and each request's
// commit walk with KV compaction. docs/decoding.md derives the rules.
//
// Not thread-safe: one SpecBatch belongs to one thread (the engine's step loop).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/decoding/image_request.h"
#include "engine/decoding/policy.h"
#include "engine/decoding/verify.h"
#include "engine/model/cuda_graphs.h"
#include "engine/model/gpt.h"
#include "engine/util/status.h"

namespace imagegen {

struct SpecStats {
  int64_t nfe = 0;               // target forwards (a CFG pair once, the first forward included)
  int64_t prefill_forwards = 0;  // forwards that fed prompt chunks (not in nfe)
  int64_t draft_forwards = 0;    // draft-model forwards (counted apart from NFE)
  int64_t drafts_verified = 0;   // drafts tested before the first rejection of each step
  int64_t drafts_accepted = 0;
  int64_t cut_drafts_fed = 0;        // drafts a shorter window had cut, fed again by a longer one
  std::vector<int32_t> step_tokens;  // tokens committed by each step
  std::vector<int32_t> token_step;   // per image token, the step that committed it
  // Per draft depth d (index d - 1: the d-th draft of a step's accepted path), drafts tested
  // there before the step's first rejection (tree siblings each count) and drafts accepted.
  std::vector<int64_t> verified_at_depth, accepted_at_depth;
  double entropy_sum = 0;     // entropy (nats) of p at each committed token,
  int64_t entropy_count = 0;  // when SpecOptions::collect_entropy

  double acceptance_rate() const {
    return drafts_verified > 0 ? static_cast<double>(drafts_accepted) / drafts_verified : 0.0;
  }
};

struct SpecResult {
  std::vector<int32_t> tokens;
  SpecStats stats;
};

// Where the steps' time goes (SpecOptions::timing), host wall-clock: the target forward alone
// (Gpt::Forward), the draft model's forwards, and the whole step; everything else (planning,
// CFG and sampling filters, verification, the next drafts, the readback, the commit walk) is
// step - forward - draft. To time them the device is synchronised after the drafts and before
// and after the forward: free on the CPU, up to three extra syncs per step on CUDA (measure
// speedups with timing off).
// With a LaunchCount live on the stepping thread (transfer.h) it also counts the step's device
// launches, split the same way.
struct StepTiming {
  int64_t steps = 0;
  double step_seconds = 0, forward_seconds = 0, draft_seconds = 0;
  int64_t step_launches = 0, forward_launches = 0, draft_launches = 0;
};

struct SpecOptions {
  bool collect_entropy = false;
  // Batch-invariant forwards (ForwardOptions): a request's tokens do not depend on the other
  // requests in the batch. Costs one attention call per request; the serving engine turns it
  // on, offline sampling of thousands of rows at once leaves it off.
  bool batch_invariant = false;
  // Static-shape forwards (ForwardOptions::static_shapes), captured as CUDA graphs with
  // cuda_graphs; the caches get a scratch slot. Either overrides batch_invariant.
  bool static_shapes = false;
  bool cuda_graphs = false;
  // Chain verification fused into one pass per node (kernels/chain_verify.h): one kernel on
  // CUDA where the build has it, the same arithmetic on the host on the CPU. Taken by steps
  // whose nodes all have at most one child, no GSD node and the exact rules; the rest, and
  // false, run the eager verification (verify.h). Same decisions; a draw can differ from the
  // eager one only where its uniform lands within rounding of a CDF boundary.
  bool fused_verify = true;
  // The target's and the draft model's final distributions (CFG, temperature, top-k, softmax)
  // fused into one pass per row (kernels/guided_probs.h) for steps in which no row uses top-p: -1,
  // where the kernel runs (CUDA builds with it); 1, also on the CPU through the same arithmetic on
  // the host (tests; ATen's vectorised float32 softmax is the cheaper there); 0, never. Off
  // whenever fused_verify is false (one switch for the fused kernels). A softmax in float64 instead
  // of float32: the distributions differ by float32 rounding.
  int fused_probs = -1;
  // The acceptance decisions (verify.h); null: the exact rules. Tests inject broken ones.
  // Must outlive the SpecBatch.
  const VerifyRules* rules = nullptr;
  // When set, each step adds its times here (StepTiming). Must outlive the SpecBatch.
  StepTiming* timing = nullptr;
  // Prompt tokens a request prefills per step when the step grants it no window (0: all that
  // are left). A grant caps the chunk like a window.
  int64_t prefill_chunk = 0;
  // A Jacobi window cut shorter than its drafts (a grant, or a tree that takes the chain's
  // nodes) keeps the cut drafts, and a later, longer window verifies them before it draws new
  // random ones. They were drawn from rows of P that are gone, so they are verified as one-hot
  // proposals (q = their token, fixed before the step's uniforms are: exact, like the one-hot
  // initial drafts); false drops them, and the longer window starts its tail from random
  // drafts again. Independent and maximal coupling only: a Gumbel-coupled draft is the argmax
  // of its own keyed noise, which the target's sample shares, so it is always drawn anew.
  bool keep_cut_drafts = true;
  // Tests only (the power check of the moving-window exactness test): the kept drafts are
  // verified as if drawn from the policy's initial q (uniform for SJD-PAC) instead of one-hot.
  bool testing_cut_drafts_with_initial_q = false;
  // Tests only (the power check of the preemption exactness test): Resume skips recomputing
  // the KV entries, so a resumed request attends to whatever its new slots hold.
  bool testing_resume_without_recompute = false;
};

// The window the scheduler grants a request for one step (its token budget's share).
struct WindowGrant {
  int64_t handle = 0;
  // Tokens fed this step, root included; >= 1. While the request prefills its prompt: the
  // chunk's tokens, 0 for none this step.
  int64_t window = 0;
};

// One batch of in-flight requests over fixed KV slots. Requests are added while slots last.
class SpecBatch {
 public:
  // `slots` KV rows are allocated on the target (and the draft model if given); a request
  // takes one, two with CFG. `target` and `draft` (may be null) must outlive the batch.
  SpecBatch(const Gpt& target, const Gpt* draft, int64_t slots, SpecOptions opts = {});
  ~SpecBatch();
  SpecBatch(const SpecBatch&) = delete;
  SpecBatch& operator=(const SpecBatch&) = delete;

  // Admits a request that ValidateImageRequest accepted for these models (not checked
  // again). ResourceExhausted when no slot is free. Returns a handle.
  // A prompted request prefills its prompt (all but its last token) in chunks, in the same
  // forwards as the others' windows, before its first window. With `share_prefill_with`, the
  // handle of a request with the same prompt and CFG use (InvalidArgument otherwise), it waits
  // for that one's prefill and copies its KV entries instead (n images of one prompt share
  // one prefill); if that request goes first, it prefills itself.
  StatusOr<int64_t> Add(const ImageRequest& request, int64_t share_prefill_with = -1);

  // One step for every active request: drafting (draft-model requests), one target forward,
  // verification, commits. A request in `grants` feeds at most its granted window this step;
  // the others their policy's window. A grant changes which sample a seed gives (the drafts
  // change), never the distribution of a lossless method. On failure the requests cannot go
  // on (their state is unspecified); the caller removes them.
  Status Step(const std::vector<WindowGrant>& grants = {});

  int64_t active() const;  // unfinished and not suspended
  int64_t free_slots() const;
  bool done(int64_t handle) const;
  // Whether the request still has prompt tokens to prefill (or a sibling's to wait for), or,
  // resumed, entries to recompute.
  bool prefilling(int64_t handle) const;

  // Nodes the request would feed the target in its next step without a cap (its window,
  // clipped to the tokens left; 1 for AR; while prefilling, the tokens left to prefill,
  // 0 while it waits for a sibling's), and the forward rows per node (2 with CFG).
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

  // Preemption by recomputation. Suspend frees an unfinished request's KV slots and keeps its
  // committed tokens, counters and random stream (its drafts are dropped: they refer to this
  // step's distributions); it takes no part in steps until Resume, which takes free slots
  // (ResourceExhausted when there are too few) and has it prefill every position before its
  // root again, in chunks like a prompt, before its next window. The tokens it goes on to
  // commit follow the same distribution as without the pause (lossless methods stay lossless;
  // SpecBatchPreemptionTest); the drafts differ, so a seed may give another image. Both are
  // no-ops on a request that is not in the state they change.
  void Suspend(int64_t handle);
  Status Resume(int64_t handle);

  // The CUDA graphs of the batch's caches, target and draft together: counts summed, the
  // later failure's error (SpecOptions::cuda_graphs on a CUDA device; all zero otherwise).
  ForwardGraphStats graph_stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Validates, then runs all requests to completion together (a batch sized for all of them).
// Requests with the same prompt and CFG use share the first one's prefill.
StatusOr<std::vector<SpecResult>> GenerateSpeculative(const Gpt& target, const Gpt* draft,
                                                      const std::vector<ImageRequest>& requests,
                                                      SpecOptions opts = {});

}  // namespace imagegen
