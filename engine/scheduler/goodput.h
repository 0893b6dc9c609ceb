// Goodput control (docs/serving.md, "Window control"): each step, every request's window is
// chosen to maximise the tokens the batch is expected to commit per second of step time,
// from a step-cost model (step_cost.h) and the tokens a step commits at each window, learned
// online per method and request (CommitModel). Plain C++; the engine thread owns the state
// (not thread-safe).
//
// The planner is pure: given each request's expected commits for every window n (from
// CommitModel) and the cost model, it returns the windows. A window never changes the
// distribution of a lossless method, only which drafts are tested.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/decoding/policy.h"
#include "engine/scheduler/step_cost.h"

namespace imagegen {

// Expected tokens committed by a step that grants a request n nodes, per method (the preset
// name). A Jacobi draft is only as good as the iterations it has been refined through, and a
// window cut short loses its tail, so acceptance at depth d depends on the window the request
// keeps, not on d alone: a model of per-depth survival fitted on whole windows predicted 2.9
// tokens per step for scd-mc at 5 nodes where 1.7 were committed (docs/results-serving.md).
// So the commits themselves are learned per window: a table over n = 1, 2, 4, ..., 256
// (interpolated in log2 n), each step adding its commits to the two neighbouring knots, from a
// prior per preset measured on the bundled model with whole windows of 2..64 nodes
// (imagegen-spec-bench; docs/results-serving.md lists it). The scheduler feeds it only steps
// that held or narrowed a request's window (EngineOptions::commit_learn_growth): a widened
// window's new drafts are unrefined, and the table is of windows held.
class CommitModel {
 public:
  static constexpr int kKnots = 9;  // n = 1, 2, 4, ..., 256

  double Expected(const std::string& method, int64_t nodes) const;
  // The table's values at the knots (learned, or the prior), and the expectation at n nodes
  // they give: Expected(m, n) == Interpolate(Knots(m), n).
  std::array<double, kKnots> Knots(const std::string& method) const;
  static double Interpolate(const std::array<double, kKnots>& knots, int64_t nodes);
  // One step of one request of `method` that was granted `nodes` and committed `committed`.
  void Observe(const std::string& method, int64_t nodes, int64_t committed);
  // The bundled model's step compression at a sustained window of n nodes (1 for n = 1).
  // `method` is a preset's name or a Key.
  static double Prior(const std::string& method, int64_t nodes);
  // The table a policy's steps are learned in: its preset's name, or, for a custom policy (parts
  // set by hand: preset "custom"), a table of its own composition, "custom:<nearest preset>
  // (<its parts but the window>)", whose prior is that nearest preset's. Custom compositions
  // do not share one table with sjd's prior: at 8 nodes sd's prior is 2.89 tokens a step,
  // sjd's 1.99.
  static std::string Key(const DecodingPolicy& policy);
  // The drafting preset whose parts are nearest a policy's: the same draft source first, then
  // acceptance rule, coupling, tree or none, and initial q (in that order of weight).
  static std::string NearestPreset(const DecodingPolicy& policy);

  double prior_weight = 30;  // pseudo-steps of the prior per knot
  double decay = 0.999;      // weight of the past at each step of the method

