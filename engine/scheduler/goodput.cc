#include "engine/scheduler/goodput.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace imagegen {

namespace {

constexpr int kKnots = CommitModel::kKnots;

// The knot below n (in log2) and the weight of the one above.
std::pair<int, double> KnotOf(int64_t nodes) {
  const double x = std::log2(static_cast<double>(std::max<int64_t>(nodes, 1)));
  const int k = std::min(static_cast<int>(x), kKnots - 2);
  return {k, std::min(x - k, 1.0)};
}

// Step compression with whole windows of 1, 2, 4, ..., 64 nodes (imagegen-spec-bench, 30
// images per cell); beyond 64 it stays. sjd-pac's tree does not fit below 21 nodes, where it
// is a Jacobi chain with uniform drafts (sjd's figures are used there).
const std::vector<double>& PriorTable(const std::string& method) {
  static const std::map<std::string, std::vector<double>> kPrior = {
      {"sjd", {1, 1.26, 1.60, 1.99, 2.26, 2.40, 2.39}},
      {"scd-mc", {1, 1.27, 1.64, 2.15, 2.90, 3.64, 3.92}},
      {"scd-gs", {1, 1.27, 1.61, 2.16, 2.86, 3.56, 3.92}},
      // The match rule (docs/data/match_rule_spec_bench.csv, the same bench and sample).
      {"scd-gm", {1, 1.25, 1.59, 2.10, 2.74, 3.39, 3.80}},
      {"gsd", {1, 1.28, 1.66, 2.11, 2.51, 2.70, 2.77}},
      {"cool-sjd", {1, 1.27, 1.67, 2.22, 2.87, 3.34, 3.67}},
      {"sjd-pac", {1, 1.26, 1.60, 1.99, 2.26, 2.87, 3.57}},
      {"pac-gumbel", {1, 1.26, 1.60, 1.99, 2.26, 2.83, 3.61}},
      {"sd", {1, 1.67, 2.42, 2.89, 3.10, 3.10, 3.10}},
      {"cool-sd", {1, 1.70, 2.52, 3.31, 4.06, 4.06, 4.06}}};
  // A custom policy's key names its nearest preset ("custom:scd-mc (...)").
  const bool custom = method.rfind("custom:", 0) == 0;
  auto it = kPrior.find(custom ? method.substr(7, method.find(' ') - 7) : method);
  if (it == kPrior.end()) it = kPrior.find("sjd");  // anything else: the plainest
  return it->second;
}

double PriorAt(const std::vector<double>& c, int64_t nodes) {
  const auto [k, w] = KnotOf(nodes);
  const auto at = [&](int i) { return c[std::min<size_t>(static_cast<size_t>(i), c.size() - 1)]; };
  return std::min<double>((1 - w) * at(k) + w * at(k + 1), static_cast<double>(nodes));
}

}  // namespace

double CommitModel::Prior(const std::string& method, int64_t nodes) {
  return PriorAt(PriorTable(method), nodes);
}

std::string CommitModel::NearestPreset(const DecodingPolicy& policy) {
  static const std::vector<DecodingPolicy> kPresets = [] {
    std::vector<DecodingPolicy> v;
    for (const std::string& name : PresetNames()) {
      StatusOr<DecodingPolicy> p = PolicyFromPreset(name);
      if (p.ok() && p->draft != DraftSource::kNone) v.push_back(*p);
    }
    return v;
  }();
  const DecodingPolicy* best = nullptr;
  int best_score = -1;
  for (const DecodingPolicy& p : kPresets) {  // the first of the best, in PresetNames' order
    const int score = 16 * (p.draft == policy.draft) + 8 * (p.acceptance == policy.acceptance) +
                      4 * (p.coupling == policy.coupling) +
                      2 * (p.has_tree() == policy.has_tree()) +
                      (p.uniform_init_q == policy.uniform_init_q);
    if (score > best_score) {
      best = &p;
      best_score = score;
    }
  }
  return best == nullptr ? "sjd" : best->preset;
}

