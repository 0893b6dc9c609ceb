// imagegen-admission-bench: one client's burst against another client's steady requests, on
// the serving engine (no gRPC), under each admission order side by side (wait_queue.h):
// "fair" (the default: within a priority, the client with the fewest requests running first)
// and "fifo", and "fair-keys": fair with each client an API key's tenant (GenerateParams::tenant,
// the name of its key in the daemon). Per round, for each admission in alternating order (ABAB):
//   - client "heavy" submits --burst requests at once, spread over --heavy-users user names
//     (one tenant "heavy" under fair-keys: an app relaying its many users' requests);
//   - client "light" then submits --light requests one after another (each once the previous
//     has finished), the first right after the burst; with --light-gap S, each S seconds after
//     the previous one finished (the first S seconds after the burst), so that they arrive
//     while the burst's requests hold every slot;
//   - the round ends when every request has finished.
// Reported per admission (median over --repeat rounds): the light client's latency (its first
// request's and its worst, submission to image) and the time its requests take together, the
// heavy burst's makespan, and the images per second of the whole round; then fair / fifo
// ratios (and the first admission listed / each other) from rounds run back to back. The engine
// (and its
// step-cost calibration, cached) is started once per admission and reused across rounds.
// "fair-nopreempt" is fair with EngineOptions::preemption off: with --light-priority -1 the
// light client's requests are more urgent than the burst, and the pair shows what preemption
// gives them (a slot at once instead of after a running image) and costs the burst.
//
//   imagegen-admission-bench --burst 48 --light 6 --method ar --slots 8 --repeat 3
//   imagegen-admission-bench --heavy-users 8 --admissions fair-keys,fair
//   imagegen-admission-bench --light-priority -1 --light-gap 0.7 --admissions fair,fair-nopreempt
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "bench/common.h"  // flags, OrDie (header-only: no libpng needed)
#include "engine/scheduler/engine.h"
#include "engine/util/percentile.h"

using namespace imagegen;

namespace {

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// Counts finished requests; each records when it ended.
class Done : public RequestObserver {
 public:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int64_t ended = 0, failed = 0;
    std::string error;
  };
  explicit Done(Shared* s) : s_(s) {}
  void OnComplete(RequestResult) override { End(""); }
  void OnError(const Status& st) override { End(st.ToString()); }
  Clock::time_point at;

 private:
  void End(const std::string& err) {
    std::lock_guard<std::mutex> l(s_->mu);
    at = Clock::now();
    s_->ended += 1;
    if (!err.empty()) {
      s_->failed += 1;
      s_->error = err;
    }
    s_->cv.notify_all();
  }
  Shared* s_;
};

struct Round {
  double light_first = 0, light_worst = 0, light_total = 0, heavy_makespan = 0;
  double images_per_second = 0;
  int64_t preempted = 0;  // running requests that gave up their slots in the round
};

