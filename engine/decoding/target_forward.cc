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

// The window's nodes as one row: node i at cache index n + i and position n + col + 1; a mask
// of ancestors unless the nodes form a chain.
BatchRow WindowRow(const Sequence& s) {
  const int64_t n = s.n(), m = static_cast<int64_t>(s.nodes.size());
  BatchRow row;
  row.slot = s.slot_c;
  row.cache_len = n;
  bool chain = true;
  for (int64_t i = 0; i < m; ++i) {
    const Node& nd = s.nodes[i];
    row.tokens.push_back(nd.token);
    row.positions.push_back(n + nd.col + 1);
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
  // One upload: every node's host token (0 for a draft-model draft), the null class, then the
  // (node, draft row) pairs whose token comes from the draft model.
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
  host.push_back(ctx.cfg().null_class());
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

Status ForwardTarget(StepContext& ctx) {
  GuidedBatch batch(ctx.cfg().null_class());
  std::vector<int64_t> src;  // with node tokens: each fed token's row in ctx.node_tokens
  for (const Sequence* s : ctx.live) {
    std::vector<int64_t> every(s->nodes.size());
    for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<int64_t>(i);
    batch.Add(WindowRow(*s), s->slot_u, s->r.sampling, every);
    if (!ctx.node_tokens.defined()) continue;
    for (int64_t rep = 0; rep < (s->slot_u >= 0 ? 2 : 1); ++rep) {
      for (size_t i = 0; i < s->nodes.size(); ++i) {
        const bool null_root = rep == 1 && i == 0 && s->n() == 0;  // GuidedBatch::Add's rule
        src.push_back(null_root ? ctx.nodes : s->node_off + static_cast<int64_t>(i));
      }
    }
  }
  at::Tensor tokens;
  if (ctx.node_tokens.defined())
    tokens = ctx.node_tokens.index_select(0, UploadLongs(src, ctx.dev()));
  StepTiming* timing = ctx.opts.timing;
  std::chrono::steady_clock::time_point t0;
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
  }
  ctx.p = batch.Probs(logits).to(at::kDouble);  // [nodes, V]
  return OkStatus();
}

}  // namespace imagegen
