// imagegen-load-bench: closed-loop load on the serving engine (no gRPC). For each method and
// concurrency c, c client threads each submit a request, wait for its image, and submit the
// next, for --seconds (at least; --seconds-per-client more per client, so that high
// concurrency completes enough images). Every (method, c) runs under each window-control mode
// side by side (--modes): "none" (whole windows), "budget:N" (the fixed token budget N),
// "goodput" (the controller, goodput.h), and "serial" (one request at a time: two KV slots).
// With --repeat R every cell runs R times, the modes' order alternating, and the median rate is
// reported. A mixed load (--mixed-methods: each client its own method) runs under
// --mixed-modes. Prints the tables with the ratios measured in this run and writes
// results.csv, mixed.csv and plots (tools/plot_load_bench.py).
//
//   imagegen-load-bench --methods ar,sjd,scd-mc,sjd-pac --concurrency 1,2,4,8,16,32,64 --out-dir
//   out
// A method is a preset or preset@W, its policy with a window of W nodes (scd-mc@16).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "tests/build_paths.h"
#include "bench/flags.h"
#include "bench/op_profile.h"
#include "engine/model/image_model.h"
#include "engine/scheduler/engine.h"
#include "engine/util/percentile.h"

using namespace imagegen;

namespace {

class Waiter : public RequestObserver {
 public:
  void OnComplete(RequestResult r) override {
    std::lock_guard<std::mutex> l(mu_);
    stats_ = r.stats;
    ok_ = true;
    done_ = true;
    cv_.notify_all();
  }
  void OnError(const Status& s) override {
    std::lock_guard<std::mutex> l(mu_);
    error_ = s.ToString();
    done_ = true;
    cv_.notify_all();
  }
  bool Wait(RequestStats* stats, std::string* err) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return done_; });
    *stats = stats_;
    *err = error_;
    return ok_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false, ok_ = false;
  RequestStats stats_;
  std::string error_;
};

struct StepTotals : EngineListener {
  void OnStep(const StepSample& s) override {
    std::lock_guard<std::mutex> l(mu);
    steps += 1;
    tokens += s.tokens;
    requests += s.requests;
    limited += s.budget_limited ? 1 : 0;
    seconds += s.seconds;
    if (s.predicted_seconds > 0) {
      cost_error.push_back(std::abs(s.step_seconds / s.predicted_seconds - 1));
    }
    expected += s.expected_committed;
    if (s.expected_committed > 0) planned_committed += s.committed;
    plan_seconds += s.plan_seconds;
    captures += s.graph_captures;
    if (Clock::now() < stop) committed_before_stop += s.committed;
    if (trace) {
      // One row per request that decoded (--trace-dir): the step's figures, then the request's.
      const double t = std::chrono::duration<double>(Clock::now() - trace_t0).count();
      for (const StepSample::RequestTrace& r : s.trace) {
        *trace << steps << "," << t << "," << s.requests << "," << s.tokens << ","
               << 1000 * s.predicted_seconds << "," << 1000 * s.step_seconds << ","
               << 1000 * s.wanted_predicted_seconds << "," << s.expected_committed << ","
               << s.graph_captures << "," << (s.explore ? 1 : 0) << "," << r.id << "," << r.method
               << "," << r.wanted << "," << r.window << "," << r.rows << "," << r.expected << ","
               << r.expected_wanted << "," << r.factor << "," << r.committed << "\n";
      }
    }
  }
  // --trace-dir: the file, and the cell's start.
  std::unique_ptr<std::ofstream> trace;
  Clock::time_point trace_t0 = Clock::now();
  Clock::time_point stop = Clock::time_point::max();  // set before the clients start
  std::mutex mu;
  int64_t steps = 0, tokens = 0, requests = 0, limited = 0, planned_committed = 0;
  int64_t committed_before_stop = 0, captures = 0;
  double seconds = 0, expected = 0, plan_seconds = 0;
  std::vector<double> cost_error;  // |measured / predicted - 1| per step
};

// A window-control mode: "none", "budget:N", "goodput" or "serial".
struct Mode {
  std::string name, policy = "full";
  int64_t budget = 0;
  bool serial = false;
};

