// imagegen-load-bench: closed-loop load on the serving engine (no gRPC). For each method and
// concurrency c, c client threads each submit a request, wait for its image, and submit the
// next, for --seconds; the same load then runs on an engine that serves one request at a time
// (two KV slots: one CFG request), which is what continuous batching is compared with. A
// second part sweeps the token budget at one concurrency. With --repeat R every cell runs R
// times, alternating with its counterpart, and the median rate is reported. Prints one table
// with the ratios measured in this run and writes results.csv, budget.csv and plots
// (tools/plot_load_bench.py).
//
//   imagegen-load-bench --methods ar,sjd,scd-mc,sjd-pac --concurrency 1,2,4,8,16,32 --out-dir out
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "bench/flags.h"
#include "engine/model/image_model.h"
#include "engine/scheduler/engine.h"
#include "engine/util/percentile.h"

using namespace imagegen;

namespace {

class Waiter : public RequestObserver {
 public:
  void OnComplete(RequestResult r) override {
    std::lock_guard<std::mutex> l(mu_);
    nfe_ = r.stats.counters.nfe;
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
  bool Wait(int64_t* nfe, std::string* err) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return done_; });
    *nfe = nfe_;
    *err = error_;
    return ok_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false, ok_ = false;
  int64_t nfe_ = 0;
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
  }
  std::mutex mu;
  int64_t steps = 0, tokens = 0, requests = 0, limited = 0;
  double seconds = 0;
};

struct Cell {
  std::string method, mode;
  int64_t concurrency = 0, budget = 0;
  int64_t images = 0;
  double seconds = 0, images_per_s = 0, p50 = 0, p99 = 0, mean_latency = 0, nfe = 0;
  double tokens_per_step = 0, requests_per_step = 0, limited_frac = 0, step_ms = 0;
  std::vector<double> latencies;
  int repeats = 1;
};

Cell RunCell(const EngineOptions& base, const std::string& method, const std::string& mode,
             int64_t c, int64_t budget, double seconds, uint64_t seed0) {
  EngineOptions o = base;
  o.max_tokens_per_step = budget;
  o.max_queue = std::max<int64_t>(c, 1);
  o.max_slots = mode == "serial" ? 2 : std::max<int64_t>(2 * c, 2);
  StepTotals totals;
  auto started = Engine::Start(o, &totals);
  if (!started.ok()) {
    std::fprintf(stderr, "error: %s\n", started.status().ToString().c_str());
    std::exit(1);
  }
  Engine& engine = **started;
  auto policy = PolicyFromPreset(method);
  if (!policy.ok()) {
    std::fprintf(stderr, "error: %s\n", policy.status().ToString().c_str());
    std::exit(2);
  }
  std::mutex mu;
  std::vector<double> latencies;
  std::vector<int64_t> nfes;
  std::atomic<uint64_t> next_seed{seed0};
  const auto t0 = Clock::now();
  const auto stop =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  Clock::time_point last_end = t0;
  std::vector<std::thread> clients;
  for (int64_t k = 0; k < c; ++k) {
    clients.emplace_back([&, k] {
      while (Clock::now() < stop) {
        GenerateParams p;
        const uint64_t seed = next_seed.fetch_add(1);
        p.class_id = static_cast<int64_t>(seed % 10);
        p.seed = seed;
        p.policy = *policy;
        auto w = std::make_shared<Waiter>();
        const auto s0 = Clock::now();
        auto id = engine.Submit(p, w);
        if (!id.ok()) {
          std::fprintf(stderr, "submit: %s\n", id.status().ToString().c_str());
          std::exit(1);
        }
        int64_t nfe = 0;
        std::string err;
        if (!w->Wait(&nfe, &err)) {
          std::fprintf(stderr, "request failed: %s\n", err.c_str());
          std::exit(1);
        }
        const auto s1 = Clock::now();
        std::lock_guard<std::mutex> l(mu);
        latencies.push_back(std::chrono::duration<double>(s1 - s0).count());
        nfes.push_back(nfe);
        last_end = std::max(last_end, s1);
      }
      (void)k;
    });
  }
  for (auto& t : clients) t.join();
  engine.Shutdown(std::chrono::seconds(0));
  Cell cell;
  cell.method = method;
  cell.mode = mode;
  cell.concurrency = c;
  cell.budget = budget;
  cell.images = static_cast<int64_t>(latencies.size());
  cell.latencies = latencies;
  cell.seconds = std::chrono::duration<double>(last_end - t0).count();
  cell.images_per_s = cell.images / cell.seconds;
  cell.p50 = Percentile(latencies, 0.5);
  cell.p99 = Percentile(latencies, 0.99);
  double sum = 0, nsum = 0;
  for (double l : latencies) sum += l;
  for (int64_t n : nfes) nsum += static_cast<double>(n);
  cell.mean_latency = sum / std::max<int64_t>(cell.images, 1);
  cell.nfe = nsum / std::max<int64_t>(cell.images, 1);
  std::lock_guard<std::mutex> l(totals.mu);
  const double steps = static_cast<double>(std::max<int64_t>(totals.steps, 1));
  cell.tokens_per_step = totals.tokens / steps;
  cell.requests_per_step = totals.requests / steps;
  cell.limited_frac = totals.limited / steps;
  cell.step_ms = 1000 * totals.seconds / steps;
  return cell;
}

