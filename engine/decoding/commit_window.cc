// ReadBack (HostStep) and CommitWindow: each request walks its window on the host (a few
// integer comparisons per node), commits the accepted drafts and the token of the first node
// with no accepted child, keeps what follows as the next window's drafts (with q = the P row
// they were drawn from), and makes the accepted path contiguous in its KV cache.
//
// After the first rejection the next drafts are, per coupling:
//   independent: fresh draws from the stale P rows along the first-candidate path;
//   maximal:     the walk goes on, every later node keeping its accepted child or drawing its
//                residual (SCD-MC = SJD-PAC adaptive continuation), following the kept child
//                (or the first candidate after a resample);
//   gumbel:      the Gumbel draws of DrawNextDrafts.
// With a tree the first tree_depth - 1 of these columns also get K - 1 extra candidates.
#include <ATen/ATen.h>

#include "engine/decoding/step_phases.h"
#include "engine/model/transfer.h"

namespace imagegen {
namespace {

at::Tensor Pack(const Verdicts& v, const NextDrafts& d, const at::Tensor& entropy,
                const at::Tensor& node_tokens, int64_t tree_k) {
  // The fused verification's own rows (its drafts included), where they are all there is to
  // read.
  const int64_t kids = v.accepted.size(1);
  if (v.packed.defined() && d.fresh.is_same(v.fresh) && !entropy.defined() &&
      node_tokens.defined() == (v.packed.size(1) == kids + tree_k + 3)) {
    return ReadBack(v.packed);  // the step's only device-to-host read
  }
  std::vector<at::Tensor> pack = {
      v.accepted.to(at::kDouble), v.residual.unsqueeze(1).to(at::kDouble),
      v.kept.unsqueeze(1).to(at::kDouble), d.fresh.unsqueeze(1).to(at::kDouble)};
  if (tree_k > 1) pack.push_back(d.extra.to(at::kDouble));
  if (entropy.defined()) pack.push_back(entropy);
  if (node_tokens.defined()) {
    pack.push_back(node_tokens.narrow(0, 0, v.residual.size(0)).unsqueeze(1).to(at::kDouble));
  }
  return ReadBack(at::cat(pack, 1));  // the step's only device-to-host read
}

// The walk's state for one request.
struct Walk {
  Walk(Sequence& seq, const HostStep& host, const StepContext& c)
      : s(seq), h(host), ctx(c), n(seq.n()) {}
  Sequence& s;
  const HostStep& h;
  const StepContext& ctx;
  int64_t n;                  // committed tokens before the step
  std::vector<int64_t> path;  // accepted nodes, in order
  std::vector<Column> next;   // the next window's drafts
  bool frontier = false, rejected = false;