Round RunRound(Engine& engine, const Flags& f, const DecodingPolicy& policy, uint64_t seed0,
               bool tenants) {
  const int64_t burst = f.Int("burst"), light = f.Int("light"), users = f.Int("heavy-users");
  Done::Shared shared;
  const int64_t preempted0 = engine.Stats().preempted;
  auto params = [&](const std::string& client, uint64_t seed) {
    GenerateParams p;
    if (tenants) p.tenant = client.substr(0, client.find('-'));
    p.model = f.Str("model");
    p.class_id = static_cast<int64_t>(seed % 10);
    p.seed = seed;
    p.policy = policy;
    p.client = client;
    if (client.rfind("light", 0) == 0) p.priority = static_cast<int32_t>(f.Int("light-priority"));
    p.decode_image = true;
    return p;
  };
  const auto t0 = Clock::now();
  std::vector<std::shared_ptr<Done>> heavy;
  for (int64_t i = 0; i < burst; ++i) {
    heavy.push_back(std::make_shared<Done>(&shared));
    const std::string user = "heavy-" + std::to_string(i % std::max<int64_t>(users, 1));
    OrDie(engine.Submit(params(user, seed0 + static_cast<uint64_t>(i)), heavy.back()).status());
  }
  std::vector<double> light_latency;
  const auto light_t0 = Clock::now();
  const auto gap = std::chrono::duration<double>(f.Num("light-gap"));
  for (int64_t i = 0; i < light; ++i) {
    std::this_thread::sleep_for(gap);
    auto d = std::make_shared<Done>(&shared);
    const auto t = Clock::now();
    OrDie(engine.Submit(params("light-0", seed0 + 1000 + static_cast<uint64_t>(i)), d).status());
    std::unique_lock<std::mutex> l(shared.mu);
    shared.cv.wait(l, [&] { return d->at != Clock::time_point{}; });
    light_latency.push_back(Since(t, d->at));
  }
  const double light_total = Since(light_t0, Clock::now());
  {
    std::unique_lock<std::mutex> l(shared.mu);
    shared.cv.wait(l, [&] { return shared.ended == burst + light; });
    if (shared.failed > 0) {
      std::fprintf(stderr, "error: %lld requests failed: %s\n",
                   static_cast<long long>(shared.failed), shared.error.c_str());
      std::exit(1);
    }
  }
  Round r;
  Clock::time_point last = t0;
  for (const auto& h : heavy) last = std::max(last, h->at);
  r.heavy_makespan = Since(t0, last);
  r.light_first = light_latency.front();
  r.light_total = light_total;
  r.light_worst = *std::max_element(light_latency.begin(), light_latency.end());
  r.images_per_second = static_cast<double>(burst + light) / Since(t0, Clock::now());
  r.preempted = engine.Stats().preempted - preempted0;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f(argc, argv,
          {{"models-dir", "models"},
           {"model", "fmnist-gpt"},
           {"method", "ar"},
           {"burst", "48"},
           {"light", "6"},
           {"heavy-users", "1"},
           {"light-priority", "0"},
           {"light-gap", "0"},
           {"slots", "8"},
           {"repeat", "3"},
           {"threads", "0"},
           {"cache-dir", ""},
           {"admissions", "fair,fifo"}},
          "imagegen-admission-bench: a burst from one client against another client's requests, "
          "fair vs fifo admission");
  const DecodingPolicy policy = OrDie(PolicyFromPreset(f.Str("method"), 0));
  const std::vector<std::string> admissions = f.List("admissions");
  std::map<std::string, std::unique_ptr<Engine>> engines;
  for (const std::string& a : admissions) {
    EngineOptions o;
    o.models_dir = f.Str("models-dir");
    o.models = {f.Str("model")};
    o.max_slots = f.Int("slots");
    o.max_queue = f.Int("burst") + f.Int("light") + 8;
    o.admission = a == "fifo" ? "fifo" : "fair";
    o.preemption = a != "fair-nopreempt";
    if (a != "fair" && a != "fifo" && a != "fair-keys" && a != "fair-nopreempt") {
      std::fprintf(stderr, "--admissions: fair, fifo, fair-keys or fair-nopreempt, not '%s'\n",
                   a.c_str());
      return 2;
    }
    o.cpu_threads = f.Int("threads");
    o.cache_dir =
        f.Str("cache-dir").empty()
            ? (std::filesystem::temp_directory_path() / "imagegen-admission-bench").string()
            : f.Str("cache-dir");
    engines[a] = OrDie(Engine::Start(o));
  }
  std::map<std::string, std::vector<Round>> rounds;
  for (int64_t r = 0; r < f.Int("repeat"); ++r) {
    std::vector<std::string> order = admissions;
    if (r % 2 == 1) std::reverse(order.begin(), order.end());  // ABAB: neither always first
    for (const std::string& a : order) {
      const Round x =
          RunRound(*engines[a], f, policy, static_cast<uint64_t>(r) * 10000, a == "fair-keys");
      std::printf(
          "round %lld %-9s light: first %.2f s, worst %.2f s, all %.2f s | heavy makespan %.2f s "
          "| %.2f images/s | %lld preempted\n",
          static_cast<long long>(r), a.c_str(), x.light_first, x.light_worst, x.light_total,
          x.heavy_makespan, x.images_per_second, static_cast<long long>(x.preempted));
      std::fflush(stdout);
      rounds[a].push_back(x);
    }
  }
  auto median = [](const std::vector<Round>& v, double Round::*m) {
    std::vector<double> x;
    for (const Round& r : v) x.push_back(r.*m);
    return Percentile(x, 0.5);
  };
  std::printf("\n%s, burst %lld (%lld users) + light %lld, %lld slots, median of %lld rounds\n",
              f.Str("method").c_str(), static_cast<long long>(f.Int("burst")),
              static_cast<long long>(f.Int("heavy-users")), static_cast<long long>(f.Int("light")),
              static_cast<long long>(f.Int("slots")), static_cast<long long>(f.Int("repeat")));
  std::printf(
      "| admission | light: first image (s) | light: worst (s) | light: all %lld (s) | heavy "
      "makespan (s) | images/s |\n|---|---|---|---|---|---|\n",
      static_cast<long long>(f.Int("light")));
  for (const std::string& a : admissions) {
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n", a.c_str(),
                median(rounds[a], &Round::light_first), median(rounds[a], &Round::light_worst),
                median(rounds[a], &Round::light_total), median(rounds[a], &Round::heavy_makespan),
                median(rounds[a], &Round::images_per_second));
  }
  // Per round, the first admission listed / each other, from rounds run back to back.
  for (size_t k = 1; k < admissions.size(); ++k) {
    const std::string &x = admissions[0], &y = admissions[k];
    std::printf("\nper round, %s / %s:", x.c_str(), y.c_str());
    for (size_t i = 0; i < rounds[x].size(); ++i) {
      const Round &a = rounds[x][i], &b = rounds[y][i];
      std::printf(" [light first %.2fx, all %.2fx; heavy makespan %.2fx; images/s %.2fx]",
                  a.light_first / b.light_first, a.light_total / b.light_total,
                  a.heavy_makespan / b.heavy_makespan, a.images_per_second / b.images_per_second);
    }
    std::printf("\n");
  }
  for (auto& [a, e] : engines) e->Shutdown(std::chrono::seconds(30));
  return 0;
}
