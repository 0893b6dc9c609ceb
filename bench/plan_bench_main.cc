// What the goodput controller's planning costs the engine thread (issue 15): a scheduler's
// ChooseWindows without the engine, i.e. every request's expected commits (ExpectedCommits,
// from CommitModel's priors) and PlanGoodput, timed per step for 1..64 requests. The planner
// runs on the engine thread between two steps, so on a GPU, where a step of the bundled model
// takes 0.5-1 ms, its time is the device's idle time (docs/results-gpu.md: 0.1-0.7 ms a step
// at 8-64 clients on 2026-11-28).
//
// --cost FILE: the step-cost model from a calibration's samples (a step-cost JSON as the
// scheduler caches it, or docs/data/gpu-h200-2026-11-28/step_cost_calibration_graphs.json);
// default a linear cost. --corpus N --dump FILE: N random planning problems (requests, windows,
// rows, factors, previous windows, options, cost models; fixed seed) and every plan written
// out in full, to check that a change to the planner keeps its every decision (diff two
// builds' dumps).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/flags.h"
#include "engine/decoding/policy.h"
#include "engine/scheduler/goodput.h"
#include "engine/scheduler/step_cost.h"
#include "engine/util/json.h"

namespace imagegen {
namespace {

using Clock = std::chrono::steady_clock;

StepCostModel CostFromFile(const std::string& path, const Flags& f) {
  std::ifstream in(path);
  if (!in) f.Fail("cannot read --cost " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  StatusOr<Json> j = ParseJson(ss.str());
  if (!j.ok() || !j->is_object() || !j->contains("samples")) {
    f.Fail("--cost " + path + ": not a step-cost calibration (no \"samples\")");
  }
  std::vector<StepCostSample> samples;
  for (const Json& s : (*j)["samples"]) {
    samples.push_back({s.at(0).get<int64_t>(), s.at(1).get<int64_t>(), s.at(2).get<double>()});
  }
  StepCostModel m;
  if (Status st = m.Calibrate(samples); !st.ok()) f.Fail("--cost " + path + ": " + st.ToString());
  return m;
}

void Dump(std::FILE* out, const GoodputPlan& p) {
  std::fprintf(out, "w");
  for (int64_t w : p.windows) std::fprintf(out, " %lld", static_cast<long long>(w));
  std::fprintf(out, " | t %lld s %.17g e %.17g ar %.17g held %d | wider",
               static_cast<long long>(p.tokens), p.seconds, p.expected, p.ar_seconds,
               p.held ? 1 : 0);
  for (int64_t w : p.wider) std::fprintf(out, " %lld", static_cast<long long>(w));
  std::fprintf(out, "\n");
}

// N random problems, each planned and written out.
void Corpus(int64_t n, const std::string& path, const Flags& f) {
  std::FILE* out = std::fopen(path.c_str(), "w");
  if (out == nullptr) f.Fail("cannot write --dump " + path);
  std::mt19937_64 rng(20261206);
  auto uni = [&](double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); };
  auto pick = [&](int64_t a, int64_t b) {
    return std::uniform_int_distribution<int64_t>(a, b)(rng);
  };
  const std::vector<std::string> methods = {"sjd", "scd-mc", "sjd-pac", "gsd", "sd", "ar"};
  CommitModel commits;
  for (int64_t k = 0; k < n; ++k) {
    StepCostModel cost;
    if (pick(0, 2) == 0) {
      cost = StepCostModel::Linear(uni(1e-4, 5e-3), uni(0, 2e-5), uni(0, 2e-4));
    } else {  // a calibrated model: flat, steep or bent
      std::vector<StepCostSample> s;
      const double base = uni(2e-4, 4e-3), slope = uni(0, 3e-5), bend = uni(0, 1e-8);
      for (int64_t t : {1, 2, 8, 32, 128, 512, 2048}) {
        for (int64_t r : {1, 4, 16, 64}) {
          if (t < r) continue;
          const double sec = base + slope * t + bend * t * t + uni(0, 1e-5) * (r - 1);
          s.push_back({t, r, sec * uni(0.9, 1.1)});
        }
      }
      if (!cost.Calibrate(s).ok()) f.Fail("corpus: calibration failed");
    }
    const int64_t R = pick(0, 3) == 0 ? 1 : pick(1, 64);
    std::vector<GoodputRequest> reqs;
    for (int64_t i = 0; i < R; ++i) {
      const std::string& m = methods[static_cast<size_t>(pick(0, methods.size() - 1))];
      StatusOr<DecodingPolicy> pol = PolicyFromPreset(m);
      if (!pol.ok()) f.Fail("corpus: preset " + m);
      const int64_t wanted = pick(1, 80);
      GoodputRequest r;
      r.rows = pick(1, 2);
      r.expected = ExpectedCommits(commits, *pol, wanted, uni(0.25, 4));
      r.previous = pick(0, 3) == 0 ? 0 : pick(1, wanted);
      r.window_invariant = pick(0, 9) == 0;
      reqs.push_back(std::move(r));
    }
    GoodputOptions o;
    o.max_slowdown = pick(0, 3) == 0 ? uni(0, 1) : 0.25;
    o.max_tokens = pick(0, 3) == 0 ? pick(1, 2048) : 0;
    o.lone_request_full_window = pick(0, 3) != 0;
    o.lone_request_max_window = pick(0, 2) == 0 ? pick(0, 16) : 0;
    o.stickiness = pick(0, 2) == 0 ? uni(0, 0.2) : 0;
    o.min_gain = pick(0, 1) == 0 ? 0.03 : uni(0, 0.1);
    Dump(out, PlanGoodput(reqs, cost, o));
  }
  std::fclose(out);
  std::printf("corpus: %lld plans written to %s\n", static_cast<long long>(n), path.c_str());
}

}  // namespace
}  // namespace imagegen