Mode ParseMode(const Flags& f, const std::string& flag, const std::string& m) {
  Mode mode;
  mode.name = m;
  if (m == "none") return mode;
  if (m == "goodput") {
    mode.policy = "goodput";
    mode.budget = -1;
    return mode;
  }
  if (m == "serial") {
    mode.serial = true;
    return mode;
  }
  if (m.rfind("budget:", 0) == 0) {
    mode.policy = "budget";
    char* end = nullptr;
    mode.budget = std::strtoll(m.c_str() + 7, &end, 10);
    if (*end == '\0' && mode.budget >= 2) return mode;
  }
  f.Fail("--" + flag + ": '" + m + "' is not none, goodput, serial or budget:N (N >= 2)");
}

struct Cell {
  std::string method, mode;
  int64_t concurrency = 0, budget = 0;
  int64_t images = 0;
  double seconds = 0, images_per_s = 0, p50 = 0, p99 = 0, mean_latency = 0, nfe = 0;
  double tokens_per_step = 0, requests_per_step = 0, limited_frac = 0, step_ms = 0;
  double mean_window = 0, cost_err_p50 = 0, cost_err_p90 = 0, expected_vs_committed = 0;
  double window_change = 0;   // RequestStats::mean_window_change, over the cell's images
  double plan_ms = 0;         // choosing the windows, per step
  double graph_captures = 0;  // CUDA graphs captured in the cell's steps (StepSample)
  double decode_ms = 0;       // last token to the decoded image, mean (RequestStats)
  std::vector<double> latencies, cost_errors;
  std::map<std::string, std::vector<double>> by_method;  // latencies per method (mixed load)
  int repeats = 1;
};

// A client thread's failure ends the process with status 1 at once: std::exit runs the static
// destructors while the engine's threads may still use what they destroy. (On an H200 a run
// whose request failed ended in a segmentation fault, status 139, rather than 1.)
[[noreturn]] void FailFromClientThread() {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(1);
}