// Repeats of one cell: images/s is the median of the repeats' rates; latency percentiles come
// from all their requests together; the rest are means.
Cell Combine(const std::vector<Cell>& runs) {
  Cell c = runs[0];
  c.repeats = static_cast<int>(runs.size());
  std::vector<double> rates;
  c.latencies.clear();
  double nfe = 0, tps = 0, rps = 0, lim = 0, ms = 0;
  c.images = 0;
  c.seconds = 0;
  for (const Cell& r : runs) {
    rates.push_back(r.images_per_s);
    c.latencies.insert(c.latencies.end(), r.latencies.begin(), r.latencies.end());
    c.images += r.images;
    c.seconds += r.seconds;
    nfe += r.nfe * static_cast<double>(r.images);
    tps += r.tokens_per_step;
    rps += r.requests_per_step;
    lim += r.limited_frac;
    ms += r.step_ms;
  }
  const double n = static_cast<double>(runs.size());
  c.images_per_s = Percentile(rates, 0.5);
  c.p50 = Percentile(c.latencies, 0.5);
  c.p99 = Percentile(c.latencies, 0.99);
  double sum = 0;
  for (double l : c.latencies) sum += l;
  c.mean_latency = sum / std::max<double>(static_cast<double>(c.latencies.size()), 1);
  c.nfe = nfe / std::max<double>(static_cast<double>(c.images), 1);
  c.tokens_per_step = tps / n;
  c.requests_per_step = rps / n;
  c.limited_frac = lim / n;
  c.step_ms = ms / n;
  return c;
}

void PrintHeader() {
  std::printf("%-8s %-7s %4s %6s %6s %8s %8s %8s %7s %8s %7s %7s\n", "method", "mode", "c",
              "budget", "images", "img/s", "p50 s", "p99 s", "NFE", "tok/step", "req/st",
              "step ms");
}

void Print(const Cell& r) {
  std::printf("%-8s %-7s %4lld %6lld %6lld %8.2f %8.2f %8.2f %7.1f %8.1f %7.1f %7.1f\n",
              r.method.c_str(), r.mode.c_str(), static_cast<long long>(r.concurrency),
              static_cast<long long>(r.budget), static_cast<long long>(r.images), r.images_per_s,
              r.p50, r.p99, r.nfe, r.tokens_per_step, r.requests_per_step, r.step_ms);
  std::fflush(stdout);
}