std::string CommitModel::Key(const DecodingPolicy& policy) {
  if (policy.preset != "custom") return policy.preset;
  DecodingPolicy parts = policy;
  parts.preset = "custom:" + NearestPreset(policy);
  parts.window = 0;                             // the table is per window already
  return DescribePolicy(parts, /*digits=*/17);  // parts that differ past 6 digits too
}

std::array<double, CommitModel::kKnots> CommitModel::Knots(const std::string& method) const {
  const std::vector<double>& prior = PriorTable(method);
  const auto it = methods_.find(method);
  std::array<double, kKnots> v{};
  for (int i = 0; i < kKnots; ++i) {
    const double p = PriorAt(prior, int64_t{1} << i);
    v[i] = it == methods_.end()
               ? p
               : (it->second.commits[i] + prior_weight * p) / (it->second.weight[i] + prior_weight);
  }
  return v;
}

double CommitModel::Interpolate(const std::array<double, kKnots>& knots, int64_t nodes) {
  if (nodes <= 1) return 1;
  const auto [k, w] = KnotOf(nodes);
  return std::clamp((1 - w) * knots[k] + w * knots[k + 1], 1.0, static_cast<double>(nodes));
}

double CommitModel::Expected(const std::string& method, int64_t nodes) const {
  return Interpolate(Knots(method), nodes);
}

void CommitModel::Observe(const std::string& method, int64_t nodes, int64_t committed) {
  if (nodes < 1 || committed < 1) return;
  Table& t = methods_[method];
  if (t.commits.empty()) {
    t.commits.assign(kKnots, 0);
    t.weight.assign(kKnots, 0);
  }
  for (int i = 0; i < kKnots; ++i) {
    t.commits[i] *= decay;
    t.weight[i] *= decay;
  }
  // A knot's value is the commits at exactly its window: a step between two knots is moved to
  // each along the prior's slope.
  const auto [k, w] = KnotOf(nodes);
  const double here = Prior(method, nodes), c = static_cast<double>(committed);
  const double lo = c * Prior(method, int64_t{1} << k) / here;
  const double hi = c * Prior(method, int64_t{1} << (k + 1)) / here;
  t.commits[k] += (1 - w) * lo;
  t.weight[k] += 1 - w;
  t.commits[k + 1] += w * hi;
  t.weight[k + 1] += w;
}

void RequestCommits::Observe(int64_t step, int64_t committed, double expected, int64_t warmup) {
  if (step < warmup) return;
  extra += static_cast<double>(committed - 1);
  expected_extra += expected - 1;
}

double RequestCommits::Factor() const {
  return std::clamp((extra + 4) / (expected_extra + 4), 0.25, 4.0);
}

std::vector<double> ExpectedCommits(const CommitModel& model, const DecodingPolicy& policy,
                                    const std::string& key, int64_t wanted, double factor) {
  if (policy.draft == DraftSource::kNone) return {1.0};
  const auto knots = model.Knots(key);  // once, not once per window
  std::vector<double> out;
  for (int64_t n = 1; n <= std::max<int64_t>(wanted, 1); ++n) {
    const double e = 1 + factor * (CommitModel::Interpolate(knots, n) - 1);
    out.push_back(std::min(e, static_cast<double>(n)));
  }
  return out;
}

