// A request inside a SpecBatch: its committed tokens, the drafts it will verify next, and the
// window laid out for the current step. Internal to engine/decoding (the step phases read and
// write it); not thread-safe, owned by its SpecBatch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/decoding/image_request.h"
#include "engine/decoding/speculative.h"

namespace imagegen {

// One node of a step's window: the root (the last committed token, or the condition's last
// token) or a draft.
struct Node {
  int64_t token = 0;  // input token (the last condition token for the root of an empty image)
  int64_t col = -1;   // draft column (image token n + col); -1 for the root
  int64_t parent = -1;
  std::vector<int64_t> kids;  // children in candidate order
};

// Where a draft column's proposal distribution q comes from; resolved into one gather per step.
struct ProposalRef {
  enum Kind { kPrevP, kPrevQ, kDraftModel, kOneHot, kUniform } kind = kUniform;
  int64_t index = 0;  // row of the previous step's P or Q, of this step's draft q, or the token
};

// The drafts for one image position: candidates (cand[0] lies on the main path) and their q.
struct Column {
  std::vector<int64_t> cand;
  ProposalRef q;
};

struct Sequence {
  ImageRequest r;
  int64_t slot_c = -1, slot_u = -1;  // KV slots: conditional, unconditional (CFG only)
  // Condition tokens of the conditional and unconditional rows at positions 0 .. P - 1 (the
  // class, or the prompt); image token k sits at position P + k. The first P - 1 are prefilled
  // into the KV cache in chunks before the first window, whose root is the last of them. A
  // request resumed after SpecBatch::Suspend prefills every position before its root again
  // (its committed image tokens too) before its next window.
  std::vector<int64_t> cond, uncond;
  int64_t prefilled = 0;
  int64_t prefill_to = 0;    // P - 1; after a resume, the root's position
  bool suspended = false;    // holds no KV slots (SpecBatch::Suspend) until resumed
  int64_t share_from = -1;   // a sibling (same prompt) whose prefill this one copies
  int64_t uncond_root = -1;  // draft-model steps: the unconditional root's row in node_tokens
  std::vector<int64_t> committed;
  std::vector<Column> cols;  // drafts for image tokens n, n + 1, ...
  // Drafts a shorter window cut from the end of cols (SpecOptions::keep_cut_drafts), for the
  // image tokens right after cols; a longer window takes them back before drawing new ones.
  // Their q is one-hot: the rows of P they were drawn from are gone.
  std::vector<Column> cut;
  bool tree_next = false;   // the leading columns may carry several candidates
  uint32_t iter = 0;        // steps taken (keys the random draws)
  int64_t draft_valid = 0;  // valid entries in the draft model's cache
  int64_t gamma = 0;        // drafts made by the draft model this step
  // The scheduler's grant for this step: a window (or, while prefilling, a chunk; 0: none this
  // step); -1: none given (the policy's window, SpecOptions::prefill_chunk).
  int64_t granted = -1;
  std::vector<double> cool_w;
  SpecStats stats;
  // This step's window.
  std::vector<Node> nodes;
  std::vector<int64_t> main;  // main-path node of each column (first candidates, then chain)
  int64_t node_off = 0;       // first row of the step's P (its nodes in order)
  int64_t q_off = 0;          // first row of the step's Q (its columns in order)

  int64_t n() const { return static_cast<int64_t>(committed.size()); }
  int64_t P() const { return static_cast<int64_t>(cond.size()); }
  // Cache index (= position) of the window's root: committed image tokens start at P.
  int64_t root_pos() const { return P() - 1 + n(); }
  bool prefilling() const { return prefilled < prefill_to; }
  // The token at sequence position p (p <= root_pos()).
  int64_t TokenAt(int64_t p) const { return p < P() ? cond[p] : committed[p - P()]; }
  bool finished(int64_t N) const { return n() == N; }
  int64_t window() const {
    return granted >= 1 ? std::min(granted, r.policy.window) : r.policy.window;
  }
};

}  // namespace imagegen
