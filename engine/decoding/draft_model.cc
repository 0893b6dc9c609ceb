// DraftWithModel: gamma = min(L - 1, tokens left - 1) autoregressive draft forwards, batched
// over the draft-model requests; the first one also feeds the committed tokens the draft has
// not seen. Drafts are sampled on the device and fed back without a host round trip, and stay
// there: the target forward, the verification and the step's one readback take them from
// StepContext::draft_tokens (NodeTokens).
#include <ATen/ATen.h>

#include "engine/decoding/guided_batch.h"
#include "engine/decoding/philox.h"
#include "engine/decoding/sampling.h"
#include "engine/decoding/step_phases.h"
#include "engine/model/transfer.h"

namespace imagegen {
namespace {

// The draft forward's row for request s at draft j: at j = 0 everything from the draft's valid
// cache up to the root (the whole prompt, the first time); later one token whose id comes from
// the previous draw on the device.
BatchRow DraftRow(const Sequence& s, int64_t j) {
  const int64_t root = s.root_pos();
  BatchRow row;
  row.slot = s.slot_c;
  row.prefix = s.P();
  if (j == 0) {
    row.cache_len = s.draft_valid;
    for (int64_t p = s.draft_valid; p <= root; ++p) {
      row.positions.push_back(p);
      row.tokens.push_back(s.TokenAt(p));
    }
  } else {
    row.cache_len = root + j;
    row.positions = {root + j};
    row.tokens = {0};
  }
  return row;
}

// One batched draft forward for the requests in `act` (drafting their j-th token): their q
// rows [act, V] (float64), and the drawn tokens in *tokens (device).
StatusOr<at::Tensor> DraftOnce(StepContext& ctx, const std::vector<Sequence*>& act,
                               const std::vector<Sequence*>& prev, int64_t j, at::Tensor* tokens) {
  GuidedBatch batch;
  std::vector<int64_t> tok_src;  // for j > 0: each row's token, from the previous draws
  for (Sequence* s : act) {
    BatchRow row = DraftRow(*s, j);
    const int64_t len = static_cast<int64_t>(row.tokens.size());
    if (j > 0) {
      const auto idx = std::find(prev.begin(), prev.end(), s) - prev.begin();
      tok_src.push_back(idx);
      if (s->slot_u >= 0) tok_src.push_back(idx);
    }
    batch.Add(std::move(row), s->slot_u, s->uncond, s->r.sampling, {len - 1});
  }
  at::Tensor dev_tokens;
  if (j > 0) {
    dev_tokens = tokens->index_select(0, UploadLongs(tok_src, ctx.dev()));
  }
  ASSIGN_OR_RETURN(at::Tensor logits,
                   ctx.draft->Forward(batch.rows(), ctx.draft_cache, dev_tokens, ctx.fwd()));
  at::Tensor probs = StepProbs(ctx, batch, logits);
  std::vector<double> us;
  for (Sequence* s : act) {
    us.push_back(Uniform(s->r.seed, static_cast<uint32_t>(s->n() + j), s->iter, Purpose::kDraft));
    s->stats.draft_forwards += 1;
  }
  *tokens = SampleInverseCdf(probs, UploadDoubles(us, ctx.dev()));
  return probs;
}

}  // namespace

Status DraftWithModel(StepContext& ctx, const std::vector<Sequence*>& drafting) {
  const int64_t N = ctx.cfg().block_size;
  int64_t gmax = 0;
  for (Sequence* s : drafting) {
    s->cols.clear();
    s->gamma = std::min(s->window() - 1, N - 1 - s->n());
    gmax = std::max(gmax, s->gamma);
  }
  if (gmax == 0) return OkStatus();
  std::vector<at::Tensor> qparts, tparts;  // per draft j: [requests drafting at j, V], tokens
  std::vector<std::vector<Sequence*>> who;
  at::Tensor tokens;
  for (int64_t j = 0; j < gmax; ++j) {
    std::vector<Sequence*> act;
    for (Sequence* s : drafting) {
      if (s->gamma > j) act.push_back(s);
    }
    ASSIGN_OR_RETURN(at::Tensor q, DraftOnce(ctx, act, j == 0 ? act : who.back(), j, &tokens));
    qparts.push_back(q);
    tparts.push_back(tokens);
    who.push_back(std::move(act));
  }
  // Column j of each request refers to its row of the concatenated draft q and tokens; the
  // token itself is not known on the host (cand 0 is a placeholder).
  int64_t row = 0;
  for (const auto& act : who) {
    for (Sequence* s : act) {
      Column col;
      col.cand = {0};
      col.q = {ProposalRef::kDraftModel, row};
      s->cols.push_back(col);
      ++row;
    }
  }
  ctx.draft_q = at::cat(qparts);
  ctx.draft_tokens = at::cat(tparts).to(at::kLong);
  return OkStatus();
}

}  // namespace imagegen
