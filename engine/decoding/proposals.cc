// GatherProposals: the proposal q of every draft column of every request, as one gather from
// the previous step's P and Q, this step's draft-model q, one-hot rows and a uniform row.
#include <ATen/ATen.h>

#include "engine/decoding/sampling.h"
#include "engine/decoding/step_phases.h"
#include "engine/model/transfer.h"

namespace imagegen {

void GatherProposals(StepContext& ctx) {
  const int64_t V = ctx.cfg().vocab_size;
  std::vector<ProposalRef> refs;
  int64_t nodes = 0;
  for (Sequence* s : ctx.live) {
    s->node_off = nodes;
    nodes += static_cast<int64_t>(s->nodes.size());
    s->q_off = static_cast<int64_t>(refs.size());
    for (const Column& col : s->cols) refs.push_back(col.q);
    for (const Node& nd : s->nodes) {
      ctx.max_kids = std::max<int64_t>(ctx.max_kids, static_cast<int64_t>(nd.kids.size()));
    }
    if (s->r.policy.has_tree()) ctx.tree_k = std::max(ctx.tree_k, s->r.policy.tree_branches);
  }
  ctx.nodes = nodes;
  const auto fopt = at::TensorOptions().dtype(at::kDouble).device(ctx.dev());
  if (refs.empty()) {
    ctx.q = at::zeros({1, V}, fopt);
    return;
  }
  const int64_t np = ctx.prev_p.defined() ? ctx.prev_p.size(0) : 0;
  const int64_t nq = ctx.prev_q.defined() ? ctx.prev_q.size(0) : 0;
  const int64_t nd = ctx.draft_q.defined() ? ctx.draft_q.size(0) : 0;
  std::vector<at::Tensor> parts;
  if (np > 0) parts.push_back(ctx.prev_p);
  if (nq > 0) parts.push_back(ctx.prev_q);
  if (nd > 0) parts.push_back(ctx.draft_q);
  std::vector<int64_t> src, onehot_tokens;
  int64_t n_onehot = 0;
  for (const ProposalRef& r : refs) n_onehot += r.kind == ProposalRef::kOneHot ? 1 : 0;
  const int64_t base_oh = np + nq + nd, uni = base_oh + n_onehot;
  for (const ProposalRef& r : refs) {
    switch (r.kind) {
      case ProposalRef::kPrevP:
        src.push_back(r.index);
        break;
      case ProposalRef::kPrevQ:
        src.push_back(np + r.index);
        break;
      case ProposalRef::kDraftModel:
        src.push_back(np + nq + r.index);
        break;
      case ProposalRef::kOneHot:
        src.push_back(base_oh + static_cast<int64_t>(onehot_tokens.size()));
        onehot_tokens.push_back(r.index);
        break;
      case ProposalRef::kUniform:
        src.push_back(uni);
        break;
    }
  }
  const auto n_src = static_cast<int64_t>(src.size());
  src.insert(src.end(), onehot_tokens.begin(), onehot_tokens.end());
  at::Tensor idx = UploadLongs(src, ctx.dev());  // one upload: gather rows, then one-hot ids
  if (n_onehot > 0) {
    parts.push_back(OneHot(idx.narrow(0, n_src, n_onehot), V, at::kDouble));
  }
  parts.push_back(at::full({1, V}, 1.0 / static_cast<double>(V), fopt));
  ctx.q = at::cat(parts).index_select(0, idx.narrow(0, 0, n_src));
}

}  // namespace imagegen
