// PlanWindow: the nodes a request feeds the target this step. Node i is written to cache index
// n + i, so the main path (first candidates, then the chain) comes first and needs no KV move
// when it is accepted; the extra tree candidates follow.
#include <ATen/ATen.h>

#include "engine/decoding/philox.h"
#include "engine/decoding/step_phases.h"

namespace imagegen {
namespace {

int64_t DrawToken(double u, int64_t V) {
  return std::min<int64_t>(static_cast<int64_t>(u * static_cast<double>(V)), V - 1);
}

// Trims or extends a Jacobi request's columns to its window; returns T, the leading columns
// that keep several candidates (the proactive tree), and sets *tree_nodes.
int64_t PlanJacobiColumns(Sequence& s, int64_t V, int64_t budget, int64_t maxcols,
                          const SpecOptions& opts, int64_t* tree_nodes) {
  const DecodingPolicy& p = s.r.policy;
  const bool keep = opts.keep_cut_drafts && p.coupling != Coupling::kGumbel;
  int64_t T = 0;
  if (p.has_tree() && s.tree_next) {
    while (T < static_cast<int64_t>(s.cols.size()) && T < p.tree_depth - 1 &&
           s.cols[T].cand.size() > 1) {
      ++T;
    }
  }
  int64_t prod = 1;
  *tree_nodes = 0;
  for (int64_t j = 0; j < T; ++j) {
    const auto k = static_cast<int64_t>(s.cols[j].cand.size());
    if (j >= maxcols || *tree_nodes + prod * k > budget - 1) {
      T = j;
      break;
    }
    prod *= k;
    *tree_nodes += prod;
  }
  for (size_t j = static_cast<size_t>(T); j < s.cols.size(); ++j) s.cols[j].cand.resize(1);
  const int64_t ncols = T + std::max<int64_t>(0, std::min(budget - 1 - *tree_nodes, maxcols - T));
  if (static_cast<int64_t>(s.cols.size()) > ncols) {
    if (keep) {  // the cut drafts go in front of those cut before
      // A random initial draft keeps its q; one drawn from this step's P or Q becomes
      // one-hot (those rows are gone after the step).
      for (auto c = s.cols.begin() + ncols; c != s.cols.end(); ++c) {
        if (c->q.kind == ProposalRef::kOneHot || c->q.kind == ProposalRef::kUniform) continue;
        c->q = opts.testing_cut_drafts_with_initial_q && p.uniform_init_q
                   ? ProposalRef{ProposalRef::kUniform, 0}
                   : ProposalRef{ProposalRef::kOneHot, c->cand[0]};
      }
      s.cut.insert(s.cut.begin(), std::make_move_iterator(s.cols.begin() + ncols),
                   std::make_move_iterator(s.cols.end()));
    }
    s.cols.resize(static_cast<size_t>(ncols));
  }
  size_t taken = 0;  // the kept drafts first
  while (static_cast<int64_t>(s.cols.size()) < ncols && taken < s.cut.size()) {
    s.cols.push_back(std::move(s.cut[taken++]));
  }
  s.cut.erase(s.cut.begin(), s.cut.begin() + static_cast<std::ptrdiff_t>(taken));
  s.stats.cut_drafts_fed += static_cast<int64_t>(taken);
  while (static_cast<int64_t>(s.cols.size()) < ncols) {  // fresh random drafts
    const auto t = static_cast<uint32_t>(s.n() + static_cast<int64_t>(s.cols.size()));
    Column col;
    const int64_t tok = DrawToken(Uniform(s.r.seed, t, s.iter, Purpose::kDraftInit), V);
    col.cand = {tok};
    col.q = p.uniform_init_q ? ProposalRef{ProposalRef::kUniform, 0}
                             : ProposalRef{ProposalRef::kOneHot, tok};
    s.cols.push_back(col);
  }
  return T;
}

// Root, the main path, then the tree: the Cartesian product of the T leading columns'
// candidates, sharing the main path's nodes where they coincide.
void LayOutNodes(Sequence& s, int64_t T) {
  const auto ncols = static_cast<int64_t>(s.cols.size());
  s.nodes.clear();
  Node root;
  root.token = s.n() == 0 ? s.cond.back() : s.committed.back();
  s.nodes.push_back(root);
  std::vector<int64_t>& main = s.main;
  main.assign(static_cast<size_t>(ncols), 0);
  for (int64_t j = 0; j < ncols; ++j) {
    Node nd;
    nd.col = j;
    nd.token = s.cols[j].cand[0];
    nd.parent = j == 0 ? 0 : main[j - 1];
    main[j] = static_cast<int64_t>(s.nodes.size());
    s.nodes.push_back(nd);
  }
  std::vector<int64_t> level = {0};
  for (int64_t j = 0; j < T; ++j) {
    std::vector<int64_t> next;
    for (int64_t par : level) {
      const bool on_main = par == (j == 0 ? 0 : main[j - 1]);
      for (size_t k = 0; k < s.cols[j].cand.size(); ++k) {
        int64_t id = main[j];
        if (!on_main || k != 0) {
          Node nd;
          nd.col = j;
          nd.token = s.cols[j].cand[k];
          nd.parent = par;
          id = static_cast<int64_t>(s.nodes.size());
          s.nodes.push_back(nd);
        }
        s.nodes[par].kids.push_back(id);
        next.push_back(id);
      }
    }
    level = std::move(next);
  }
  for (int64_t j = T; j < ncols; ++j) s.nodes[j == 0 ? 0 : main[j - 1]].kids.push_back(main[j]);
}

}  // namespace

void PlanWindow(Sequence& s, const GptConfig& cfg, const SpecOptions& opts) {
  const DecodingPolicy& p = s.r.policy;
  const int64_t avail = cfg.block_size - s.n();
  int64_t T = 0, tree_nodes = 0;
  if (p.draft == DraftSource::kNone) {
    s.cols.clear();
  } else if (p.draft == DraftSource::kJacobi) {
    T = PlanJacobiColumns(s, cfg.vocab_size, std::min(s.window(), avail), avail - 1, opts,
                          &tree_nodes);
  }
  // Draft-model columns come from DraftWithModel.
  if (p.draft != DraftSource::kNone && p.acceptance == Acceptance::kRelaxed) {
    s.cool_w = CoolWeights(p.cool_delta, p.cool_nu, static_cast<int64_t>(s.cols.size()));
  }
  LayOutNodes(s, T);
}

}  // namespace imagegen