void WriteCsv(const std::string& path, const std::vector<Cell>& cells) {
  std::ofstream f(path);
  f << "method,mode,concurrency,budget,images,seconds,images_per_s,p50_s,p99_s,mean_latency_s,"
       "nfe,tokens_per_step,requests_per_step,budget_limited_steps,step_ms\n";
  for (const Cell& r : cells) {
    f << r.method << "," << r.mode << "," << r.concurrency << "," << r.budget << "," << r.images
      << "," << r.seconds << "," << r.images_per_s << "," << r.p50 << "," << r.p99 << ","
      << r.mean_latency << "," << r.nfe << "," << r.tokens_per_step << "," << r.requests_per_step
      << "," << r.limited_frac << "," << r.step_ms << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags f(argc, argv,
          {{"models-dir", DefaultModelsDir()},
           {"model", "fmnist-gpt"},
           {"device", "cpu"},
           {"dtype", "auto"},
           {"methods", "ar,sjd,scd-mc,sjd-pac"},
           {"concurrency", "1,2,4,8,16,32"},
           {"seconds", "15"},
           {"budget", "-1"},
           {"serial", "1"},
           {"sweep-budgets", "0,2048,512,256,128,64"},
           {"sweep-concurrency", "16"},
           {"sweep-methods", "ar,sjd,scd-mc"},
           {"batch-invariant", "1"},
           {"repeat", "1"},
           {"out-dir", "load-bench"}},
          "usage: imagegen-load-bench [--methods LIST] [--concurrency LIST] [--seconds S] "
          "[--budget TOKENS] [--sweep-budgets LIST] --out-dir DIR");
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
  base.kv_cache_bytes = int64_t{8} << 30;
  const double seconds = f.Num("seconds");
  const std::vector<int64_t> conc = f.Ints("concurrency");

  // Warm-up (allocator, thread pools), not reported.
  RunCell(base, "ar", "batched", 2, f.Int("budget"), 2, 1u << 30);

  std::vector<Cell> cells;
  std::map<std::pair<std::string, int64_t>, Cell> batched, serial;
  PrintHeader();
  uint64_t seed = 0;
  const int repeats = static_cast<int>(std::max<int64_t>(1, f.Int("repeat")));
  for (const auto& m : f.List("methods")) {
    for (int64_t c : conc) {
      // Batched and serial runs alternate, so slow drifts of the machine hit both alike.
      std::vector<Cell> bs, ss;
      for (int r = 0; r < repeats; ++r) {
        const bool serial_first = r % 2 == 1 && f.Int("serial") != 0;
        if (serial_first)
          ss.push_back(RunCell(base, m, "serial", c, f.Int("budget"), seconds, seed += 100000));
        bs.push_back(RunCell(base, m, "batched", c, f.Int("budget"), seconds, seed += 100000));
        if (!serial_first && f.Int("serial") != 0) {
          ss.push_back(RunCell(base, m, "serial", c, f.Int("budget"), seconds, seed += 100000));
        }
      }
      Cell b = Combine(bs);
      Print(b);
      cells.push_back(b);
      batched[{m, c}] = b;
      if (!ss.empty()) {
        Cell s = Combine(ss);
        Print(s);
        cells.push_back(s);
        serial[{m, c}] = s;
      }
    }
  }
  WriteCsv(out + "/results.csv", cells);

  std::printf("\nRatios measured in this run (throughput, images/s):\n%-8s %4s %16s %14s %14s\n",
              "method", "c", "batched/serial", "vs ar batched", "p50 vs ar");
  for (const auto& [key, b] : batched) {
    const auto ar = batched.find({"ar", key.second});
    const auto s = serial.find(key);
    std::printf("%-8s %4lld %16.2f %14.2f %14.2f\n", key.first.c_str(),
                static_cast<long long>(key.second),
                s != serial.end() ? b.images_per_s / s->second.images_per_s : 0.0,
                ar != batched.end() ? b.images_per_s / ar->second.images_per_s : 0.0,
                ar != batched.end() ? b.p50 / ar->second.p50 : 0.0);
  }

  std::vector<Cell> sweep;
  const int64_t sc = f.Int("sweep-concurrency");
  if (!f.List("sweep-budgets").empty()) {
    std::printf("\nToken budget sweep at concurrency %lld:\n", static_cast<long long>(sc));
    PrintHeader();
    const auto budgets = f.List("sweep-budgets");
    for (const auto& m : f.List("sweep-methods")) {
      std::vector<std::vector<Cell>> runs(budgets.size());
      for (int r = 0; r < repeats; ++r) {
        for (size_t k = 0; k < budgets.size(); ++k) {
          const size_t i = r % 2 == 0 ? k : budgets.size() - 1 - k;
          runs[i].push_back(
              RunCell(base, m, "batched", sc, std::stoll(budgets[i]), seconds, seed += 100000));
        }
      }
      for (const auto& rs : runs) {
        Cell cell = Combine(rs);
        Print(cell);
        sweep.push_back(cell);
      }
    }
    WriteCsv(out + "/budget.csv", sweep);
  }
  const std::string plot = std::string("'") + IMAGEGEN_DEFAULT_PYTHON + "' '" +
                           IMAGEGEN_SOURCE_DIR + "/tools/plot_load_bench.py' '" + out + "'";
  if (std::system(plot.c_str()) != 0)
    std::fprintf(stderr, "warning: plotting failed: %s\n", plot.c_str());
  return 0;
}
