// ForwardTarget: one ragged target forward over every request's window (conditional and
// unconditional rows, a tree mask where the window is not a chain), then the final
// distribution P at every node.
#include <ATen/ATen.h>

#include <chrono>

#include "engine/decoding/guided_batch.h"
#include "engine/decoding/step_phases.h"
#include "engine/model/transfer.h"

namespace imagegen {
namespace {

// The window's nodes as one row: node i at cache index root + i and position root + col + 1
// (root: the root's position, P - 1 + n); a mask of ancestors unless the nodes form a chain.
BatchRow WindowRow(const Sequence& s) {
  const int64_t root = s.root_pos(), m = static_cast<int64_t>(s.nodes.size());
  BatchRow row;
  row.slot = s.slot_c;
  row.prefix = s.P();
  row.cache_len = root;
  bool chain = true;
  for (int64_t i = 0; i < m; ++i) {
    const Node& nd = s.nodes[i];
    row.tokens.push_back(nd.token);
    row.positions.push_back(root + nd.col + 1);
    chain &= nd.parent == i - 1;
  }
  if (!chain) {
    row.mask.assign(static_cast<size_t>(m * m), 0);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t a = i; a >= 0; a = s.nodes[a].parent) row.mask[i * m + a] = 1;
    }
  }
  return row;
}

}  // namespace

void NodeTokens(StepContext& ctx) {
  if (!ctx.draft_tokens.defined()) return;
  // One upload: every node's host token (0 for a draft-model draft), the unconditional roots of
  // empty images (their last unconditional condition token), then the (node, draft row) pairs
  // whose token comes from the draft model.
  std::vector<int64_t> host, node, row;
  for (const Sequence* s : ctx.live) {
    for (const Node& nd : s->nodes) {
      const bool drafted =
          nd.col >= 0 && s->cols[static_cast<size_t>(nd.col)].q.kind == ProposalRef::kDraftModel;
      if (drafted) {
        node.push_back(static_cast<int64_t>(host.size()));
        row.push_back(s->cols[static_cast<size_t>(nd.col)].q.index);
      }
      host.push_back(drafted ? 0 : nd.token);
    }
  }
  for (Sequence* s : ctx.live) {
    s->uncond_root = -1;
    if (s->n() == 0 && s->slot_u >= 0) {
      s->uncond_root = static_cast<int64_t>(host.size());
      host.push_back(s->uncond.back());
    }
  }
  const auto n = static_cast<int64_t>(host.size()), d = static_cast<int64_t>(node.size());
  host.insert(host.end(), node.begin(), node.end());
  host.insert(host.end(), row.begin(), row.end());
  at::Tensor up = UploadLongs(host, ctx.dev());
  ctx.node_tokens = up.narrow(0, 0, n);  // a view of this step's own upload
  if (d > 0) {
    ctx.node_tokens.index_copy_(0, up.narrow(0, n, d),
                                ctx.draft_tokens.index_select(0, up.narrow(0, n + d, d)));
  }
}

at::Tensor StepProbs(const StepContext& ctx, const GuidedBatch& batch, const at::Tensor& logits) {
  const int fused = ctx.opts.fused_verify ? ctx.opts.fused_probs : 0;
  if (fused != 0) {
    at::Tensor p = batch.FusedProbs(logits, /*host=*/fused > 0);
    if (p.defined()) return p;
  }
  return batch.Probs(logits).to(at::kDouble);
}

Status ForwardTarget(StepContext& ctx) {
  GuidedBatch batch;
  std::vector<int64_t> src;  // with node tokens: each fed token's row in ctx.node_tokens
  for (const Sequence* s : ctx.live) {
    std::vector<int64_t> every(s->nodes.size());
    for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<int64_t>(i);
    batch.Add(WindowRow(*s), s->slot_u, s->uncond, s->r.sampling, every);
    if (!ctx.node_tokens.defined()) continue;
    for (int64_t rep = 0; rep < (s->slot_u >= 0 ? 2 : 1); ++rep) {
      for (size_t i = 0; i < s->nodes.size(); ++i) {
        const bool uncond_root = rep == 1 && i == 0 && s->n() == 0;  // GuidedBatch::Add's rule
        src.push_back(uncond_root ? s->uncond_root : s->node_off + static_cast<int64_t>(i));
      }
    }
  }
  // Prompt prefill chunks ride in the same forward, after the windows; their logits are unused.
  const size_t window_rows = batch.rows().size();
  for (const PrefillChunk& c : ctx.prefill) {
    const Sequence& s = *c.seq;
    BatchRow row;
    row.slot = s.slot_c;
    row.prefix = s.P();
    row.cache_len = s.prefilled;
    for (int64_t p = s.prefilled; p < s.prefilled + c.tokens; ++p) {
      row.tokens.push_back(s.TokenAt(p));  // image tokens too, when resumed
      row.positions.push_back(p);
    }
    batch.Add(std::move(row), s.slot_u, s.uncond, s.r.sampling, {});
  }
  at::Tensor tokens;
  if (ctx.node_tokens.defined()) {
    tokens = ctx.node_tokens.index_select(0, UploadLongs(src, ctx.dev()));
    std::vector<int64_t> prefill_ids;  // as GuidedBatch::Add laid out both rows of each chunk
    for (size_t r = window_rows; r < batch.rows().size(); ++r) {
      const std::vector<int64_t>& t = batch.rows()[r].tokens;
      prefill_ids.insert(prefill_ids.end(), t.begin(), t.end());
    }
    if (!prefill_ids.empty()) tokens = at::cat({tokens, UploadLongs(prefill_ids, ctx.dev())});
  }
  StepTiming* timing = ctx.opts.timing;
  std::chrono::steady_clock::time_point t0;
  const int64_t l0 = ThreadLaunches();
  if (timing != nullptr) {
    SynchronizeDevice(ctx.dev());
    t0 = std::chrono::steady_clock::now();
  }
  ASSIGN_OR_RETURN(at::Tensor logits,
                   ctx.target.Forward(batch.rows(), ctx.cache, tokens, ctx.fwd()));
  if (timing != nullptr) {
    SynchronizeDevice(ctx.dev());
    timing->forward_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    timing->forward_launches += ThreadLaunches() - l0;
  }
  for (const PrefillChunk& c : ctx.prefill) {
    c.seq->prefilled += c.tokens;
    c.seq->stats.prefill_forwards += 1;
  }
  if (!ctx.live.empty()) ctx.p = StepProbs(ctx, batch, logits);  // [nodes, V]
  return OkStatus();
}

}  // namespace imagegen
