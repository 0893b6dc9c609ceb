#include "engine/decoding/speculative.h"

#include <ATen/ATen.h>

#include <chrono>
#include <map>

#include "engine/decoding/sequence.h"
#include "engine/decoding/step_phases.h"
#include "engine/model/cuda_graphs.h"
#include "engine/model/transfer.h"

namespace imagegen {

struct SpecBatch::Impl {
  const Gpt& target;
  const Gpt* draft;
  SpecOptions opts;
  KvCache cache, dcache;
  std::vector<int64_t> free_list;  // free KV slots, lowest last
  std::map<int64_t, Sequence> seqs;
  int64_t next_handle = 0;
  at::Tensor prev_p, prev_q;  // float64 P and Q of the last step (draft sources)
  at::Tensor embeddings;      // float64 token embeddings, once a GSD request has run

  Impl(const Gpt& t, const Gpt* d, int64_t slots, SpecOptions o) : target(t), draft(d), opts(o) {
    for (int64_t s = slots - 1; s >= 0; --s) free_list.push_back(s);
    const bool scratch = o.static_shapes || o.cuda_graphs;
    cache = target.NewCache(slots, 0, scratch);
    if (draft != nullptr) dcache = draft->NewCache(slots, 0, scratch);
  }

  const Sequence& at(int64_t h) const { return seqs.at(h); }
  int64_t N() const { return target.config().block_size; }
  StepContext Context(const std::vector<WindowGrant>& grants);
  Status Step(const std::vector<WindowGrant>& grants);
};

SpecBatch::SpecBatch(const Gpt& target, const Gpt* draft, int64_t slots, SpecOptions opts)
    : impl_(std::make_unique<Impl>(target, draft, slots, opts)) {}
SpecBatch::~SpecBatch() = default;

StatusOr<int64_t> SpecBatch::Add(const ImageRequest& request, int64_t share_prefill_with) {
  const int64_t need = request.sampling.uses_cfg() ? 2 : 1;
  const GptConfig& cfg = impl_->target.config();
  Sequence s;
  s.cond = ConditionTokens(request, cfg);
  s.uncond = UnconditionalTokens(request, cfg);
  s.prefill_to = s.P() - 1;
  if (share_prefill_with >= 0) {
    auto it = impl_->seqs.find(share_prefill_with);
    if (it == impl_->seqs.end() || !SharesPrefill(it->second.r, request, cfg)) {
      return InvalidArgument(
          "share_prefill_with: no request with the same prompt and CFG use has that handle");
    }
    s.share_from = share_prefill_with;
  }
  if (free_slots() < need) return ResourceExhausted("no free KV-cache slot");
  s.r = request;
  s.slot_c = impl_->free_list.back();
  impl_->free_list.pop_back();
  if (need == 2) {
    s.slot_u = impl_->free_list.back();
    impl_->free_list.pop_back();
  }
  const int64_t h = impl_->next_handle++;
  impl_->seqs.emplace(h, std::move(s));
  return h;
}

int64_t SpecBatch::active() const {
  int64_t a = 0;
  for (const auto& [h, s] : impl_->seqs) a += s.finished(impl_->N()) || s.suspended ? 0 : 1;
  return a;
}

bool SpecBatch::prefilling(int64_t handle) const { return impl_->at(handle).prefilling(); }

int64_t SpecBatch::free_slots() const { return static_cast<int64_t>(impl_->free_list.size()); }

bool SpecBatch::done(int64_t handle) const {
  auto it = impl_->seqs.find(handle);
  return it == impl_->seqs.end() || it->second.finished(impl_->N());
}

SpecResult SpecBatch::Take(int64_t handle) {
  SpecResult out;
  auto it = impl_->seqs.find(handle);
  if (it == impl_->seqs.end()) return out;
  for (int64_t t : it->second.committed) out.tokens.push_back(static_cast<int32_t>(t));
  out.stats = std::move(it->second.stats);
  Remove(handle);
  return out;
}

int64_t SpecBatch::WantedNodes(int64_t handle) const {
  const Sequence& s = impl_->at(handle);
  if (s.suspended) return 0;
  if (s.prefilling()) return s.share_from >= 0 ? 0 : s.prefill_to - s.prefilled;
  const int64_t left = impl_->N() - s.n();
  if (left <= 0) return 0;
  return s.r.policy.draft == DraftSource::kNone ? 1 : std::min(s.r.policy.window, left);
}

int64_t SpecBatch::RowsPerNode(int64_t handle) const {
  return impl_->at(handle).slot_u != -1 ? 2 : 1;  // -2: suspended, takes two again
}

const std::vector<int64_t>& SpecBatch::tokens(int64_t handle) const {
  return impl_->at(handle).committed;
}

const SpecStats& SpecBatch::stats(int64_t handle) const { return impl_->at(handle).stats; }

std::vector<int64_t> SpecBatch::drafts(int64_t handle) const {
  std::vector<int64_t> out;
  for (const Column& c : impl_->at(handle).cols) out.push_back(c.cand[0]);
  return out;
}

void SpecBatch::Remove(int64_t handle) {
  auto it = impl_->seqs.find(handle);
  if (it == impl_->seqs.end()) return;
  for (int64_t slot : {it->second.slot_c, it->second.slot_u}) {
    if (slot >= 0) impl_->free_list.push_back(slot);
  }
  impl_->seqs.erase(it);
}

void SpecBatch::Suspend(int64_t handle) {
  auto it = impl_->seqs.find(handle);
  if (it == impl_->seqs.end() || it->second.suspended || it->second.finished(impl_->N())) return;
  Sequence& s = it->second;
  for (int64_t* slot : {&s.slot_c, &s.slot_u}) {
    if (*slot >= 0) impl_->free_list.push_back(*slot);
    *slot = *slot >= 0 ? -2 : -1;  // -2: to take again at Resume
  }
  // What referred to the freed cache or to this step's P and Q: the next window starts from
  // fresh drafts, as a request's first window does.
  s.cols.clear();
  s.cut.clear();  // they follow cols
  s.nodes.clear();
  s.main.clear();
  s.tree_next = false;
  s.gamma = 0;
  s.draft_valid = 0;
  s.prefilled = 0;
  s.prefill_to = s.root_pos();
  s.share_from = -1;
  s.suspended = true;
}

Status SpecBatch::Resume(int64_t handle) {
  auto it = impl_->seqs.find(handle);
  if (it == impl_->seqs.end() || !it->second.suspended) return OkStatus();
  Sequence& s = it->second;
  const int64_t need = (s.slot_c == -2 ? 1 : 0) + (s.slot_u == -2 ? 1 : 0);
  if (free_slots() < need) return ResourceExhausted("no free KV-cache slot to resume into");
  for (int64_t* slot : {&s.slot_c, &s.slot_u}) {
    if (*slot != -2) continue;
    *slot = impl_->free_list.back();
    impl_->free_list.pop_back();
  }
  if (impl_->opts.testing_resume_without_recompute) s.prefilled = s.prefill_to;
  s.suspended = false;
  return OkStatus();
}

Status SpecBatch::Step(const std::vector<WindowGrant>& grants) { return impl_->Step(grants); }

ForwardGraphStats SpecBatch::graph_stats() const {
  ForwardGraphStats s = GraphStats(impl_->cache);
  const ForwardGraphStats d = GraphStats(impl_->dcache);
  s.graphs += d.graphs;
  s.captures += d.captures;
  s.replays += d.replays;
  s.capture_failures += d.capture_failures;
  if (d.last_failure_seq > s.last_failure_seq) {
    s.last_failure = d.last_failure;
    s.last_failure_seq = d.last_failure_seq;
    s.last_failed_pool = d.last_failed_pool;
  }
  return s;
}

StepContext SpecBatch::Impl::Context(const std::vector<WindowGrant>& grants) {
  StepContext ctx(target, draft, cache, dcache, opts,
                  opts.rules != nullptr ? *opts.rules : ExactRules());
  for (auto& [h, s] : seqs) s.granted = -1;
  for (const WindowGrant& g : grants) {
    if (auto it = seqs.find(g.handle); it != seqs.end()) it->second.granted = g.window;
  }
  for (auto& [h, s] : seqs) {
    if (s.finished(N()) || s.suspended) continue;
    if (s.prefilling() && s.share_from >= 0) {
      auto src = seqs.find(s.share_from);
      if (src == seqs.end() || src->second.suspended) {
        s.share_from = -1;  // the sibling is gone (or paused): prefill alone
      } else if (src->second.prefilled < s.P() - 1) {
        continue;  // waits for the sibling's prefill (of the prompt: a resumed one's goes on)
      } else {
        CopyCachePrefix(cache, src->second.slot_c, s.slot_c, s.P() - 1);
        if (s.slot_u >= 0) CopyCachePrefix(cache, src->second.slot_u, s.slot_u, s.P() - 1);
        s.prefilled = s.P() - 1;
        s.share_from = -1;
        if (s.granted == 0) continue;  // planned as prefilling: its first window comes next
      }
    }
    if (!s.prefilling()) {
      ctx.live.push_back(&s);
      continue;
    }
    if (s.granted == 0) continue;  // no prefill this step
    const int64_t left = s.prefill_to - s.prefilled;
    const int64_t cap = s.granted > 0 ? s.granted : opts.prefill_chunk;
    ctx.prefill.push_back({&s, cap > 0 ? std::min(cap, left) : left});
  }
  bool grouped = false;
  for (const Sequence* s : ctx.live) grouped |= s->r.policy.acceptance == Acceptance::kGrouped;
  if (grouped && !embeddings.defined()) embeddings = target.token_embeddings().to(at::kDouble);
  ctx.embeddings = embeddings;
  ctx.prev_p = prev_p;
  ctx.prev_q = prev_q;
  return ctx;
}

// plan -> draft -> forward -> verify -> commit (step_phases.h).
Status SpecBatch::Impl::Step(const std::vector<WindowGrant>& grants) {
  StepContext ctx = Context(grants);
  if (ctx.live.empty() && ctx.prefill.empty()) return OkStatus();
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = opts.timing != nullptr ? Clock::now() : Clock::time_point();
  const int64_t l0 = ThreadLaunches();
  if (ctx.live.empty()) return ForwardTarget(ctx);  // prompt prefill only
  std::vector<Sequence*> drafting;
  for (Sequence* s : ctx.live) {
    if (s->r.policy.draft == DraftSource::kDraftModel) drafting.push_back(s);
  }
  if (!drafting.empty()) {
    RETURN_IF_ERROR(DraftWithModel(ctx, drafting));
    if (opts.timing != nullptr) {
      SynchronizeDevice(target.options().device);
      opts.timing->draft_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      opts.timing->draft_launches += ThreadLaunches() - l0;
    }
  }
  for (Sequence* s : ctx.live) PlanWindow(*s, target.config(), ctx.opts);
  GatherProposals(ctx);
  NodeTokens(ctx);
  RETURN_IF_ERROR(ForwardTarget(ctx));

  const Verdicts verdicts = VerifyWindows(ctx);
  const NextDrafts next = DrawNextDrafts(ctx, verdicts);
  at::Tensor entropy;
  if (opts.collect_entropy) entropy = -(ctx.p * ctx.p.clamp_min(1e-300).log()).sum(1, true);
  const HostStep host(verdicts, next, entropy, ctx.node_tokens, ctx.max_kids, ctx.tree_k);
  CacheMoves moves;
  for (Sequence* s : ctx.live) CommitWindow(*s, host, ctx, moves);
  MoveCacheEntries(cache, moves);
  prev_p = ctx.p;
  prev_q = ctx.q;
  if (opts.timing != nullptr) {  // the readback has synchronised the device
    opts.timing->steps += 1;
    opts.timing->step_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    opts.timing->step_launches += ThreadLaunches() - l0;
  }
  return OkStatus();
}

StatusOr<std::vector<SpecResult>> GenerateSpeculative(const Gpt& target, const Gpt* draft,
                                                      const std::vector<ImageRequest>& requests,
                                                      SpecOptions opts) {
  int64_t slots = 0;
  for (const auto& r : requests) {
    RETURN_IF_ERROR(ValidateImageRequest(r, target, draft));
    slots += r.sampling.uses_cfg() ? 2 : 1;
  }
  SpecBatch batch(target, draft, std::max<int64_t>(slots, 1), opts);
  std::vector<int64_t> handles;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ImageRequest& r = requests[i];
    int64_t share = -1;
    for (size_t j = 0; j < i && share < 0 && !r.prompt.empty(); ++j) {
      if (SharesPrefill(requests[j], r, target.config())) share = handles[j];
    }
    ASSIGN_OR_RETURN(int64_t h, batch.Add(r, share));
    handles.push_back(h);
  }
  while (batch.active() > 0) RETURN_IF_ERROR(batch.Step());
  std::vector<SpecResult> out;
  for (int64_t h : handles) out.push_back(batch.Take(h));
  return out;
}

}  // namespace imagegen
