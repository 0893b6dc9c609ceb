#include "engine/scheduler/goodput.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

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
  uint32_t req = 0, to = 0;  // raises request `req` from hull vertex to - 1 to vertex `to`
  int64_t more = 0;          // the forward rows it adds
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

int64_t LoneRequestCeiling(const StepCostModel& cost, const std::string& key, int64_t rows,
                           int64_t whole, double min_gain) {
  const int64_t top = std::min<int64_t>(std::max<int64_t>(whole, 1), 64);
  const double ar = 1 / cost.Predict(rows, 1);
  int64_t best = 1;
  double best_rate = ar;
  for (int64_t n = 2; n <= top; ++n) {
    const double rate = CommitModel::Prior(key, n) / cost.Predict(n * rows, 1);
    if (rate > best_rate) {
      best = n;
      best_rate = rate;
    }
  }
  return best_rate >= (1 + min_gain) * ar ? best : 1;
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
      segs.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(k),
                      (h[k] - h[k - 1]) * requests[i].rows, slope});
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
  // One candidate per ceiling: its forward rows and predicted rate. The windows are not kept
  // (a plan of 64 requests considers up to a few hundred ceilings): fill gives them again for the
  // one or two candidates chosen.
  struct Candidate {
    int64_t cap = -1;  // -1: every request one node
    int64_t tokens = 0;
    double rate = 0;
  };
  std::vector<Candidate> candidates = {{-1, ar_tokens, static_cast<double>(R) / ar}};
  candidates.reserve(caps.size() + 1);
  std::vector<size_t> at(R);  // hull vertex per request
  // Along a hull the expectations rise (its slopes fall and its last one is positive), so a
  // request's floor is found by bisection. The walk over the segments reads each request's next
  // vertex from one array (`want`: at + 1, or none once blocked), and stops once no request can
  // take another.
  std::vector<std::vector<double>> hull_e(R);
  int64_t min_rows = std::numeric_limits<int64_t>::max();
  for (size_t i = 0; i < R; ++i) {
    for (int64_t n : hulls[i]) hull_e[i].push_back(expected(i, n));
    min_rows = std::min(min_rows, requests[i].rows);
  }
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  std::vector<uint32_t> want(R);
  // The plan under a ceiling of max_tokens rows into `at`: every request at the lowest hull
  // vertex that meets the fairness floor (against the ceiling's time: the step will take at
  // most that), then the segments with the best gain per forward row first while they fit.
  // Returns its rows, or -1 when the floor alone does not fit.
  auto fill = [&](int64_t max_tokens) -> int64_t {
    const double e_min = cost.Predict(max_tokens, Rn) / ((1 + options.max_slowdown) * ar);
    int64_t tokens = 0;
    size_t open = 0;  // requests with a segment left that may still fit
    for (size_t i = 0; i < R; ++i) {
      const std::vector<double>& e = hull_e[i];
      // The first vertex with e >= e_min, else the last: where a walk up the hull stops.
      const auto k = static_cast<size_t>(
          std::partition_point(e.begin(), e.end() - 1, [&](double x) { return x < e_min; }) -
          e.begin());
      if (!(e[k] >= e_min - 1e-12)) return -1;
      at[i] = k;
      tokens += hulls[i][k] * requests[i].rows;
      const bool more = k + 1 < e.size();
      want[i] = more ? static_cast<uint32_t>(k + 1) : kNone;
      open += more ? 1 : 0;
    }
    if (tokens > max_tokens) return -1;
    for (const Segment& s : segs) {
      // Every later segment adds at least min_rows rows.
      if (open == 0 || max_tokens - tokens < min_rows) break;
      if (s.to != want[s.req]) continue;  // below the floor, or its request blocked
      if (tokens + s.more > max_tokens) {
        want[s.req] = kNone;  // blocked: its later segments depend on this one
        --open;
        continue;
      }
      tokens += s.more;
      at[s.req] = s.to;
      const bool more = s.to + 1 < hulls[s.req].size();
      want[s.req] = more ? s.to + 1 : kNone;
      open -= more ? 0 : 1;
    }
    return tokens;
  };
  for (int64_t max_tokens : caps) {
    if (max_tokens < ar_tokens) continue;
    const int64_t tokens = fill(max_tokens);
    if (tokens < 0) continue;
    double e = 0;
    for (size_t i = 0; i < R; ++i) e += expected(i, hulls[i][at[i]]);
    candidates.push_back({max_tokens, tokens, e / cost.Predict(tokens, Rn)});
  }
  auto windows_of = [&](const Candidate& c) {
    std::vector<int64_t> w(R, 1);
    if (c.cap < 0) return w;
    fill(c.cap);
    for (size_t i = 0; i < R; ++i) w[i] = hulls[i][at[i]];
    return w;
  };
  const Candidate* best = &candidates[0];
  for (const Candidate& c : candidates) {
    if (c.rate > best->rate * (1 + 1e-9)) best = &c;
  }
  if (best->rate < candidates[0].rate * (1 + options.min_gain)) best = &candidates[0];
  const Candidate* wider = nullptr;
  for (const Candidate& c : candidates) {
    if (c.tokens >= 2 * best->tokens && (wider == nullptr || c.rate > wider->rate)) wider = &c;
  }
  if (wider != nullptr) plan.wider = windows_of(*wider);
  const std::vector<int64_t> best_windows = windows_of(*best);
  if (options.stickiness > 0) {
    std::vector<int64_t> held;
    int64_t held_tokens = 0;
    bool any = false;
    for (size_t i = 0; i < R; ++i) {
      const auto wanted = static_cast<int64_t>(requests[i].expected.size());
      const int64_t prev = requests[i].previous;
      any |= prev > 0;
      held.push_back(prev > 0 ? std::clamp<int64_t>(prev, 1, wanted) : best_windows[i]);
      held_tokens += held.back() * requests[i].rows;
    }
    if (any && held != best_windows && held_tokens <= std::max(limit, ar_tokens)) {
      const double t = cost.Predict(held_tokens, Rn);
      const double e_min = t / ((1 + options.max_slowdown) * ar);
      double e = 0;
      bool fair = true;
      for (size_t i = 0; i < R; ++i) {
        e += expected(i, held[i]);
        fair &= expected(i, held[i]) >= e_min - 1e-12;  // the planner's floor
      }
      if (fair && e / t >= best->rate * (1 - options.stickiness)) {
        finish(held);
        plan.held = true;
        return plan;
      }
    }
  }
  return finish(best_windows);
}

}  // namespace imagegen