namespace {

// The upper concave hull of (n, expected[n - 1]) from n = 1: the windows worth considering,
// with decreasing gain per node from one to the next.
std::vector<int64_t> Hull(const std::vector<double>& e) {
  std::vector<int64_t> h = {1};
  for (int64_t n = 2; n <= static_cast<int64_t>(e.size()); ++n) {
    auto slope = [&](int64_t a, int64_t b) {
      return (e[b - 1] - e[a - 1]) / static_cast<double>(b - a);
    };
    while (h.size() >= 2 && slope(h[h.size() - 2], h.back()) <= slope(h.back(), n)) h.pop_back();
    h.push_back(n);
  }
  // Drop a tail that gains nothing.
  while (h.size() >= 2 && e[h.back() - 1] <= e[h[h.size() - 2] - 1]) h.pop_back();
  return h;
}

struct Segment {
  size_t req = 0, to = 0;  // raises request `req` from hull vertex to - 1 to vertex `to`
  double gain_per_row = 0;
};

}  // namespace

GoodputPlan PlanOfWindows(const std::vector<GoodputRequest>& requests, const StepCostModel& cost,
                          std::vector<int64_t> windows) {
  GoodputPlan plan;
  plan.windows = std::move(windows);
  int64_t ar_tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    plan.tokens += plan.windows[i] * requests[i].rows;
    plan.expected += requests[i].expected[plan.windows[i] - 1];
    ar_tokens += requests[i].rows;
  }
  const auto R = static_cast<int64_t>(requests.size());
  plan.seconds = cost.Predict(plan.tokens, R);
  plan.ar_seconds = cost.Predict(ar_tokens, R);
  return plan;
}