// `decode_images` false: the requests ask for tokens alone, no decoded image (to see what
// decoding the finished images costs a load).
// `trace_dir` non-empty: a CSV of the controller's per-request view of every step
// (EngineOptions::trace_steps) there, one file per cell.
Cell RunCell(const EngineOptions& base, const std::vector<DecodingPolicy>& policies,
             const std::string& label, const Mode& mode, int64_t c, double seconds, uint64_t seed0,
             bool decode_images, const std::string& trace_dir = "") {
  EngineOptions o = base;
  o.window_policy = mode.policy;
  o.max_tokens_per_step = mode.budget;
  o.max_queue = std::max<int64_t>(c, 1);
  o.max_slots = mode.serial ? 2 : std::max<int64_t>(2 * c, 2);
  // --warmup 1 without lists: the cell's own methods at its own load, before its clock starts.
  if (o.warmup != 0 && o.warmup_methods.empty()) {
    for (const DecodingPolicy& p : policies) {
      if (std::find(o.warmup_methods.begin(), o.warmup_methods.end(), p.preset) ==
          o.warmup_methods.end()) {
        o.warmup_methods.push_back(p.preset);
      }
    }
  }
  if (o.warmup != 0 && o.warmup_concurrency.empty()) o.warmup_concurrency = {c};
  StepTotals totals;
  if (!trace_dir.empty()) {
    static int cells = 0;
    std::string name =
        label + "_" + mode.name + "_c" + std::to_string(c) + "_" + std::to_string(++cells) + ".csv";
    std::replace(name.begin(), name.end(), ':', '-');
    totals.trace = std::make_unique<std::ofstream>(trace_dir + "/trace_" + name);
    *totals.trace << "step,t_s,requests,tokens,predicted_ms,measured_ms,wanted_predicted_ms,"
                     "plan_expected,captures,explore,id,method,wanted,window,rows,expected,"
                     "expected_wanted,factor,committed\n";
    o.trace_steps = true;
  }
  auto started = Engine::Start(o, &totals);
  if (!started.ok()) {
    std::fprintf(stderr, "error: %s\n", started.status().ToString().c_str());
    std::exit(1);
  }
  Engine& engine = **started;
  std::mutex mu;
  Cell cell;
  std::vector<int64_t> nfes;
  double window_sum = 0, change_sum = 0, decode_sum = 0;
  std::atomic<uint64_t> next_seed{seed0};
  const auto t0 = Clock::now();
  const auto stop =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  {
    std::lock_guard<std::mutex> l(totals.mu);
    totals.stop = stop;
  }
  Clock::time_point last_end = t0;
  std::vector<std::thread> clients;
  for (int64_t k = 0; k < c; ++k) {
    clients.emplace_back([&, k] {
      const DecodingPolicy& policy = policies[static_cast<size_t>(k) % policies.size()];
      while (Clock::now() < stop) {
        GenerateParams p;
        const uint64_t seed = next_seed.fetch_add(1);
        p.class_id = static_cast<int64_t>(seed % 10);
        p.seed = seed;
        p.policy = policy;
        p.decode_image = decode_images;
        auto w = std::make_shared<Waiter>();
        const auto s0 = Clock::now();
        auto id = engine.Submit(p, w);
        if (!id.ok()) {
          std::fprintf(stderr, "submit: %s\n", id.status().ToString().c_str());
          FailFromClientThread();
        }
        RequestStats st;
        std::string err;
        if (!w->Wait(&st, &err)) {
          std::fprintf(stderr, "request failed: %s\n", err.c_str());
          FailFromClientThread();
        }
        const auto s1 = Clock::now();
        const double latency = std::chrono::duration<double>(s1 - s0).count();
        std::lock_guard<std::mutex> l(mu);
        cell.latencies.push_back(latency);
        cell.by_method[policy.preset].push_back(latency);
        nfes.push_back(st.counters.nfe);
        window_sum += st.mean_window;
        change_sum += st.mean_window_change;
        decode_sum += st.decode_seconds;
        last_end = std::max(last_end, s1);
      }
    });
  }
  for (auto& t : clients) t.join();
  const int64_t per_image = engine.Models()[0].grid * engine.Models()[0].grid;
  engine.Shutdown(std::chrono::seconds(0));
  cell.method = label;
  cell.mode = mode.name;
  cell.concurrency = c;
  cell.budget = mode.budget;
  cell.images = static_cast<int64_t>(cell.latencies.size());
  cell.seconds = std::chrono::duration<double>(last_end - t0).count();
  // Throughput under the full load: image tokens committed until the clients stop
  // submitting, in images (completed images alone come in waves of c at high concurrency).

  cell.p50 = Percentile(cell.latencies, 0.5);
  cell.p99 = Percentile(cell.latencies, 0.99);
  double sum = 0, nsum = 0;
  for (double l : cell.latencies) sum += l;
  for (int64_t n : nfes) nsum += static_cast<double>(n);
  const double images = static_cast<double>(std::max<int64_t>(cell.images, 1));
  cell.mean_latency = sum / images;
  cell.nfe = nsum / images;
  cell.mean_window = window_sum / images;
  cell.window_change = change_sum / images;
  cell.decode_ms = 1000 * decode_sum / images;
  std::lock_guard<std::mutex> l(totals.mu);
  cell.images_per_s =
      static_cast<double>(totals.committed_before_stop) / static_cast<double>(per_image) / seconds;
  const double steps = static_cast<double>(std::max<int64_t>(totals.steps, 1));
  cell.tokens_per_step = totals.tokens / steps;
  cell.requests_per_step = totals.requests / steps;
  cell.limited_frac = totals.limited / steps;
  cell.step_ms = 1000 * totals.seconds / steps;
  cell.plan_ms = 1000 * totals.plan_seconds / steps;
  cell.graph_captures = static_cast<double>(totals.captures);
  cell.cost_errors = totals.cost_error;
  cell.cost_err_p50 = Percentile(cell.cost_errors, 0.5);
  cell.cost_err_p90 = Percentile(cell.cost_errors, 0.9);
  cell.expected_vs_committed =
      totals.expected > 0 ? static_cast<double>(totals.planned_committed) / totals.expected : 0;
  return cell;
}

