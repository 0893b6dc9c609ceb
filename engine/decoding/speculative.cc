#include "engine/decoding/speculative.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "engine/decoding/philox.h"
#include "engine/decoding/sampling.h"

namespace imagegen {
namespace {

struct Node {
  int64_t token = 0;  // input token (the class id for the root of an empty image)
  int64_t col = -1;   // draft column (image token n + col); -1 for the root
  int64_t parent = -1;
  std::vector<int64_t> kids;  // children in candidate order
};

// Where a draft column's q comes from, resolved into one gather at the start of a step.
struct QRef {
  enum Kind { kPrevP, kPrevQ, kDraft, kOneHot, kUniform } kind = kUniform;
  int64_t index = 0;  // row in the previous step's P or Q, this step's draft q, or the token
};

struct Column {
  std::vector<int64_t> cand;  // candidates; cand[0] lies on the main path
  QRef q;
};

struct Req {
  SpecRequest r;
  int64_t slot_c = -1, slot_u = -1;
  std::vector<int64_t> committed;
  std::vector<Column> cols;  // drafts for image tokens n, n + 1, ...
  bool tree_next = false;    // leading columns may carry several candidates
  uint32_t iter = 0;
  int64_t draft_valid = 0;  // valid entries in the draft model's cache
  int64_t gamma = 0;        // drafts made by the draft model this step
  int64_t window_cap = 0;   // scheduler's cap on the window (0: none)
  std::vector<double> cool_w;
  SpecStats stats;
  // Per-step scratch.
  std::vector<Node> nodes;
  std::vector<int64_t> main;  // main-path node of each column (first candidates, then chain)
  int64_t node_off = 0;  // first global node (row of P)
  int64_t q_off = 0;     // first global row of Q (its columns in order)

  bool finished(int64_t N) const { return static_cast<int64_t>(committed.size()) == N; }
  int64_t n() const { return static_cast<int64_t>(committed.size()); }
  int64_t window() const {
    return window_cap > 0 ? std::min(window_cap, r.policy.window) : r.policy.window;
  }
};

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

int64_t DrawToken(double u, int64_t V) {
  return std::min<int64_t>(static_cast<int64_t>(u * static_cast<double>(V)), V - 1);
}

// Rows of `probs` with the ids in `masked` ([R, V] bool) removed and renormalised; rows with no
// mass left are all zero.
at::Tensor RemoveAndNormalise(const at::Tensor& probs, const at::Tensor& masked) {
  at::Tensor r = probs.masked_fill(masked, 0.0);
  at::Tensor tot = r.sum(-1, true);
  return at::where(tot > 0, r / tot.clamp_min(1e-300), at::zeros_like(r));
}

}  // namespace

struct SpecBatch::Impl {
  const Gpt& target;
  const Gpt* draft;
  SpecOptions opts;
  KvCache cache, dcache;
  std::vector<int64_t> free_list;  // free KV slots, lowest last
  std::map<int64_t, Req> reqs;
  int64_t next_handle = 0;
  at::Tensor prev_p, prev_q;  // float64 P and Q of the last step (draft sources)
  at::Tensor emb;             // float64 token embeddings (GSD)

  Impl(const Gpt& t, const Gpt* d, int64_t slots, SpecOptions o)
      : target(t), draft(d), opts(o) {
    for (int64_t s = slots - 1; s >= 0; --s) free_list.push_back(s);
    cache = target.NewCache(slots);
    if (draft != nullptr) dcache = draft->NewCache(slots);
  }

  const GptConfig& cfg() const { return target.config(); }
  at::Device dev() const { return target.options().device; }
  ForwardOptions fwd() const { return {opts.batch_invariant}; }

