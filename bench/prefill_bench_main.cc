// imagegen-prefill-bench: prefill under load (issue 17). A text-to-image model serves
// --running requests with short prompts; once they decode, one request with a --prompt-len
// token prompt arrives. Its prompt is prefilled in chunks beside their windows
// (--prefill-tokens-per-step, each value of --chunks; 0: the whole prompt in one step). For
// each chunk size, side by side in one run (--repeat times, the order alternating), it reports
// the running requests' step time before the long prompt arrives and while it is prefilled
// (mean and max, and their ratio), and the long request's time to its first token.
//
//   tools/make_t2i_toy.py --out /tmp/t2i-bench --name bench-t2i --dim 192 --layers 6
//       --heads 6 --ffn 512 --max-prompt 512   (one line)
//   imagegen-prefill-bench --models-dir /tmp/t2i-bench --model bench-t2i
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>

#include "bench/flags.h"
#include "engine/scheduler/engine.h"

using namespace imagegen;

namespace {

using Clock = std::chrono::steady_clock;

struct StepLog : EngineListener {
  void OnStep(const StepSample& s) override {
    std::lock_guard<std::mutex> l(mu);
    steps.push_back({Clock::now(), s.seconds, s.tokens});
    cv.notify_all();
  }
  struct Entry {
    Clock::time_point end;
    double seconds;
    int64_t tokens;
  };
  size_t Count() {
    std::lock_guard<std::mutex> l(mu);
    return steps.size();
  }
  void WaitFor(size_t n) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return steps.size() >= n; });
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Entry> steps;
};

struct Watch : RequestObserver {
  void OnStep(const StepEvent&) override {
    std::lock_guard<std::mutex> l(mu);
    if (first == Clock::time_point()) first = Clock::now();
  }
  void OnComplete(RequestResult r) override {
    std::lock_guard<std::mutex> l(mu);
    prefills = r.stats.prefill_forwards;
    done = true;
    cv.notify_all();
  }
  void OnError(const Status& s) override {
    std::fprintf(stderr, "request failed: %s\n", s.ToString().c_str());
    std::lock_guard<std::mutex> l(mu);
    done = true;
    cv.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
  std::mutex mu;
  std::condition_variable cv;
  Clock::time_point first;
  int64_t prefills = 0;
  bool done = false;
};

struct Result {
  double base_mean = 0, pre_mean = 0, pre_max = 0, ttft = 0;
  int64_t pre_steps = 0, prefills = 0, base_tokens = 0, pre_tokens = 0;
};

Result Run(const Flags& f, int64_t chunk) {
  EngineOptions o;
  o.models_dir = f.Str("models-dir");
  o.models = {f.Str("model")};
  o.window_policy = "full";
  o.prefill_tokens_per_step = chunk > 0 ? chunk : int64_t{1} << 30;
  o.kv_cache_bytes = f.Int("kv-cache-mb") << 20;
  o.cpu_threads = f.Int("threads");
  StepLog log;
  auto started = Engine::Start(o, &log);
  if (!started.ok()) {
    std::fprintf(stderr, "%s\n", started.status().ToString().c_str());
    std::exit(1);
  }
  Engine& engine = **started;
  const ModelInfo& info = engine.Models()[0];
  const auto policy = PolicyFromPreset(f.Str("method"));
  std::vector<std::shared_ptr<Watch>> running;
  for (int64_t i = 0; i < f.Int("running"); ++i) {
    GenerateParams p;
    p.prompt_token_ids = {0, 5 + i % 7, 9};
    p.seed = static_cast<uint64_t>(i);
    p.policy = *policy;
    p.decode_image = false;
    running.push_back(std::make_shared<Watch>());
    if (!engine.Submit(p, running.back()).ok()) std::exit(1);
  }
  const size_t warm = static_cast<size_t>(f.Int("warm-steps"));
  log.WaitFor(warm);
  GenerateParams p;
  std::mt19937 rng(7);
  for (int64_t i = 0; i < f.Int("prompt-len"); ++i) {
    p.prompt_token_ids.push_back(static_cast<int64_t>(rng() % info.text_vocab_size));
  }
  p.seed = 99;
  p.policy = *policy;
  p.decode_image = false;
  auto longreq = std::make_shared<Watch>();
  const auto t_sub = Clock::now();
  if (!engine.Submit(p, longreq).ok()) std::exit(1);
  longreq->Wait();
  for (auto& w : running) w->Wait();
  engine.Shutdown(std::chrono::milliseconds(0));
  Result r;
  r.ttft = std::chrono::duration<double>(longreq->first - t_sub).count();
  r.prefills = longreq->prefills;
  int64_t nb = 0;
  for (size_t i = 0; i < log.steps.size(); ++i) {
    const auto& s = log.steps[i];
    if (i >= 4 && s.end <= t_sub) {  // the first steps warm up
      r.base_mean += s.seconds;
      r.base_tokens = s.tokens;
      ++nb;
    } else if (s.end > t_sub && s.end <= longreq->first) {
      r.pre_mean += s.seconds;
      r.pre_max = std::max(r.pre_max, s.seconds);
      r.pre_tokens = std::max(r.pre_tokens, s.tokens);
      ++r.pre_steps;
    }
  }
  r.base_mean /= std::max<int64_t>(nb, 1);
  r.pre_mean /= std::max<int64_t>(r.pre_steps, 1);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f(argc, argv,
          {{"models-dir", "/tmp/t2i-bench"},
           {"model", "bench-t2i"},
           {"running", "16"},
           {"prompt-len", "480"},
           {"chunks", "16,64,0"},
           {"method", "ar"},
           {"warm-steps", "24"},
           {"repeat", "2"},
           {"kv-cache-mb", "1024"},
           {"threads", "0"}},
          "imagegen-prefill-bench: the running requests' step time while a long prompt is "
          "prefilled, per prefill chunk size");
  const std::vector<int64_t> chunks = f.Ints("chunks");
  std::printf(
      "%lld running requests (%s, CFG), then one with a %lld-token prompt; step times in ms\n",
      static_cast<long long>(f.Int("running")), f.Str("method").c_str(),
      static_cast<long long>(f.Int("prompt-len")));
  std::printf("%-10s %4s %10s %12s %12s %12s %9s %10s %9s %10s\n", "chunk", "run", "base ms",
              "prefill mean", "prefill max", "max/base", "steps", "rows/step", "prefills",
              "TTFT s");
  for (int64_t rep = 0; rep < f.Int("repeat"); ++rep) {
    std::vector<int64_t> order = chunks;
    if (rep % 2 == 1) std::reverse(order.begin(), order.end());
    for (int64_t c : order) {
      const Result r = Run(f, c);
      std::printf("%-10s %4lld %10.2f %12.2f %12.2f %12.2f %9lld %5lld/%-4lld %9lld %10.3f\n",
                  c > 0 ? std::to_string(c).c_str() : "whole", static_cast<long long>(rep),
                  1e3 * r.base_mean, 1e3 * r.pre_mean, 1e3 * r.pre_max, r.pre_max / r.base_mean,
                  static_cast<long long>(r.pre_steps), static_cast<long long>(r.base_tokens),
                  static_cast<long long>(r.pre_tokens), static_cast<long long>(r.prefills), r.ttft);
      std::fflush(stdout);
    }
  }
  return 0;
}