  void Commit(int64_t tok, int64_t ga) {
    s.committed.push_back(tok);
    s.stats.token_step.push_back(static_cast<int32_t>(s.stats.nfe - 1));
    if (ctx.opts.collect_entropy) {
      s.stats.entropy_sum += h.entropy(ga);
      s.stats.entropy_count += 1;
    }
  }
  // Verification of node a's children before the first rejection: counts, commits. Returns
  // the accepted child's index, or -1 (then the node's residual has been committed).
  int64_t Accept(int64_t a);
  // After the first rejection: node a's output becomes the next column's draft(s).
  void Propose(int64_t a, int64_t kstar);
  void Run();
};

int64_t Walk::Accept(int64_t a) {
  const Node& nd = s.nodes[a];
  const int64_t ga = s.node_off + a;
  const auto nk = static_cast<int64_t>(nd.kids.size());
  const auto depth = path.size();  // 0-based draft depth of the kids
  if (nk > 0 && s.stats.verified_at_depth.size() <= depth) {
    s.stats.verified_at_depth.resize(depth + 1, 0);
    s.stats.accepted_at_depth.resize(depth + 1, 0);
  }
  for (int64_t k = 0; k < nk; ++k) {
    s.stats.drafts_verified += 1;
    s.stats.verified_at_depth[depth] += 1;
    if (h.accepted(ga, k)) {
      s.stats.drafts_accepted += 1;
      s.stats.accepted_at_depth[depth] += 1;
      const int64_t kid = nd.kids[k];
      Commit(h.has_tokens() ? h.token(s.node_off + kid) : s.nodes[kid].token, ga);
      path.push_back(nd.kids[k]);
      return k;
    }
  }
  Commit(h.residual(ga), ga);
  rejected = nk > 0;
  return -1;
}

void Walk::Propose(int64_t a, int64_t kstar) {
  const DecodingPolicy& p = s.r.policy;
  const int64_t ga = s.node_off + a;
  const bool maximal = p.coupling == Coupling::kMaximal;
  Column col;
  col.cand = {maximal ? h.kept(ga) : h.fresh(ga)};
  col.q = {ProposalRef::kPrevP, ga};
  if (maximal && kstar >= 0 && !ctx.rules.KeptDraftFollowsP()) {
    col.q = {ProposalRef::kPrevQ, s.q_off + s.nodes[a].col + 1};
  }
  if (p.has_tree() && rejected && static_cast<int64_t>(next.size()) < p.tree_depth - 1) {
    for (int64_t k = 0; k + 1 < p.tree_branches; ++k) {
      if (const int64_t e = h.extra(ga, k); e >= 0) col.cand.push_back(e);
    }
  }
  next.push_back(col);
}

void Walk::Run() {
  const bool maximal = s.r.policy.coupling == Coupling::kMaximal;
  int64_t a = 0;
  while (true) {
    const Node& nd = s.nodes[a];
    int64_t kstar = -1;
    if (!frontier) {
      kstar = Accept(a);
      if (kstar >= 0) {
        a = nd.kids[kstar];
        continue;
      }
      frontier = true;
      if (s.r.policy.draft != DraftSource::kJacobi) break;
    } else {
      for (int64_t k = 0; k < static_cast<int64_t>(nd.kids.size()) && kstar < 0; ++k) {
        if (h.accepted(s.node_off + a, k)) kstar = k;
      }
      Propose(a, kstar);
    }
    // On to the node at the next column on this path: the kept child (maximal coupling),
    // else the first candidate; past the end of a tree branch, the main path's node there
    // (its P is stale context, which is all a draft distribution needs to be).
    if (!nd.kids.empty()) {
      a = maximal && kstar >= 0 ? nd.kids[kstar] : nd.kids[0];
    } else if (nd.col + 1 < static_cast<int64_t>(s.main.size())) {
      a = s.main[nd.col + 1];
    } else {
      break;
    }
  }
}

// Nodes sit at cache index n + node (n: the root's index); the accepted path moves to n + 1,
// n + 2, ...
void CompactKv(const Sequence& s, int64_t n, const std::vector<int64_t>& path, const KvCache& cache,
               CacheMoves& moves) {
  size_t first_bad = 0;
  while (first_bad < path.size() && path[first_bad] == static_cast<int64_t>(first_bad) + 1) {
    ++first_bad;
  }
  if (first_bad == path.size()) return;
  std::vector<int64_t> from;
  for (size_t i = first_bad; i < path.size(); ++i) from.push_back(n + path[i]);
  for (int64_t slot : {s.slot_c, s.slot_u}) {
    if (slot >= 0) moves.Add(cache, slot, from, n + static_cast<int64_t>(first_bad) + 1);
  }
}

}  // namespace

HostStep::HostStep(const Verdicts& v, const NextDrafts& d, const at::Tensor& entropy,
                   const at::Tensor& node_tokens, int64_t max_kids, int64_t tree_k)
    : host_(Pack(v, d, entropy, node_tokens, tree_k)),
      h_(host_.accessor<double, 2>()),
      max_kids_(max_kids),
      tree_k_(tree_k),
      token_col_(node_tokens.defined() ? host_.size(1) - 1 : -1) {}

void CommitWindow(Sequence& s, const HostStep& h, const StepContext& ctx, CacheMoves& moves) {
  const int64_t n = s.n(), root = s.root_pos();
  s.stats.nfe += 1;
  Walk walk(s, h, ctx);
  walk.Run();
  s.stats.step_tokens.push_back(static_cast<int32_t>(s.n() - n));
  CompactKv(s, root, walk.path, ctx.cache, moves);
  if (s.r.policy.draft == DraftSource::kDraftModel && s.gamma > 0) {
    s.draft_valid = std::min(root + static_cast<int64_t>(walk.path.size()) + 1, root + s.gamma);
  }
  s.cols = std::move(walk.next);
  // The window's last node proposed the token the first kept cut draft was for (or it was
  // committed): the rest follow the new columns.
  if (!s.cut.empty()) s.cut.erase(s.cut.begin());
  if (s.finished(ctx.cfg().block_size)) s.cut.clear();
  s.tree_next = walk.rejected && s.r.policy.has_tree();
  s.iter += 1;
}

}  // namespace imagegen
