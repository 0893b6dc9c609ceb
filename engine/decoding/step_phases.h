// The phases of one SpecBatch step, in the order SpecBatch::Step runs them:
//
//   DraftWithModel   draft-model requests draft their chains (batched draft forwards)
//   PlanWindow       each request lays out its window: root, proactive tree, chain
//   GatherProposals  one gather of the proposal q of every draft column
//   NodeTokens       (draft-model steps) every node's input token on the device
//   ForwardTarget    one ragged target forward over every window -> final distributions P
//   VerifyWindows    every node's children verified against P (the exact rule, verify.h)
//   DrawNextDrafts   fresh draws, tree candidates and Gumbel redraws from P
//   ReadBack         the step's only device-to-host copy
//   CommitWindow     each request walks its window, commits tokens, keeps the next drafts
//                    and lists the KV moves that compact its cache (made once for all)
//
// Each phase is a free function over StepContext (what the step shares) and the requests'
// Sequence state. Internal to engine/decoding; not thread-safe (the step's thread).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "engine/decoding/sequence.h"
#include "engine/decoding/verify.h"
#include "engine/model/gpt.h"

namespace imagegen {

// A prefill chunk of this step: the sequence's tokens at positions prefilled .. prefilled +
// tokens - 1 (its prompt, and after a resume its committed image tokens too).
struct PrefillChunk {
  Sequence* seq = nullptr;
  int64_t tokens = 0;
};

struct StepContext {
  StepContext(const Gpt& t, const Gpt* d, KvCache& c, KvCache& dc, const SpecOptions& o,
              const VerifyRules& r)
      : target(t), draft(d), cache(c), draft_cache(dc), opts(o), rules(r) {}
  const Gpt& target;
  const Gpt* draft;
  KvCache& cache;
  KvCache& draft_cache;
  const SpecOptions& opts;
  const VerifyRules& rules;
  std::vector<Sequence*> live;        // unfinished requests past their prefill, in handle order
  std::vector<PrefillChunk> prefill;  // requests prefilling this step
  at::Tensor prev_p, prev_q;          // the previous step's P and Q (Jacobi draft sources)
  at::Tensor draft_q;                 // q of this step's draft-model drafts, one row per draft
  at::Tensor draft_tokens;            // the drafts themselves, int64 on the device, one per q row
  // Draft-model steps only (else undefined): every node's input token, in node order, then the
  // unconditional roots of empty images (Sequence::uncond_root), int64 on the device. Draft-model
  // drafts stay on the device: the forward, the verification and the readback take them here.
  at::Tensor node_tokens;
  at::Tensor q;           // [columns, V] proposal of every draft column
  at::Tensor p;           // [nodes, V] final distribution at every node (float64)
  at::Tensor embeddings;  // float64 token embeddings, when a request uses GSD
  int64_t nodes = 0;      // rows of p
  int64_t max_kids = 1;   // most children of any node
  int64_t tree_k = 1;     // candidates per tree column (largest K in the batch)

  const GptConfig& cfg() const { return target.config(); }
  at::Device dev() const { return target.options().device; }
  ForwardOptions fwd() const {
    return {opts.batch_invariant, opts.static_shapes, opts.cuda_graphs};
  }
};

// What the verification decided, on the device: per node and child, accepted ([nodes, K]);
// the token a node commits when no child is accepted (its residual, or the bonus at a leaf);
// the token that follows it on the maximal-coupling path (kept child, else the residual).
// `fresh`, `extra`: the fused verification also draws each node's next drafts from P
// (DrawNextDrafts's draws, with its uniforms: the fresh one, and with trees K - 1 more without
// replacement); undefined otherwise. `packed`: it then also writes the readback's rows
// (float64 [nodes, K + tree_k + 2, + 1 with node tokens]: accepted, residual, kept, fresh,
// extra and the node's token), which the readback takes as they are where nothing else goes
// into it (no entropy; Gumbel draws are copied into the draft columns).
struct Verdicts {
  at::Tensor accepted, residual, kept, fresh, extra, packed;
};

// Next-step drafts drawn from P: a fresh draw per node and, for trees, K - 1 more without
// replacement ([nodes, K - 1], -1 where p has no mass left).
struct NextDrafts {
  at::Tensor fresh, extra;
};

// The step's results on the host, one row per node.
class HostStep {
 public:
  HostStep(const Verdicts& v, const NextDrafts& d, const at::Tensor& entropy,
           const at::Tensor& node_tokens, int64_t max_kids, int64_t tree_k);
  bool accepted(int64_t node, int64_t kid) const { return h_[node][kid] > 0.5; }
  int64_t residual(int64_t node) const { return Get(node, max_kids_); }
  int64_t kept(int64_t node) const { return Get(node, max_kids_ + 1); }
  int64_t fresh(int64_t node) const { return Get(node, max_kids_ + 2); }
  int64_t extra(int64_t node, int64_t k) const { return Get(node, max_kids_ + 3 + k); }
  double entropy(int64_t node) const { return h_[node][max_kids_ + 2 + tree_k_]; }
  // The node's input token (StepContext::node_tokens), where the step had them.
  bool has_tokens() const { return token_col_ >= 0; }
  int64_t token(int64_t node) const { return Get(node, token_col_); }

 private:
  int64_t Get(int64_t node, int64_t col) const { return static_cast<int64_t>(h_[node][col]); }
  at::Tensor host_;
  at::TensorAccessor<double, 2> h_;
  int64_t max_kids_, tree_k_, token_col_;
};

class GuidedBatch;

// The final distributions of `batch`'s outputs [outputs, V] in float64: the fused kernel
// where SpecOptions::fused_probs and fused_verify ask for it and it applies
// (GuidedBatch::FusedProbs), else GuidedBatch::Probs.
at::Tensor StepProbs(const StepContext& ctx, const GuidedBatch& batch, const at::Tensor& logits);
Status DraftWithModel(StepContext& ctx, const std::vector<Sequence*>& drafting);
void PlanWindow(Sequence& s, const GptConfig& cfg, const SpecOptions& opts);
void GatherProposals(StepContext& ctx);
void NodeTokens(StepContext& ctx);
Status ForwardTarget(StepContext& ctx);
Verdicts VerifyWindows(const StepContext& ctx);
NextDrafts DrawNextDrafts(const StepContext& ctx, const Verdicts& v);
// The KV moves that make its accepted path contiguous go into `moves` (MoveCacheEntries runs
// them for every request at once).
void CommitWindow(Sequence& s, const HostStep& h, const StepContext& ctx, CacheMoves& moves);

}  // namespace imagegen