int main(int argc, char** argv) {
  using namespace imagegen;
  Flags f(argc, argv,
          {{"requests", "1,2,4,8,16,32,64"},
           {"methods", "sjd,scd-mc,sjd-pac,mixed"},
           {"wanted", "sjd:16,scd-mc:32,sjd-pac:53"},
           {"cost", ""},
           {"reps", "2000"},
           {"corpus", "0"},
           {"dump", ""}},
          "usage: imagegen-plan-bench [--requests 1,2,..] [--methods sjd,scd-mc,sjd-pac,mixed] "
          "[--cost STEP_COST.json] [--reps N] [--corpus N --dump FILE]");
  if (f.Int("corpus") > 0) {
    if (f.Str("dump").empty()) f.Fail("--corpus needs --dump FILE");
    Corpus(f.Int("corpus"), f.Str("dump"), f);
    return 0;
  }
  std::map<std::string, int64_t> wanted;
  for (const std::string& kv : f.List("wanted")) {
    const size_t colon = kv.find(':');
    if (colon == std::string::npos) f.Fail("--wanted: METHOD:NODES, got '" + kv + "'");
    wanted[kv.substr(0, colon)] = std::atoll(kv.c_str() + colon + 1);
  }
  const StepCostModel cost = f.Str("cost").empty() ? StepCostModel::Linear(5e-4, 2e-6, 1e-5)
                                                   : CostFromFile(f.Str("cost"), f);
  CommitModel commits;  // the priors
  GoodputOptions o;     // the engine's defaults
  o.min_gain = 0.03;
  std::printf(
      "plan cost per step: ExpectedCommits for every request + PlanGoodput, median of %lld "
      "(microseconds); cost model: %s\n",
      static_cast<long long>(f.Int("reps")),
      f.Str("cost").empty() ? "linear" : f.Str("cost").c_str());
  // What the cost model makes a request alone run at when its ceiling comes from the
  // calibration (EngineOptions::lone_request_max_window -2; CFG rows).
  std::printf("a request alone, by this cost model (LoneRequestCeiling, 2 rows a node):");
  const StepCostModel one = cost.OneRequest();
  for (const std::string& name : PresetNames()) {
    StatusOr<DecodingPolicy> p = PolicyFromPreset(name);
    if (!p.ok() || p->draft == DraftSource::kNone || p->window_invariant()) continue;
    std::printf(" %s %lld of %lld", name.c_str(),
                static_cast<long long>(
                    LoneRequestCeiling(one, CommitModel::Key(*p), 2, p->window, o.min_gain)),
                static_cast<long long>(p->window));
  }
  std::printf("\n");
  std::printf("%-8s %8s %10s %10s %8s %8s\n", "method", "requests", "median us", "p90 us", "tokens",
              "window");
  const std::vector<std::string> mix = {"sjd", "scd-mc", "sjd-pac"};
  for (const std::string& method : f.List("methods")) {
    for (int64_t R : f.Ints("requests")) {
      std::vector<DecodingPolicy> pols;
      std::vector<std::string> keys;
      std::vector<int64_t> want;
      std::vector<double> factor;
      for (int64_t i = 0; i < R; ++i) {
        const std::string& m =
            method == "mixed" ? mix[static_cast<size_t>(i) % mix.size()] : method;
        StatusOr<DecodingPolicy> pol = PolicyFromPreset(m);
        if (!pol.ok()) f.Fail("--methods: " + pol.status().ToString());
        pols.push_back(*pol);
        keys.push_back(CommitModel::Key(*pol));
        want.push_back(wanted.count(m) ? wanted[m] : pol->window);
        factor.push_back(0.6 + 0.8 * static_cast<double>(i % 7) / 6);  // 0.6 .. 1.4
      }
      std::vector<double> us;
      GoodputPlan plan;
      for (int64_t rep = 0; rep < f.Int("reps"); ++rep) {
        const Clock::time_point t0 = Clock::now();
        std::vector<GoodputRequest> reqs;
        for (int64_t i = 0; i < R; ++i) {
          reqs.push_back({2, ExpectedCommits(commits, pols[i], keys[i], want[i], factor[i]),
                          rep == 0 ? 0 : plan.windows[static_cast<size_t>(i)], false});
        }
        plan = PlanGoodput(reqs, cost, o);
        us.push_back(1e6 * std::chrono::duration<double>(Clock::now() - t0).count());
      }
      std::sort(us.begin(), us.end());
      double window = 0;
      for (int64_t w : plan.windows) window += static_cast<double>(w);
      std::printf("%-8s %8lld %10.2f %10.2f %8lld %8.1f\n", method.c_str(),
                  static_cast<long long>(R), us[us.size() / 2], us[us.size() * 9 / 10],
                  static_cast<long long>(plan.tokens), window / static_cast<double>(R));
    }
  }
  return 0;
}
