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

Status ForwardTarget(StepContext& ctx) {
  GuidedBatch batch(ctx.cfg().null_class());
  for (const Sequence* s : ctx.live) {
    std::vector<int64_t> every(s->nodes.size());
    for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<int64_t>(i);
    batch.Add(WindowRow(*s), s->slot_u, s->r.sampling, every);
  }
  StepTiming* timing = ctx.opts.timing;
  std::chrono::steady_clock::time_point t0;
  if (timing != nullptr) {
    SynchronizeDevice(ctx.dev());
    t0 = std::chrono::steady_clock::now();
  }
  ASSIGN_OR_RETURN(at::Tensor logits,
                   ctx.target.Forward(batch.rows(), ctx.cache, at::Tensor(), ctx.fwd()));
  if (timing != nullptr) {
    SynchronizeDevice(ctx.dev());
    timing->forward_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  ctx.p = batch.Probs(logits).to(at::kDouble);  // [nodes, V]
  return OkStatus();
}

}  // namespace imagegen