 private:
  struct Table {
    std::vector<double> commits, weight;  // per knot: weighted sum of commits, and weights
  };
  std::map<std::string, Table> methods_;
};

// One request's commits against what the controller expected of it: its content can make its
// drafts much better or worse than its method's average.
//
// A Jacobi request's drafts start random and take iterations to converge, so its first steps
// commit about one token whatever the window (whole windows on the bundled model: 1.0-1.8
// tokens a step over steps 1-7, then 3-5), while the method's table averages over whole
// images: counted, they make every young request look like a poor drafter (its factor near
// 0.3 after 7 steps). `warmup` leaves a request's first steps out (EngineOptions::
// commit_warmup_steps); in the CPU's replays of a GPU's step cost it moved the controller's
// rate by -12% to +3% (docs/results-serving.md, "The warm-up of a Jacobi request"), so it is
// off by default until a GPU measures it.
struct RequestCommits {
  // One step of the request (`step`: how many it had before, 0 for its first), which committed
  // `committed` tokens where its method's table expected `expected` (without this factor);
  // ignored while step < warmup.
  void Observe(int64_t step, int64_t committed, double expected, int64_t warmup = 0);
  // Sums over its counted steps of (committed - 1) and of (the method's expectation - 1).
  double extra = 0, expected_extra = 0;
  // The factor on the method's expected extra tokens: realised / expected, with 4 pseudo-tokens
  // of each, in [0.25, 4].
  double Factor() const;
};

// expected[n - 1] for n = 1..wanted: 1 + factor * (model.Expected(key, n) - 1), where `key` is
// CommitModel::Key(policy) (the scheduler keeps it on the request rather than spell a custom
// policy's key again every step); {1} for methods that do not draft.
std::vector<double> ExpectedCommits(const CommitModel& model, const DecodingPolicy& policy,
                                    const std::string& key, int64_t wanted, double factor);
inline std::vector<double> ExpectedCommits(const CommitModel& model, const DecodingPolicy& policy,
                                           int64_t wanted, double factor) {
  return ExpectedCommits(model, policy, CommitModel::Key(policy), wanted, factor);
}

struct GoodputRequest {
  int64_t rows = 1;              // forward rows per node (2 with CFG)
  std::vector<double> expected;  // as ExpectedCommits: size = the wanted window (>= 1)
  int64_t previous = 0;          // the window it was planned last step; 0: none (new)
  // What it draws for a seed does not depend on its windows (the match rule,
  // DecodingPolicy::window_invariant): alone, it is planned as any other request even with
  // GoodputOptions::lone_request_full_window, since that rule only keeps a seed's image
  // reproducible.
  bool window_invariant = false;
};

struct GoodputOptions {
  // Fairness bound: no request's expected time per token may exceed (1 + max_slowdown) times
  // what it would be if every request in the step fed one token (plain AR for all).
  double max_slowdown = 0.25;
  int64_t max_tokens = 0;  // forward rows per step, a memory ceiling; 0: none
  // A request alone gets its whole window: what it draws for a seed then does not depend on a
  // calibration measured on a noisy machine. false: it is planned as any other, at the window
  // the cost model makes fastest (on the 2-core CPU 7-18 nodes for scd-mc and 4-8 for sjd-pac,
  // whose whole windows are 30 and 52: docs/results-serving.md, "One request alone, planned").
  // A window-invariant request (GoodputRequest::window_invariant) is planned all the same.
  bool lone_request_full_window = true;
  // With lone_request_full_window: the whole window, but at most this many nodes (0: no
  // ceiling). The scheduler passes a fixed number, or the one LoneRequestCeiling derives from
  // the start-up calibration (EngineOptions::lone_request_max_window), so a seed's image alone
  // depends on the options and that calibration only.
  int64_t lone_request_max_window = 0;
  // Hysteresis: the previous step's windows (GoodputRequest::previous, clipped to what each
  // request wants; a new request takes the best plan's) are kept while their expected goodput
  // is within this fraction of the best plan's and they keep the fairness bound and the
  // ceiling. A Jacobi window that moves from step to step commits fewer tokens than one held
  // (imagegen-window-churn: 7-40% more steps per image on the bundled model), which the
  // commit model, learned per window size, does not see. Off by default: in a CPU replay with
  // a GPU-like step cost it neither cut the windows' movement nor raised the commits, and it
  // held sjd-pac at smaller windows in 2 of 4 cells (docs/results-serving.md, "Moving
  // windows").
  double stickiness = 0;
  // Margin over plain AR: a plan that speculates is taken only when its predicted goodput is
  // at least (1 + min_gain) times every request feeding one node's. The planner picks the
  // best of many plans by predicted rate, so where speculation gains nothing (a step whose
  // time grows with its tokens, many requests) the winner is the plan whose cost the model
  // underestimates most, and the step is slower than AR's.
  double min_gain = 0;
};

struct GoodputPlan {
  std::vector<int64_t> windows;  // nodes per request, in the order given
  int64_t tokens = 0;            // forward rows
  double seconds = 0;            // predicted step time
  double expected = 0;           // expected commits, all requests
  double ar_seconds = 0;         // predicted step time with one node each
  bool held = false;             // the previous windows, kept (GoodputOptions::stickiness)
  // The exploring alternative: the windows of the best plan among those with at least twice
  // the forward rows of the best one (when one keeps the fairness bound), with which the
  // scheduler lets the step-cost model measure the larger steps it would otherwise only
  // extrapolate to. Empty: none.
  std::vector<int64_t> wider;
};

GoodputPlan PlanGoodput(const std::vector<GoodputRequest>& requests, const StepCostModel& cost,
                        const GoodputOptions& options);
// The window a request alone runs fastest at, by a step-cost model (the scheduler passes its
// calibration's one-request fit, StepCostModel::OneRequest) and its method's prior
// commits (CommitModel::Prior; `key` as CommitModel::Key): the n in 1..whole that maximises
// Prior(key, n) / cost.Predict(n * rows, 1), the smallest of equals, and 1 unless that rate is
// at least (1 + min_gain) times plain AR's (GoodputOptions::min_gain). It uses neither the
// learned commits nor an online refinement, so, given the calibration the scheduler loaded or
// measured at start (and caches), it is a fixed number: what a seed draws alone does not move
// with load or time. At most 64 nodes are considered (the prior's last knot; it stays flat
// beyond).
int64_t LoneRequestCeiling(const StepCostModel& cost, const std::string& key, int64_t rows,
                           int64_t whole, double min_gain);
// The plan that grants requests[i] windows[i] nodes (its tokens, expected commits and
// predicted times; no alternative).
GoodputPlan PlanOfWindows(const std::vector<GoodputRequest>& requests, const StepCostModel& cost,
                          std::vector<int64_t> windows);

}  // namespace imagegen