GoodputPlan PlanGoodput(const std::vector<GoodputRequest>& requests, const StepCostModel& cost,
                        const GoodputOptions& options) {
  GoodputPlan plan;
  const size_t R = requests.size();
  if (R == 0) return plan;
  const auto Rn = static_cast<int64_t>(R);
  const int64_t limit = options.max_tokens > 0 ? options.max_tokens : int64_t{1} << 40;
  auto expected = [&](size_t i, int64_t n) { return requests[i].expected[n - 1]; };
  int64_t ar_tokens = 0;
  for (const GoodputRequest& r : requests) ar_tokens += r.rows;
  plan.ar_seconds = cost.Predict(ar_tokens, Rn);
  auto finish = [&](std::vector<int64_t> w) {
    std::vector<int64_t> wider = std::move(plan.wider);
    plan = PlanOfWindows(requests, cost, std::move(w));
    plan.wider = std::move(wider);
    return plan;
  };
  if (R == 1 && options.lone_request_full_window && !requests[0].window_invariant) {
    auto wanted = static_cast<int64_t>(requests[0].expected.size());
    if (options.lone_request_max_window > 0) {
      wanted = std::min(wanted, options.lone_request_max_window);
    }
    return finish({std::max<int64_t>(1, std::min(wanted, limit / requests[0].rows))});
  }

  std::vector<std::vector<int64_t>> hulls(R);
  std::vector<Segment> segs;
  int64_t full_tokens = 0;
  for (size_t i = 0; i < R; ++i) {
    hulls[i] = Hull(requests[i].expected);
    const std::vector<int64_t>& h = hulls[i];
    for (size_t k = 1; k < h.size(); ++k) {
      const double slope = (expected(i, h[k]) - expected(i, h[k - 1])) /
                           static_cast<double>((h[k] - h[k - 1]) * requests[i].rows);
      segs.push_back({i, k, slope});
    }
    full_tokens += h.back() * requests[i].rows;
  }
  std::stable_sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) {
    return a.gain_per_row > b.gain_per_row;
  });

  const double ar = plan.ar_seconds;
  const int64_t top = std::min(full_tokens, limit);
  // Candidate ceilings on the step's forward rows: every count from plain AR's up to every
  // whole window's when there are few, else 4% apart; and the largest count the fairness bound
  // can allow beside a request that cannot speculate.
  std::vector<int64_t> caps;
  if (top - ar_tokens <= 256) {
    for (int64_t t = ar_tokens; t <= top; ++t) caps.push_back(t);
  } else {
    for (double t = static_cast<double>(ar_tokens); t < static_cast<double>(top); t *= 1.04) {
      caps.push_back(static_cast<int64_t>(t));
    }
    caps.push_back(top);
    caps.push_back(cost.MaxTokensWithin((1 + options.max_slowdown) * ar, Rn, top));
  }
  struct Candidate {
    std::vector<int64_t> windows;
    int64_t tokens = 0;
    double rate = 0;
  };
  // Every request one node is always allowed.
  std::vector<Candidate> candidates = {
      {std::vector<int64_t>(R, 1), ar_tokens, static_cast<double>(R) / ar}};
  std::vector<size_t> at(R);  // hull vertex per request
  std::vector<bool> blocked(R);
  for (int64_t max_tokens : caps) {
    if (max_tokens < ar_tokens) continue;
    // The fairness floor, against the cap's time (the step will take at most that).
    const double e_min = cost.Predict(max_tokens, Rn) / ((1 + options.max_slowdown) * ar);
    int64_t tokens = 0;
    bool feasible = true;
    for (size_t i = 0; i < R && feasible; ++i) {
      const std::vector<int64_t>& h = hulls[i];
      size_t k = 0;
      while (k + 1 < h.size() && expected(i, h[k]) < e_min) ++k;
      feasible = expected(i, h[k]) >= e_min - 1e-12;
      at[i] = k;
      blocked[i] = false;
      tokens += h[k] * requests[i].rows;
    }
    if (!feasible || tokens > max_tokens) continue;
    for (const Segment& s : segs) {  // the best gain per forward row first
      if (blocked[s.req] || s.to != at[s.req] + 1) continue;
      const std::vector<int64_t>& h = hulls[s.req];
      const int64_t more = (h[s.to] - h[s.to - 1]) * requests[s.req].rows;
      if (tokens + more > max_tokens) {
        blocked[s.req] = true;  // its later segments depend on this one
        continue;
      }
      tokens += more;
      at[s.req] = s.to;
    }
    double e = 0;
    Candidate c;
    for (size_t i = 0; i < R; ++i) {
      e += expected(i, hulls[i][at[i]]);
      c.windows.push_back(hulls[i][at[i]]);
    }
    c.tokens = tokens;
    c.rate = e / cost.Predict(tokens, Rn);
    candidates.push_back(std::move(c));
  }
  const Candidate* best = &candidates[0];
  for (const Candidate& c : candidates) {
    if (c.rate > best->rate * (1 + 1e-9)) best = &c;
  }
  if (best->rate < candidates[0].rate * (1 + options.min_gain)) best = &candidates[0];
  const Candidate* wider = nullptr;
  for (const Candidate& c : candidates) {
    if (c.tokens >= 2 * best->tokens && (wider == nullptr || c.rate > wider->rate)) wider = &c;
  }
  if (wider != nullptr) plan.wider = wider->windows;
  if (options.stickiness > 0) {
    Candidate held;
    bool any = false;
    for (size_t i = 0; i < R; ++i) {
      const auto wanted = static_cast<int64_t>(requests[i].expected.size());
      const int64_t prev = requests[i].previous;
      any |= prev > 0;
      held.windows.push_back(prev > 0 ? std::clamp<int64_t>(prev, 1, wanted) : best->windows[i]);
      held.tokens += held.windows.back() * requests[i].rows;
    }
    if (any && held.windows != best->windows && held.tokens <= std::max(limit, ar_tokens)) {
      const double t = cost.Predict(held.tokens, Rn);
      const double e_min = t / ((1 + options.max_slowdown) * ar);
      double e = 0;
      bool fair = true;
      for (size_t i = 0; i < R; ++i) {
        e += expected(i, held.windows[i]);
        fair &= expected(i, held.windows[i]) >= e_min - 1e-12;  // the planner's floor
      }
      held.rate = e / t;
      if (fair && held.rate >= best->rate * (1 - options.stickiness)) {
        finish(held.windows);
        plan.held = true;
        return plan;
      }
    }
  }
  return finish(best->windows);
}

}  // namespace imagegen