// Repeats of one cell: images/s is the median of the repeats' rates; latency percentiles come
// from all their requests together; the rest are means.
Cell Combine(const std::vector<Cell>& runs) {
  Cell c = runs[0];
  c.repeats = static_cast<int>(runs.size());
  std::vector<double> rates;
  c.latencies.clear();
  c.cost_errors.clear();
  c.by_method.clear();
  double nfe = 0, tps = 0, rps = 0, lim = 0, ms = 0, win = 0, evc = 0, plan = 0, dwin = 0;
  double capt = 0, dec = 0;
  c.images = 0;
  c.seconds = 0;
  for (const Cell& r : runs) {
    rates.push_back(r.images_per_s);
    c.latencies.insert(c.latencies.end(), r.latencies.begin(), r.latencies.end());
    c.cost_errors.insert(c.cost_errors.end(), r.cost_errors.begin(), r.cost_errors.end());
    for (const auto& [m, ls] : r.by_method) {
      c.by_method[m].insert(c.by_method[m].end(), ls.begin(), ls.end());
    }
    c.images += r.images;
    c.seconds += r.seconds;
    nfe += r.nfe * static_cast<double>(r.images);
    win += r.mean_window * static_cast<double>(r.images);
    dwin += r.window_change * static_cast<double>(r.images);
    dec += r.decode_ms * static_cast<double>(r.images);
    tps += r.tokens_per_step;
    rps += r.requests_per_step;
    lim += r.limited_frac;
    ms += r.step_ms;
    plan += r.plan_ms;
    capt += r.graph_captures;
    evc += r.expected_vs_committed;
  }
  const double n = static_cast<double>(runs.size());
  const double images = std::max<double>(static_cast<double>(c.images), 1);
  c.images_per_s = Percentile(rates, 0.5);
  c.p50 = Percentile(c.latencies, 0.5);
  c.p99 = Percentile(c.latencies, 0.99);
  double sum = 0;
  for (double l : c.latencies) sum += l;
  c.mean_latency = sum / std::max<double>(static_cast<double>(c.latencies.size()), 1);
  c.nfe = nfe / images;
  c.mean_window = win / images;
  c.window_change = dwin / images;
  c.decode_ms = dec / images;
  c.tokens_per_step = tps / n;
  c.requests_per_step = rps / n;
  c.limited_frac = lim / n;
  c.step_ms = ms / n;
  c.plan_ms = plan / n;
  c.graph_captures = capt / n;
  c.expected_vs_committed = evc / n;
  c.cost_err_p50 = Percentile(c.cost_errors, 0.5);
  c.cost_err_p90 = Percentile(c.cost_errors, 0.9);
  return c;
}

void PrintHeader() {
  std::printf("%-8s %-11s %4s %6s %8s %7s %7s %7s %6s %5s %8s %6s %7s %7s %6s %5s %6s\n", "method",
              "mode", "c", "images", "img/s", "p50 s", "p99 s", "NFE", "window", "dwin", "tok/step",
              "req/st", "step ms", "plan ms", "err50", "capt", "dec ms");
}

void Print(const Cell& r) {
  std::printf(
      "%-8s %-11s %4lld %6lld %8.2f %7.2f %7.2f %7.1f %6.1f %5.1f %8.1f %6.1f %7.1f %7.3f %6s "
      "%5.0f %6.2f\n",
      r.method.c_str(), r.mode.c_str(), static_cast<long long>(r.concurrency),
      static_cast<long long>(r.images), r.images_per_s, r.p50, r.p99, r.nfe, r.mean_window,
      r.window_change, r.tokens_per_step, r.requests_per_step, r.step_ms, r.plan_ms,
      r.cost_errors.empty()
          ? "-"
          : (std::to_string(static_cast<int>(100 * r.cost_err_p50 + 0.5)) + "%").c_str(),
      r.graph_captures, r.decode_ms);
  std::fflush(stdout);
}

void WriteCsv(const std::string& path, const std::vector<Cell>& cells) {
  std::ofstream f(path);
  f << "method,mode,concurrency,budget,images,seconds,images_per_s,p50_s,p99_s,mean_latency_s,"
       "nfe,mean_window,tokens_per_step,requests_per_step,window_limited_steps,step_ms,"
       "plan_ms,cost_error_p50,cost_error_p90,committed_over_expected,mean_window_change,"
       "graph_captures,decode_ms\n";
  for (const Cell& r : cells) {
    f << r.method << "," << r.mode << "," << r.concurrency << "," << r.budget << "," << r.images
      << "," << r.seconds << "," << r.images_per_s << "," << r.p50 << "," << r.p99 << ","
      << r.mean_latency << "," << r.nfe << "," << r.mean_window << "," << r.tokens_per_step << ","
      << r.requests_per_step << "," << r.limited_frac << "," << r.step_ms << "," << r.plan_ms << ","
      << r.cost_err_p50 << "," << r.cost_err_p90 << "," << r.expected_vs_committed << ","
      << r.window_change << "," << r.graph_captures << "," << r.decode_ms << "\n";
  }
}