  Status DraftPhase(std::vector<Req*>& sd, at::Tensor* draft_q);
  void Plan(Req& q);
  Status Step();
};

SpecBatch::SpecBatch(const Gpt& target, const Gpt* draft, int64_t slots, SpecOptions opts)
    : impl_(std::make_unique<Impl>(target, draft, slots, opts)) {}
SpecBatch::~SpecBatch() = default;

Status ValidateSpecRequest(const SpecRequest& r, const Gpt& target, const Gpt* draft) {
  const GptConfig& c = target.config();
  RETURN_IF_ERROR(imagegen::ValidateRequest(r.image, c));
  RETURN_IF_ERROR(ValidatePolicy(r.policy, c.block_size, draft != nullptr));
  if (r.policy.draft == DraftSource::kDraftModel) {
    const GptConfig& d = draft->config();
    if (d.vocab_size != c.vocab_size || d.block_size != c.block_size ||
        d.num_classes != c.num_classes || (r.image.sampling.uses_cfg() && !d.has_null_class())) {
      return FieldError("method", "the draft model does not match the target's vocabulary, "
                                  "grid or classes");
    }
  }
  return OkStatus();
}

Status SpecBatch::ValidateRequest(const SpecRequest& r) const {
  return ValidateSpecRequest(r, impl_->target, impl_->draft);
}

StatusOr<int64_t> SpecBatch::Add(const SpecRequest& request) {
  RETURN_IF_ERROR(ValidateRequest(request));
  const int64_t need = request.image.sampling.uses_cfg() ? 2 : 1;
  if (free_slots() < need) return ResourceExhausted("no free KV-cache slot");
  Req q;
  q.r = request;
  q.slot_c = impl_->free_list.back();
  impl_->free_list.pop_back();
  if (need == 2) {
    q.slot_u = impl_->free_list.back();
    impl_->free_list.pop_back();
  }
  const int64_t h = impl_->next_handle++;
  impl_->reqs.emplace(h, std::move(q));
  return h;
}

int64_t SpecBatch::active() const {
  int64_t a = 0;
  for (const auto& [h, q] : impl_->reqs) a += q.finished(impl_->cfg().block_size) ? 0 : 1;
  return a;
}

int64_t SpecBatch::free_slots() const {
  return static_cast<int64_t>(impl_->free_list.size());
}

bool SpecBatch::done(int64_t handle) const {
  auto it = impl_->reqs.find(handle);
  return it == impl_->reqs.end() || it->second.finished(impl_->cfg().block_size);
}

SpecResult SpecBatch::Take(int64_t handle) {
  SpecResult out;
  auto it = impl_->reqs.find(handle);
  if (it == impl_->reqs.end()) return out;
  for (int64_t t : it->second.committed) out.tokens.push_back(static_cast<int32_t>(t));
  out.stats = std::move(it->second.stats);
  Remove(handle);
  return out;
}

void SpecBatch::SetWindowCap(int64_t handle, int64_t cap) {
  auto it = impl_->reqs.find(handle);
  if (it != impl_->reqs.end()) it->second.window_cap = std::max<int64_t>(cap, 0);
}

int64_t SpecBatch::WantedNodes(int64_t handle) const {
  const Req& q = impl_->reqs.at(handle);
  const int64_t left = impl_->cfg().block_size - q.n();
  if (left <= 0) return 0;
  return q.r.policy.draft == DraftSource::kNone ? 1 : std::min(q.r.policy.window, left);
}

int64_t SpecBatch::RowsPerNode(int64_t handle) const {
  return impl_->reqs.at(handle).slot_u >= 0 ? 2 : 1;
}

const std::vector<int64_t>& SpecBatch::tokens(int64_t handle) const {
  return impl_->reqs.at(handle).committed;
}

const SpecStats& SpecBatch::stats(int64_t handle) const { return impl_->reqs.at(handle).stats; }

std::vector<int64_t> SpecBatch::drafts(int64_t handle) const {
  std::vector<int64_t> out;
  for (const Column& c : impl_->reqs.at(handle).cols) out.push_back(c.cand[0]);
  return out;
}

void SpecBatch::Remove(int64_t handle) {
  auto it = impl_->reqs.find(handle);
  if (it == impl_->reqs.end()) return;
  for (int64_t s : {it->second.slot_c, it->second.slot_u}) {
    if (s >= 0) impl_->free_list.push_back(s);
  }
  impl_->reqs.erase(it);
}

Status SpecBatch::Step() { return impl_->Step(); }

// Draft-model drafting: gamma = min(L - 1, tokens left - 1) autoregressive draft forwards,
// batched over the requests; the first one also feeds committed tokens the draft has not seen.
Status SpecBatch::Impl::DraftPhase(std::vector<Req*>& sd, at::Tensor* draft_q) {
  const int64_t N = cfg().block_size;
  const uint32_t null_cls = static_cast<uint32_t>(draft->config().null_class());
  int64_t gmax = 0;
  for (Req* q : sd) {
    q->cols.clear();
    q->gamma = std::min(q->window() - 1, N - 1 - q->n());
    gmax = std::max(gmax, q->gamma);
  }
  std::vector<at::Tensor> qparts;  // per forward j: [requests drafting at j, V]
  std::vector<at::Tensor> tparts;
  std::vector<std::vector<Req*>> who;
  at::Tensor prev_tokens;  // [requests at j - 1] device
  std::vector<Req*> prev;
  for (int64_t j = 0; j < gmax; ++j) {
    std::vector<Req*> act;
    for (Req* q : sd) {
      if (q->gamma > j) act.push_back(q);
    }
    std::vector<BatchRow> rows;
    std::vector<int64_t> last_c, last_u, tok_src;  // last row of each request; token sources
    std::vector<SamplingParams> sp;
    std::vector<float> scale;
    int64_t off = 0;
    for (Req* q : act) {
      const int64_t n = q->n();
      BatchRow row;
      row.slot = q->slot_c;
      row.group = static_cast<int64_t>(rows.size());
      if (j == 0) {
        row.cache_len = q->draft_valid;
        for (int64_t p = q->draft_valid; p <= n; ++p) {
          row.positions.push_back(p);
          row.tokens.push_back(p == 0 ? q->r.image.class_id : q->committed[p - 1]);
        }
      } else {
        row.cache_len = n + j;
        row.positions = {n + j};
        row.tokens = {0};
        const auto idx = std::find(prev.begin(), prev.end(), q) - prev.begin();
        tok_src.push_back(idx);
        if (q->slot_u >= 0) tok_src.push_back(idx);
      }
      const auto len = static_cast<int64_t>(row.tokens.size());
      rows.push_back(row);
      last_c.push_back(off + len - 1);
      off += len;
      if (q->slot_u >= 0) {
        row.slot = q->slot_u;
        if (j == 0 && row.positions[0] == 0) row.tokens[0] = null_cls;
        rows.push_back(row);
        last_u.push_back(off + len - 1);
        off += len;
      } else {
        last_u.push_back(off - 1);
      }
      sp.push_back(q->r.image.sampling);
      scale.push_back(q->r.image.sampling.uses_cfg()
                          ? static_cast<float>(q->r.image.sampling.cfg_scale)
                          : 1.0f);
    }
    at::Tensor dev_tokens;
    if (j > 0) dev_tokens = prev_tokens.index_select(0, at::tensor(tok_src, at::kLong).to(dev()));
    ASSIGN_OR_RETURN(at::Tensor logits, draft->Forward(rows, dcache, dev_tokens, fwd()));
    at::Tensor c = logits.index_select(0, at::tensor(last_c, at::kLong).to(dev()));
    at::Tensor u = logits.index_select(0, at::tensor(last_u, at::kLong).to(dev()));
    at::Tensor probs = FinalProbs(CfgCombine(c, u, at::tensor(scale).to(dev())), sp).to(at::kDouble);
    std::vector<double> us;
    for (Req* q : act) {
      us.push_back(Uniform(q->r.image.seed, static_cast<uint32_t>(q->n() + j), q->iter,
                           Purpose::kDraft));
      q->stats.draft_forwards += 1;
    }
    prev_tokens = SampleInverseCdf(probs, at::tensor(us));
    prev = act;
    qparts.push_back(probs);
    tparts.push_back(prev_tokens);
    who.push_back(act);
  }
  if (gmax == 0) return OkStatus();
  // One read of all drafted tokens; q rows are referenced in the concatenated draft q.
  at::Tensor all_tokens = at::cat(tparts).cpu();
  auto tk = all_tokens.accessor<int64_t, 1>();
  int64_t row = 0;
  for (size_t j = 0; j < who.size(); ++j) {
    for (Req* q : who[j]) {
      Column col;
      col.cand = {tk[row]};
      col.q = {QRef::kDraft, row};
      q->cols.push_back(col);
      ++row;
    }
  }
  *draft_q = at::cat(qparts);
  return OkStatus();
}

// Lays out one request's window: root, tree levels (Cartesian product of the leading columns'
// candidates), chain. Node i is written to cache index n + i, so the main path (first
// candidates, then the chain) comes first and needs no KV move when it is accepted.
void SpecBatch::Impl::Plan(Req& q) {
  const GptConfig& c = cfg();
  const int64_t N = c.block_size, V = c.vocab_size, n = q.n();
  const DecodingPolicy& p = q.r.policy;
  const int64_t avail = N - n, budget = std::min(q.window(), avail), maxcols = avail - 1;
  int64_t T = 0, tree_nodes = 0;
  if (p.draft == DraftSource::kNone) {
    q.cols.clear();
  } else if (p.draft == DraftSource::kJacobi) {
    if (p.has_tree() && q.tree_next) {
      while (T < static_cast<int64_t>(q.cols.size()) && T < p.tree_depth - 1 &&
             q.cols[T].cand.size() > 1) {
        ++T;
      }
    }
    int64_t prod = 1;
    for (int64_t j = 0; j < T; ++j) {
      const auto k = static_cast<int64_t>(q.cols[j].cand.size());
      if (j >= maxcols || tree_nodes + prod * k > budget - 1) {
        T = j;
        break;
      }
      prod *= k;
      tree_nodes += prod;
    }
    for (size_t j = static_cast<size_t>(T); j < q.cols.size(); ++j) q.cols[j].cand.resize(1);
    const int64_t ncols = T + std::max<int64_t>(0, std::min(budget - 1 - tree_nodes, maxcols - T));
    if (static_cast<int64_t>(q.cols.size()) > ncols) q.cols.resize(static_cast<size_t>(ncols));
    while (static_cast<int64_t>(q.cols.size()) < ncols) {
      const auto t = static_cast<uint32_t>(n + static_cast<int64_t>(q.cols.size()));
      Column col;
      const int64_t tok = DrawToken(Uniform(q.r.image.seed, t, q.iter, Purpose::kDraftInit), V);
      col.cand = {tok};
      col.q = p.uniform_init_q ? QRef{QRef::kUniform, 0} : QRef{QRef::kOneHot, tok};
      q.cols.push_back(col);
    }
    if (p.acceptance == Acceptance::kRelaxed) {
      q.cool_w = CoolWeights(p.cool_delta, p.cool_nu, ncols);
    }
  } else if (p.acceptance == Acceptance::kRelaxed) {  // draft model: columns from DraftPhase
    q.cool_w = CoolWeights(p.cool_delta, p.cool_nu, static_cast<int64_t>(q.cols.size()));
  }

  const auto ncols = static_cast<int64_t>(q.cols.size());
  q.nodes.clear();
  Node root;
  root.token = n == 0 ? q.r.image.class_id : q.committed.back();
  q.nodes.push_back(root);
  std::vector<int64_t>& main = q.main;
  main.assign(static_cast<size_t>(ncols), 0);
  for (int64_t j = 0; j < ncols; ++j) {
    Node nd;
    nd.col = j;
    nd.token = q.cols[j].cand[0];
    nd.parent = j == 0 ? 0 : main[j - 1];
    main[j] = static_cast<int64_t>(q.nodes.size());
    q.nodes.push_back(nd);
  }
  std::vector<int64_t> level = {0};
  for (int64_t j = 0; j < T; ++j) {
    std::vector<int64_t> next;
    for (int64_t par : level) {
      const bool on_main = par == (j == 0 ? 0 : main[j - 1]);
      for (size_t k = 0; k < q.cols[j].cand.size(); ++k) {
        int64_t id;
        if (on_main && k == 0) {
          id = main[j];
        } else {
          Node nd;
          nd.col = j;
          nd.token = q.cols[j].cand[k];
          nd.parent = par;
          id = static_cast<int64_t>(q.nodes.size());
          q.nodes.push_back(nd);
        }
        q.nodes[par].kids.push_back(id);
        next.push_back(id);
      }
    }
    level = std::move(next);
  }
  for (int64_t j = T; j < ncols; ++j) q.nodes[j == 0 ? 0 : main[j - 1]].kids.push_back(main[j]);
}

Status SpecBatch::Impl::Step() {
  const GptConfig& c = cfg();
  const int64_t N = c.block_size, V = c.vocab_size;
  std::vector<Req*> live, sd;
  for (auto& [h, q] : reqs) {
    if (q.finished(N)) continue;
    live.push_back(&q);
    if (q.r.policy.draft == DraftSource::kDraftModel) sd.push_back(&q);
  }
  if (live.empty()) return OkStatus();
  at::Tensor draft_q;
  if (!sd.empty()) RETURN_IF_ERROR(DraftPhase(sd, &draft_q));
  for (Req* q : live) Plan(*q);

  // Q: one gather for every column of every request.
  std::vector<int64_t> onehot_tokens;
  std::vector<QRef> refs;
  int64_t A = 0, Kmax = 1, Kfresh = 1;
  for (Req* q : live) {
    q->node_off = A;
    A += static_cast<int64_t>(q->nodes.size());
    q->q_off = static_cast<int64_t>(refs.size());
    for (const Column& col : q->cols) refs.push_back(col.q);
    for (const Node& nd : q->nodes) Kmax = std::max<int64_t>(Kmax, static_cast<int64_t>(nd.kids.size()));
    if (q->r.policy.has_tree()) Kfresh = std::max(Kfresh, q->r.policy.tree_branches);
  }
  const auto fopt = at::TensorOptions().dtype(at::kDouble).device(dev());
  at::Tensor Qall;
  if (!refs.empty()) {
    const int64_t np = prev_p.defined() ? prev_p.size(0) : 0;
    const int64_t nq = prev_q.defined() ? prev_q.size(0) : 0;
    const int64_t nd = draft_q.defined() ? draft_q.size(0) : 0;
    std::vector<at::Tensor> parts;
    if (np > 0) parts.push_back(prev_p);
    if (nq > 0) parts.push_back(prev_q);
    if (nd > 0) parts.push_back(draft_q);
    std::vector<int64_t> src;
    int64_t n_onehot = 0;
    for (const QRef& r : refs) n_onehot += r.kind == QRef::kOneHot ? 1 : 0;
    const int64_t base_oh = np + nq + nd, uni = base_oh + n_onehot;
    int64_t oh = 0;
    for (const QRef& r : refs) {
      switch (r.kind) {
        case QRef::kPrevP: src.push_back(r.index); break;
        case QRef::kPrevQ: src.push_back(np + r.index); break;
        case QRef::kDraft: src.push_back(np + nq + r.index); break;
        case QRef::kOneHot: src.push_back(base_oh + oh++); onehot_tokens.push_back(r.index); break;
        case QRef::kUniform: src.push_back(uni); break;
      }
    }
    if (n_onehot > 0) {
      parts.push_back(at::one_hot(at::tensor(onehot_tokens, at::kLong).to(dev()), V).to(at::kDouble));
    }
    parts.push_back(at::full({1, V}, 1.0 / static_cast<double>(V), fopt));
    Qall = at::cat(parts).index_select(0, at::tensor(src, at::kLong).to(dev()));
  } else {
    Qall = at::zeros({1, V}, fopt);
  }

  // The target forward: every request's nodes, conditional and unconditional rows.
  std::vector<BatchRow> rows;
  std::vector<int64_t> cidx, uidx;
  std::vector<float> scale;
  std::vector<SamplingParams> sp;
  int64_t off = 0;
  for (Req* q : live) {
    const int64_t n = q->n(), m = static_cast<int64_t>(q->nodes.size());
    BatchRow row;
    row.slot = q->slot_c;
    row.group = static_cast<int64_t>(rows.size());
    row.cache_len = n;
    bool chain = true;
    for (int64_t i = 0; i < m; ++i) {
      const Node& nd = q->nodes[i];
      row.tokens.push_back(nd.token);
      row.positions.push_back(n + nd.col + 1);
      chain &= nd.parent == i - 1;
    }
    if (!chain) {
      row.mask.assign(static_cast<size_t>(m * m), 0);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t a = i; a >= 0; a = q->nodes[a].parent) row.mask[i * m + a] = 1;
      }
    }
    rows.push_back(row);
    for (int64_t i = 0; i < m; ++i) cidx.push_back(off + i);
    off += m;
    if (q->slot_u >= 0) {
      row.slot = q->slot_u;
      if (n == 0) row.tokens[0] = c.null_class();
      rows.push_back(row);
      for (int64_t i = 0; i < m; ++i) uidx.push_back(off + i);
      off += m;
    } else {
      for (int64_t i = 0; i < m; ++i) uidx.push_back(off - m + i);
    }
    const SamplingParams& s = q->r.image.sampling;
    for (int64_t i = 0; i < m; ++i) {
      sp.push_back(s);
      scale.push_back(s.uses_cfg() ? static_cast<float>(s.cfg_scale) : 1.0f);
    }
  }
  ASSIGN_OR_RETURN(at::Tensor logits, target.Forward(rows, cache, at::Tensor(), fwd()));
  at::Tensor g = CfgCombine(logits.index_select(0, at::tensor(cidx, at::kLong).to(dev())),
                            logits.index_select(0, at::tensor(uidx, at::kLong).to(dev())),
                            at::tensor(scale).to(dev()));
  at::Tensor P = FinalProbs(g, sp).to(at::kDouble);  // [A, V]

  // Per-node inputs of the batched verification, built on the host.
  std::vector<int64_t> qrow(A, 0), kid(A * Kmax, -1);
  std::vector<double> w(A, 1.0), uacc(A * Kmax, 0.0), ures(A, 0.0), ufresh(A * Kfresh, 0.0);
  std::vector<uint8_t> has_q(A, 0), base_y(A, 0);
  std::vector<int64_t> grouped_nodes, gumbel_nodes, gsd_g;
  std::vector<double> gsd_delta, gsd_dist;
  std::vector<double> gumbel_u;
  for (Req* q : live) {
    const DecodingPolicy& p = q->r.policy;
    const uint64_t seed = q->r.image.seed;
    for (size_t i = 0; i < q->nodes.size(); ++i) {
      const Node& nd = q->nodes[i];
      const int64_t a = q->node_off + static_cast<int64_t>(i);
      const int64_t col = nd.col + 1;  // the column this node's output predicts
      const auto t = static_cast<uint32_t>(q->n() + col);
      ures[a] = Uniform(seed, t, q->iter, Purpose::kResample);
      base_y[a] = p.coupling == Coupling::kMaximal ? 1 : 0;
      if (p.coupling == Coupling::kGumbel) {
        gumbel_nodes.push_back(a);
        for (int64_t v = 0; v < V; ++v) {
          gumbel_u.push_back(Uniform(seed, t, 0, Purpose::kGumbel, static_cast<uint32_t>(v)));
        }
      } else {
        for (int64_t k = 0; k < Kfresh; ++k) {
          ufresh[a * Kfresh + k] = Uniform(seed, t, q->iter, Purpose::kDraft, static_cast<uint32_t>(k));
        }
      }
      if (nd.kids.empty()) continue;
      has_q[a] = 1;
      qrow[a] = q->q_off + col;
      for (size_t k = 0; k < nd.kids.size(); ++k) {
        kid[a * Kmax + static_cast<int64_t>(k)] = q->nodes[nd.kids[k]].token;
        uacc[a * Kmax + static_cast<int64_t>(k)] =
            Uniform(seed, t, q->iter, Purpose::kAccept, static_cast<uint32_t>(k));
      }
      if (p.acceptance == Acceptance::kRelaxed) w[a] = q->cool_w[static_cast<size_t>(col)];
      if (p.acceptance == Acceptance::kGrouped) {
        grouped_nodes.push_back(a);
        gsd_g.push_back(std::min<int64_t>(p.gsd_group, V));
        gsd_delta.push_back(p.gsd_delta);
        gsd_dist.push_back(p.gsd_distance);
      }
    }
  }
  auto T64 = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(dev()); };
  auto TD = [&](const std::vector<double>& v) { return at::tensor(v, at::kDouble).to(dev()); };
  at::Tensor kids_t = T64(kid).view({A, Kmax});
  at::Tensor uacc_t = TD(uacc).view({A, Kmax});
  at::Tensor w_t = TD(w);
  at::Tensor Qa = Qall.index_select(0, T64(qrow));

  // Sequential sibling verification at every node (a chain is the case K = 1).
  at::Tensor pk = P.clone();
  at::Tensor removed = at::zeros({A, V}, at::TensorOptions().dtype(at::kBool).device(dev()));
  std::vector<at::Tensor> acc_cols;
  for (int64_t k = 0; k < Kmax; ++k) {
    at::Tensor xk = kids_t.select(1, k);
    at::Tensor valid = xk >= 0;
    at::Tensor x = xk.clamp_min(0).unsqueeze(1);
    at::Tensor qk = RemoveAndNormalise(Qa, removed);
    at::Tensor wk = k == 0 ? w_t : at::ones_like(w_t);
    at::Tensor px = pk.gather(1, x).squeeze(1), qx = qk.gather(1, x).squeeze(1);
    at::Tensor ratio = at::where(qx > 0, wk * px / qx.clamp_min(1e-300), (px > 0).to(at::kDouble));
    if (k == 0 && !grouped_nodes.empty()) {
      // GSD: the cluster of ids around x in p-sorted order, filtered by probability gap and
      // embedding distance; accepted on the cluster masses (seed 004 Alg. 3).
      if (!emb.defined()) emb = target.token_embeddings().to(at::kDouble);
      at::Tensor gi = T64(grouped_nodes);
      at::Tensor pg = P.index_select(0, gi), qg = Qa.index_select(0, gi);
      at::Tensor xg = x.index_select(0, gi).squeeze(1);
      const int64_t G = *std::max_element(gsd_g.begin(), gsd_g.end());
      at::Tensor order = pg.argsort(int64_t{1});  // ascending, as the authors' code
      at::Tensor rank = order.argsort(int64_t{1}).gather(1, xg.unsqueeze(1));  // [Ag, 1]
      at::Tensor offs = at::arange(-(G / 2), G - G / 2, at::TensorOptions().dtype(at::kLong).device(dev()))
                            .unsqueeze(0);
      at::Tensor gn = T64(gsd_g).unsqueeze(1);
      at::Tensor rk = rank + offs;
      // Each node's own G: ranks r - G/2 .. r + G - G/2 - 1 (7 below, 6 above for G = 14).
      at::Tensor in = (rk >= 0) & (rk < V) & (offs >= -at::floor_divide(gn, 2)) &
                      (offs < gn - at::floor_divide(gn, 2));
      at::Tensor ids = order.gather(1, rk.clamp(0, V - 1));
      at::Tensor pids = pg.gather(1, ids), qids = qg.gather(1, ids);
      at::Tensor pxg = pg.gather(1, xg.unsqueeze(1));
      at::Tensor ex = emb.index_select(0, xg).unsqueeze(1);
      at::Tensor ej = emb.index_select(0, ids.reshape(-1)).view({ids.size(0), G, -1});
      at::Tensor dist = (ej - ex).pow(2).sum(-1);
      at::Tensor keep = in & ((pids - pxg).abs() < TD(gsd_delta).unsqueeze(1)) &
                        (dist < TD(gsd_dist).unsqueeze(1));
      at::Tensor num = (pids * keep).sum(1), den = (qids * keep).sum(1);
      at::Tensor gr = at::where(den > 0, num / den.clamp_min(1e-300), (num > 0).to(at::kDouble));
      ratio = ratio.index_copy(0, gi, gr);
    }
    at::Tensor acc = valid & (uacc_t.select(1, k) < ratio.clamp_max(1.0));
    if (opts.broken_accept_always) acc = valid;
    acc_cols.push_back(acc);
    at::Tensor r = (pk - at::minimum(qk, wk.unsqueeze(1) * pk)).clamp_min(0);
    at::Tensor tot = r.sum(1, true);
    at::Tensor pnext = at::where(tot > 0, r / tot.clamp_min(1e-300), pk);
    pk = at::where(valid.unsqueeze(1), pnext, pk);
    removed = removed | (at::one_hot(x.squeeze(1), V).to(at::kBool) & valid.unsqueeze(1));
  }
  at::Tensor acc = at::stack(acc_cols, 1);                 // [A, Kmax]
  at::Tensor Z = SampleInverseCdf(pk, TD(ures));           // final residual, or bonus at leaves
  at::Tensor any = acc.any(1);
  at::Tensor first = acc.to(at::kByte).argmax(1, true);
  at::Tensor Y = at::where(any, kids_t.gather(1, first).squeeze(1), Z);

  // Fresh draws and extra tree candidates, drawn without replacement from P.
  at::Tensor F = at::zeros({A}, at::TensorOptions().dtype(at::kLong).device(dev()));
  at::Tensor E = at::full({A, Kfresh - 1}, -1, F.options());
  {
    at::Tensor uf = TD(ufresh).view({A, Kfresh});
    at::Tensor f0 = SampleInverseCdf(P, uf.select(1, 0));
    at::Tensor b = at::where(T64(std::vector<int64_t>(base_y.begin(), base_y.end())) > 0, Y, f0);
    F = f0;
    if (Kfresh > 1) {
      at::Tensor mask = at::one_hot(b, V).to(at::kBool);
      for (int64_t k = 1; k < Kfresh; ++k) {
        at::Tensor pm = RemoveAndNormalise(P, mask);
        at::Tensor ok = pm.sum(1) > 0;
        at::Tensor e = at::where(ok, SampleInverseCdf(pm, uf.select(1, k)), at::full_like(b, -1));
        E.select(1, k - 1).copy_(e);
        mask = mask | (at::one_hot(e.clamp_min(0), V).to(at::kBool) & ok.unsqueeze(1));
      }
    }
    if (!gumbel_nodes.empty()) {
      at::Tensor gi = T64(gumbel_nodes);
      const auto Ag = static_cast<int64_t>(gumbel_nodes.size());
      at::Tensor gu = TD(gumbel_u).view({Ag, V}).clamp(1e-300, 1.0 - 1e-16);
      at::Tensor keys = P.index_select(0, gi).log() - (-gu.log()).log();
      auto [vals, top] = keys.topk(Kfresh, 1);
      F = F.index_copy(0, gi, top.select(1, 0));
      if (Kfresh > 1) {
        at::Tensor ex = at::where(vals.narrow(1, 1, Kfresh - 1) > kNegInf,
                                  top.narrow(1, 1, Kfresh - 1), at::full_like(top.narrow(1, 1, Kfresh - 1), -1));
        E = E.index_copy(0, gi, ex);
      }
    }
  }
  std::vector<at::Tensor> pack = {acc.to(at::kDouble), Z.unsqueeze(1).to(at::kDouble),
                                  Y.unsqueeze(1).to(at::kDouble), F.unsqueeze(1).to(at::kDouble)};
  if (Kfresh > 1) pack.push_back(E.to(at::kDouble));
  if (opts.collect_entropy) {
    pack.push_back(-(P * P.clamp_min(1e-300).log()).sum(1, true));
  }
  at::Tensor host = at::cat(pack, 1).cpu();  // the step's only device-to-host read
  auto h = host.accessor<double, 2>();
  const int64_t cZ = Kmax, cY = Kmax + 1, cF = Kmax + 2, cE = Kmax + 3, cH = cE + Kfresh - 1;

  // Host walk of every window.
  for (Req* q : live) {
    const DecodingPolicy& p = q->r.policy;
    const int64_t n = q->n(), off0 = q->node_off;
    const auto step = static_cast<int32_t>(q->stats.nfe);
    q->stats.nfe += 1;
    auto commit = [&](int64_t tok, int64_t a) {
      q->committed.push_back(tok);
      q->stats.token_step.push_back(step);
      if (opts.collect_entropy) {
        q->stats.entropy_sum += h[a][cH];
        q->stats.entropy_count += 1;
      }
    };
    std::vector<int64_t> path;  // accepted nodes, in order
    std::vector<Column> next;
    bool frontier = false, rejected = false;
    const bool maximal = p.coupling == Coupling::kMaximal;
    int64_t a = 0;
    while (true) {
      const Node& nd = q->nodes[a];
      const int64_t ga = off0 + a;
      const auto nk = static_cast<int64_t>(nd.kids.size());
      int64_t kstar = -1;
      const auto depth = static_cast<size_t>(path.size());  // 0-based draft depth of the kids
      if (!frontier && nk > 0 && q->stats.verified_at_depth.size() <= depth) {
        q->stats.verified_at_depth.resize(depth + 1, 0);
        q->stats.accepted_at_depth.resize(depth + 1, 0);
      }
      for (int64_t k = 0; k < nk; ++k) {
        if (!frontier) {
          q->stats.drafts_verified += 1;
          q->stats.verified_at_depth[depth] += 1;
        }
        if (h[ga][k] > 0.5) {
          kstar = k;
          break;
        }
      }
      if (!frontier) {
        if (kstar >= 0) {
          q->stats.drafts_accepted += 1;
          q->stats.accepted_at_depth[depth] += 1;
          a = nd.kids[kstar];
          commit(q->nodes[a].token, ga);
          path.push_back(a);
          continue;
        }
        commit(static_cast<int64_t>(h[ga][cZ]), ga);
        frontier = true;
        rejected = nk > 0;
        if (p.draft != DraftSource::kJacobi) break;
      } else {
        // After the first rejection: this node's output becomes the next column's draft.
        Column col;
        col.cand = {static_cast<int64_t>(maximal ? h[ga][cY] : h[ga][cF])};
        col.q = {QRef::kPrevP, ga};
        if (maximal && kstar >= 0 && opts.broken_mc_keeps_old_q) {
          col.q = {QRef::kPrevQ, q->q_off + nd.col + 1};
        }
        if (p.has_tree() && rejected && static_cast<int64_t>(next.size()) < p.tree_depth - 1) {
          for (int64_t k = 0; k + 1 < p.tree_branches; ++k) {
            const auto e = static_cast<int64_t>(h[ga][cE + k]);
            if (e >= 0) col.cand.push_back(e);
          }
        }
        next.push_back(col);
      }
      // On to the node at the next column on this path: the kept child (maximal coupling),
      // else the first candidate; past the end of a tree branch, the main path's node there
      // (its P is stale context, which is all a draft distribution needs to be).
      if (nk > 0) {
        a = maximal && kstar >= 0 ? nd.kids[kstar] : nd.kids[0];
      } else if (nd.col + 1 < static_cast<int64_t>(q->main.size())) {
        a = q->main[nd.col + 1];
      } else {
        break;
      }
    }
    q->stats.step_tokens.push_back(static_cast<int32_t>(q->n() - n));
    // Make the accepted path contiguous in the KV cache (nodes sit at n + node index).
    size_t first_bad = 0;
    while (first_bad < path.size() && path[first_bad] == static_cast<int64_t>(first_bad) + 1) ++first_bad;
    if (first_bad < path.size()) {
      std::vector<int64_t> from;
      for (size_t i = first_bad; i < path.size(); ++i) from.push_back(n + path[i]);
      for (int64_t s : {q->slot_c, q->slot_u}) {
        if (s >= 0) MoveCacheEntries(cache, s, from, n + static_cast<int64_t>(first_bad) + 1);
      }
    }
    if (p.draft == DraftSource::kDraftModel && q->gamma > 0) {
      q->draft_valid = std::min(n + static_cast<int64_t>(path.size()) + 1, n + q->gamma);
    }
    q->cols = std::move(next);
    q->tree_next = rejected && p.has_tree();
    q->iter += 1;
  }
  prev_p = P;
  prev_q = Qall;
  return OkStatus();
}

StatusOr<std::vector<SpecResult>> GenerateSpeculative(const Gpt& target, const Gpt* draft,
                                                      const std::vector<SpecRequest>& requests,
                                                      SpecOptions opts) {
  int64_t slots = 0;
  for (const auto& r : requests) slots += r.image.sampling.uses_cfg() ? 2 : 1;
  SpecBatch batch(target, draft, std::max<int64_t>(slots, 1), opts);
  std::vector<int64_t> handles;
  for (const auto& r : requests) {
    ASSIGN_OR_RETURN(int64_t h, batch.Add(r));
    handles.push_back(h);
  }
  while (batch.active() > 0) RETURN_IF_ERROR(batch.Step());
  std::vector<SpecResult> out;
  for (int64_t h : handles) out.push_back(batch.Take(h));
  return out;
}

}  // namespace imagegen