// A preset, or preset@W for its policy with a window of W nodes (e.g. scd-mc@16).
DecodingPolicy PolicyOrDie(const std::string& method) {
  const size_t at = method.find('@');
  int64_t window = 0;
  if (at != std::string::npos) {
    char* end = nullptr;
    window = std::strtoll(method.c_str() + at + 1, &end, 10);
    if (end == method.c_str() + at + 1 || *end != '\0' || window < 1) {
      std::fprintf(stderr, "error: method '%s': the window after '@' must be a positive integer\n",
                   method.c_str());
      std::exit(2);
    }
  }
  auto policy = PolicyFromPreset(method.substr(0, at), window);
  if (!policy.ok()) {
    std::fprintf(stderr, "error: %s\n", policy.status().ToString().c_str());
    std::exit(2);
  }
  return *policy;
}

}  // namespace

int main(int argc, char** argv) {
  OpProfile::InstallIfRequested();
  Flags f(argc, argv,
          {{"models-dir", DefaultModelsDir()},
           {"model", "fmnist-gpt"},
           {"device", "cpu"},
           {"dtype", "auto"},
           {"methods", "ar,sjd,scd-mc,sjd-pac"},
           {"concurrency", "1,2,4,8,16,32,64"},
           {"seconds", "8"},
           {"seconds-per-client", "0.35"},
           {"modes", "none,budget:128,budget:256,budget:512,goodput"},
           {"mixed-methods", "ar,scd-mc,sjd-pac,sd"},
           {"mixed-concurrency", "4,16,64"},
           {"mixed-modes", "none,budget:256,goodput"},
           {"max-slowdown", "0.25"},
           {"window-stickiness", "0"},
           {"min-speculation-gain", "0.03"},
           {"lone-full-window", "1"},
           {"lone-max-window", "-1"},
           {"explore-every", "16"},
           {"explore-budget", "0.02"},
           {"fixed-step-cost", ""},
           {"refine-step-cost", "1"},
           {"simulated-step-noise", "0"},
           {"simulated-tree-cost", "0"},
           {"simulated-capture-cost", "0"},
           {"refine-on-captures", "1"},
           {"step-cost-max-ratio", "2"},
           {"step-cost-spot-check", "3"},
           {"keep-cut-drafts", "1"},
           {"cache-dir", ""},
           {"batch-invariant", "1"},
           {"row-attention", "1"},
           {"small-rows-gemm", "1"},
           {"small-rows-gemm-rows", "0"},
           {"cpu-linear", "blas"},
           {"fused-norm-rope", "1"},
           {"matmul-precision", "highest"},
           {"cuda-graphs", "-1"},
           {"fused-verify", "1"},
           {"decode-thread", "-1"},
           {"decode-images", "1"},
           {"decode-batch", "-1"},
           {"warmup", "0"},
           {"warmup-methods", ""},
           {"warmup-concurrency", ""},
           {"trace-dir", ""},
           {"commit-warmup-steps", "0"},
           {"commit-learn-growth", "0"},
           {"repeat", "1"},
           {"out-dir", "load-bench"}},
          "usage: imagegen-load-bench [--methods LIST (preset or preset@window)] "
          "[--concurrency LIST] [--modes LIST] [--seconds S] [--mixed-methods LIST] --out-dir DIR");
  const std::string out = f.Str("out-dir");
  if (std::error_code ec; !std::filesystem::create_directories(out, ec) && ec) {
    f.Fail("cannot create --out-dir " + out + ": " + ec.message());
  }
  EngineOptions base;
  base.models_dir = f.Str("models-dir");
  base.models = {f.Str("model")};
  base.device = f.Str("device");
  base.dtype = f.Str("dtype");
  base.batch_invariant = f.Int("batch-invariant") != 0;
  base.row_attention = f.Int("row-attention") != 0;               // EngineOptions::row_attention
  base.small_rows_gemm = f.Int("small-rows-gemm") != 0;           // EngineOptions::small_rows_gemm
  base.small_rows_gemm_rows = f.Int("small-rows-gemm-rows");      // ...small_rows_gemm_rows
  base.cpu_linear = f.Str("cpu-linear");                          // blas, or engine
  base.fused_norm_rope = f.Int("fused-norm-rope") != 0;           // EngineOptions::fused_norm_rope
  base.matmul_precision = f.Str("matmul-precision");              // highest, or medium (bf16)
  base.cuda_graphs = static_cast<int>(f.Int("cuda-graphs"));      // EngineOptions: -1 by device
  base.fused_verify = f.Int("fused-verify") != 0;                 // EngineOptions::fused_verify
  base.decode_thread = static_cast<int>(f.Int("decode-thread"));  // EngineOptions::decode_thread
  base.decode_batch = f.Int("decode-batch");                      // EngineOptions::decode_batch
  // EngineOptions::warmup (0 by default here, unlike the engine's -1: figures comparable with
  // earlier runs, and a GPU lease's minutes kept); empty lists: each cell's own methods and load.
  base.warmup = static_cast<int>(f.Int("warmup"));
  base.warmup_methods = f.List("warmup-methods");
  base.warmup_concurrency = f.Ints("warmup-concurrency");
  base.kv_cache_bytes = int64_t{8} << 30;
  base.max_slowdown = f.Num("max-slowdown");
  base.window_stickiness = f.Num("window-stickiness");        // EngineOptions::window_stickiness
  base.min_speculation_gain = f.Num("min-speculation-gain");  // EngineOptions::
  base.lone_request_full_window = f.Int("lone-full-window") != 0;  // EngineOptions
  base.lone_request_max_window = f.Int("lone-max-window");
  base.explore_every = f.Int("explore-every");    // EngineOptions::explore_every (0: never)
  base.explore_budget = f.Num("explore-budget");  // EngineOptions::explore_budget
  base.commit_warmup_steps = f.Int("commit-warmup-steps");  // EngineOptions: 0 counts every step
  base.commit_learn_growth = f.Int("commit-learn-growth") != 0;  // EngineOptions (0: held only)
  // --fixed-step-cost BASE,PER_TOKEN,PER_REQUEST (seconds): the goodput controller plans with
  // this step cost instead of a calibration (EngineOptions::fixed_step_cost), e.g. a GPU's on
  // the CPU, to see the windows it would choose there.
  base.fixed_step_cost = f.Nums("fixed-step-cost");
  if (!base.fixed_step_cost.empty() && base.fixed_step_cost.size() != 3) {
    f.Fail("--fixed-step-cost: expected BASE,PER_TOKEN,PER_REQUEST");
  }
  base.refine_step_cost = f.Int("refine-step-cost") != 0;         // EngineOptions::refine_step_cost
  base.simulated_step_noise = f.Num("simulated-step-noise");      // with --fixed-step-cost
  base.simulated_tree_cost = f.Num("simulated-tree-cost");        // EngineOptions, seconds
  base.simulated_capture_cost = f.Num("simulated-capture-cost");  // EngineOptions, a factor
  base.refine_on_captures = f.Int("refine-on-captures") != 0;     // EngineOptions
  base.step_cost_max_ratio = f.Num("step-cost-max-ratio");        // EngineOptions, 0: unbounded
  base.step_cost_spot_check = f.Num("step-cost-spot-check");      // EngineOptions, 0: off
  base.keep_cut_drafts = f.Int("keep-cut-drafts") != 0;           // EngineOptions::keep_cut_drafts
  // The goodput cells share one calibration (measured by the warm-up below).
  base.cache_dir = f.Str("cache-dir").empty() ? out + "/cache" : f.Str("cache-dir");
  const double seconds = f.Num("seconds"), per_client = f.Num("seconds-per-client");
  auto cell_seconds = [&](int64_t c) {
    return std::max(seconds, per_client * static_cast<double>(c));
  };
  // Every list is checked here, before the first cell runs (a typo must not wait for the
  // grid's half hour).
  std::vector<Mode> modes, mixed_modes;
  for (const auto& m : f.List("modes")) modes.push_back(ParseMode(f, "modes", m));
  for (const auto& m : f.List("mixed-modes")) mixed_modes.push_back(ParseMode(f, "mixed-modes", m));
  std::vector<DecodingPolicy> mixed;
  for (const auto& m : f.List("mixed-methods")) mixed.push_back(PolicyOrDie(m));
  for (const auto& m : f.List("methods")) PolicyOrDie(m);
  const int repeats = static_cast<int>(std::max<int64_t>(1, f.Int("repeat")));

  // Warm-up (allocator, thread pools, the goodput calibration), not reported. With 32 clients
  // its engine has the slots to calibrate with up to 32 requests at a time, which every cell
  // then reuses (with 2 clients, the calibration measured one request at a time only, and the
  // cost of many requests was left to extrapolation and online refinement).
  const bool decode_images = f.Int("decode-images") != 0;
  // --trace-dir DIR: every cell's steps as the controller saw them (EngineOptions::trace_steps),
  // DIR/trace_<method>_<mode>_c<clients>_<n>.csv, one row per request and step.
  const std::string trace_dir = f.Str("trace-dir");
  if (std::error_code ec;
      !trace_dir.empty() && !std::filesystem::create_directories(trace_dir, ec) && ec) {
    f.Fail("cannot create --trace-dir " + trace_dir + ": " + ec.message());
  }
  RunCell(base, {PolicyOrDie("scd-mc")}, "warm-up", ParseMode(f, "modes", "goodput"), 32, 2,
          1u << 30, decode_images);

  uint64_t seed = 0;
  // Runs every mode for one (policies, c), alternating their order on repeats.
  auto run_modes = [&](const std::vector<DecodingPolicy>& policies, const std::string& label,
                       const std::vector<Mode>& ms, int64_t c) {
    std::vector<std::vector<Cell>> runs(ms.size());
    for (int r = 0; r < repeats; ++r) {
      for (size_t k = 0; k < ms.size(); ++k) {
        const size_t i = r % 2 == 0 ? k : ms.size() - 1 - k;
        runs[i].push_back(RunCell(base, policies, label, ms[i], c, cell_seconds(c), seed += 100000,
                                  decode_images, trace_dir));
      }
    }
    std::vector<Cell> cells;
    for (const auto& rs : runs) {
      cells.push_back(Combine(rs));
      Print(cells.back());
    }
    return cells;
  };

  std::vector<Cell> cells;
  std::map<std::pair<std::string, int64_t>, std::map<std::string, Cell>> grid;
  PrintHeader();
  // Concurrency outermost: the methods' cells at one concurrency run close together in time,
  // so that a slow drift of the machine does not fall between AR and the method it is
  // compared with.
  for (int64_t c : f.Ints("concurrency")) {
    for (const auto& m : f.List("methods")) {
      const DecodingPolicy policy = PolicyOrDie(m);
      // A method without drafts feeds one token whatever the mode: "none" and "goodput" only
      // (their difference is the noise of one cell), plus "serial" if asked for.
      std::vector<Mode> ms;
      for (const Mode& mode : modes) {
        if (policy.draft == DraftSource::kNone && mode.policy == "budget") continue;
        ms.push_back(mode);
      }
      for (Cell& cell : run_modes({policy}, m, ms, c)) {
        grid[{m, c}][cell.mode] = cell;
        cells.push_back(std::move(cell));
      }
    }
    // Written again after each concurrency: a run stopped at a time limit keeps what it did.
    WriteCsv(out + "/results.csv", cells);
  }

  // Side by side: AR, whole windows, the best fixed budget of the sweep, the controller.
  std::printf(
      "\nRatios measured in this run (images/s; \"best budget\" is the best of this run's "
      "budget modes for the cell):\n%-8s %4s %8s %8s %14s %8s %9s %14s %12s\n",
      "method", "c", "ar", "none", "best budget", "goodput", "gp/none", "gp/max(ar,bb)",
      "p50 gp/ar");
  std::vector<double> noise;
  for (const auto& [key, by_mode] : grid) {
    const auto ar = grid.find({"ar", key.second});
    const auto gp = by_mode.find("goodput");
    if (key.first == "ar") {
      const auto none = by_mode.find("none");
      if (gp != by_mode.end() && none != by_mode.end()) {
        noise.push_back(std::abs(gp->second.images_per_s / none->second.images_per_s - 1));
      }
      continue;
    }
    const Cell* best = nullptr;
    for (const auto& [name, cell] : by_mode) {
      if (name.rfind("budget:", 0) == 0 &&
          (best == nullptr || cell.images_per_s > best->images_per_s))
        best = &cell;
    }
    const double ar_rate =
        ar != grid.end() && ar->second.count("none") ? ar->second.at("none").images_per_s : 0;
    const double ar_p50 =
        ar != grid.end() && ar->second.count("none") ? ar->second.at("none").p50 : 0;
    const double none = by_mode.count("none") ? by_mode.at("none").images_per_s : 0;
    const double g = gp != by_mode.end() ? gp->second.images_per_s : 0;
    const double bb = best != nullptr ? best->images_per_s : 0;
    std::printf("%-8s %4lld %8.2f %8.2f %8.2f %-5s %8.2f %9.2f %14.2f %12.2f\n", key.first.c_str(),
                static_cast<long long>(key.second), ar_rate, none, bb,
                best != nullptr ? best->mode.substr(7).c_str() : "-", g, none > 0 ? g / none : 0,
                std::max(ar_rate, bb) > 0 ? g / std::max(ar_rate, bb) : 0,
                gp != by_mode.end() && ar_p50 > 0 ? gp->second.p50 / ar_p50 : 0);
  }
  if (!noise.empty()) {
    std::printf(
        "noise: ar under goodput vs none (the same configuration): median |diff| %.0f%%, "
        "max %.0f%% over %zu cells\n",
        100 * Percentile(noise, 0.5), 100 * Percentile(noise, 1.0), noise.size());
  }
  std::vector<double> errors;
  for (const Cell& c : cells) {
    if (c.mode == "goodput")
      errors.insert(errors.end(), c.cost_errors.begin(), c.cost_errors.end());
  }
  if (!errors.empty()) {
    std::printf(
        "step-cost model, |measured / predicted - 1| over %zu goodput steps: median %.1f%%, "
        "p90 %.1f%%\n",
        errors.size(), 100 * Percentile(errors, 0.5), 100 * Percentile(errors, 0.9));
  }

  // The mixed load: client k runs method k mod M.
  if (!mixed.empty() && !mixed_modes.empty()) {
    std::printf("\nMixed load (client k runs %s[k mod %zu]):\n", f.Str("mixed-methods").c_str(),
                mixed.size());
    PrintHeader();
    std::ofstream mf(out + "/mixed.csv");
    mf << "mode,concurrency,method,images,images_per_s,p50_s,p99_s\n";
    for (int64_t c : f.Ints("mixed-concurrency")) {
      for (const Cell& cell : run_modes(mixed, "mixed", mixed_modes, c)) {
        mf << cell.mode << "," << c << ",all," << cell.images << "," << cell.images_per_s << ","
           << cell.p50 << "," << cell.p99 << "\n";
        for (const auto& [m, ls] : cell.by_method) {
          const double rate = static_cast<double>(ls.size()) / std::max(cell.seconds, 1e-9) *
                              static_cast<double>(cell.repeats);
          std::printf("    %-8s %6zu images %8.2f img/s  p50 %6.2f s  p99 %6.2f s\n", m.c_str(),
                      ls.size(), rate, Percentile(ls, 0.5), Percentile(ls, 0.99));
          mf << cell.mode << "," << c << "," << m << "," << ls.size() << "," << rate << ","
             << Percentile(ls, 0.5) << "," << Percentile(ls, 0.99) << "\n";
        }
      }
    }
  }
  const std::string plot = std::string("'") + testing::ConfiguredPython() + "' '" +
                           testing::SourceDir() + "/tools/plot_load_bench.py' '" + out + "'";
  if (std::system(plot.c_str()) != 0)
    std::fprintf(stderr, "warning: plotting failed: %s\n", plot.c_str());
  return 0;
}
