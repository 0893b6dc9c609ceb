// The continuous-batching engine on the bundled model: mixed methods in one step loop, streamed
// grids, cancellation, deadlines, a bounded queue, the token budget, shutdown, and batch
// invariance (a request's image does not depend on what runs beside it).
#include "engine/scheduler/engine.h"
#include "engine/scheduler/preview_budget.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "engine/model/amx_gemm.h"
#include "engine/model/image_model.h"
#include "engine/util/cpu_idle.h"
#include "engine/util/json.h"
#include "engine/util/read_file.h"
#include "engine/scheduler/decode_queue.h"
#include "engine/scheduler/goodput.h"
#include "engine/scheduler/window_budget.h"
#include "tests/engine_client.h"
#include "tests/poll.h"
#include "tests/temp_dir.h"
#include "tests/test_util.h"
#include "tests/build_paths.h"

namespace imagegen {
namespace {

using testing::Recorder;

TEST(WindowBudgetTest, EverythingFitsOrNoBudget) {
  std::vector<WindowDemand> d = {{16, 2}, {1, 2}, {64, 1}};
  EXPECT_EQ(AllocateWindows(d, 0), (std::vector<int64_t>{16, 1, 64}));
  EXPECT_EQ(AllocateWindows(d, 98), (std::vector<int64_t>{16, 1, 64}));
}

TEST(WindowBudgetTest, WindowsShrinkEvenlyAndTheOldestGetTheRemainder) {
  // Costs at cap W: 2W + 2 + W = 3W + 2 (W <= 16); budget 40 -> W = 12, 2 tokens left -> the
  // oldest request above the cap gets one more.
  std::vector<WindowDemand> d = {{16, 2}, {1, 2}, {64, 1}};
  EXPECT_EQ(AllocateWindows(d, 40), (std::vector<int64_t>{13, 1, 12}));
  // Never below one token each, even past the budget.
  EXPECT_EQ(AllocateWindows(d, 3), (std::vector<int64_t>{1, 1, 1}));
  // The budget is spent exactly when the windows allow it.
  std::vector<WindowDemand> e(5, {32, 2});
  const auto w = AllocateWindows(e, 100);
  int64_t cost = 0;
  for (int64_t x : w) cost += 2 * x;
  EXPECT_EQ(cost, 100);
  EXPECT_EQ(*std::max_element(w.begin(), w.end()) - *std::min_element(w.begin(), w.end()), 0);
}

EngineOptions BundledOptions() {
  EngineOptions o;
  o.models_dir = imagegen::testing::TestModelsDir();
  // CUDA under bench/gpu/run_all.sh (IMAGEGEN_TEST_DEVICE), which runs some of these tests.
  if (testing::TestLoadOptions().device.is_cuda()) o.device = "cuda";
  // One step-cost calibration for all the tests' engines (goodput window control).
  o.cache_dir = testing::SharedStepCostCache();
  // A lone request's window at a fixed ceiling on the CPU (its default there comes from the
  // step-cost calibration, 1-4 nodes on the dev VM, which would make what these tests see of
  // a request alone depend on this machine's timing); EngineTest.ALoneRequestsWindowCeiling...
  // check the defaults.
  o.lone_request_max_window = testing::TestLoadOptions().device.is_cuda() ? 0 : 12;
  // No start-up warm-up (on by default with CUDA graphs, so under run_all.sh): it would run
  // over a hundred images at every engine start. EngineTest.WarmUp* turns it on.
  o.warmup = 0;
  return o;
}

std::unique_ptr<Engine> StartOrDie(const EngineOptions& o, EngineListener* l = nullptr) {
  auto e = Engine::Start(o, l);
  if (!e.ok()) throw std::runtime_error(e.status().ToString());
  return std::move(e).value();
}

GenerateParams Params(const std::string& method, int64_t cls, uint64_t seed) {
  GenerateParams p;
  p.class_id = cls;
  p.seed = seed;
  auto pol = PolicyFromPreset(method);
  if (!pol.ok()) throw std::runtime_error(pol.status().ToString());
  p.policy = *pol;
  return p;
}

// Waits until the engine has no request queued or active.
void WaitIdle(Engine& e) {
  for (int i = 0; i < 3000; ++i) {
    EngineStats s = e.Stats();
    if (s.models[0].queued == 0 && s.models[0].active == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  FAIL() << "engine never went idle";
}

// Submits n requests of `method` at once (request i: class i mod 10, seed seed0 + i), waits for
// every one and then for the engine to go idle.
void RunAtOnce(Engine& e, const std::string& method, int n, uint64_t seed0) {
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int i = 0; i < n; ++i) {
    rec.push_back(std::make_shared<Recorder>());
    EXPECT_TRUE(e.Submit(Params(method, i % 10, seed0 + i), rec.back()).ok());
  }
  for (auto& r : rec) EXPECT_TRUE(r->Wait());
  WaitIdle(e);
}

// Submits one request and waits for it: its result (empty where it failed).
RequestResult DrawOne(Engine& e, const GenerateParams& p) {
  auto r = std::make_shared<Recorder>();
  EXPECT_TRUE(e.Submit(p, r).ok());
  EXPECT_TRUE(r->Wait());
  return r->result.value_or(RequestResult{});
}

class StepLog : public EngineListener {
 public:
  void OnStep(const StepSample& s) override {
    std::lock_guard<std::mutex> l(mu);
    samples.push_back(s);
  }
  std::mutex mu;
  std::vector<StepSample> samples;
};

TEST(EngineTest, MixedMethodsRunTogetherAndTheStreamReassemblesTheGrid) {
  StepLog log;
  EngineOptions o = BundledOptions();
  o.preview_share = 0;  // every due preview, so that the test knows the steps that have one
  // Whole windows: every speculative method must speculate here (under load the goodput
  // controller may rightly hold a 21-node tree to AR on the CPU).
  o.window_policy = "full";
  auto engine = StartOrDie(o, &log);
  ASSERT_EQ(engine->Models().size(), 1u);
  const ModelInfo& info = engine->Models()[0];
  EXPECT_EQ(info.name, "fmnist-gpt");
  EXPECT_EQ(info.grid, 14);
  EXPECT_EQ(info.draft_model, "fmnist-draft");
  EXPECT_EQ(info.methods, PresetNames());  // every preset, sd and cool-sd included
  std::vector<std::shared_ptr<Recorder>> rec;
  const auto& methods = PresetNames();
  for (int i = 0; i < 12; ++i) {
    GenerateParams p = Params(methods[i % methods.size()], i % 10, 500 + i);
    p.stream_drafts = i % 2 == 0;
    p.preview_every = i == 1 ? 10 : 0;
    rec.push_back(std::make_shared<Recorder>());
    ASSERT_TRUE(engine->Submit(p, rec.back()).ok());
  }
  for (size_t i = 0; i < rec.size(); ++i) {
    Recorder& r = *rec[i];
    ASSERT_TRUE(r.Wait());
    ASSERT_TRUE(r.result.has_value())
        << methods[i % methods.size()] << ": " << (r.error ? r.error->ToString() : "");
    EXPECT_EQ(r.terminal_calls, 1);
    const RequestResult& res = *r.result;
    ASSERT_EQ(res.tokens.size(), 196u);
    EXPECT_EQ(res.policy.preset, methods[i % methods.size()]);
    EXPECT_EQ(std::make_pair(res.image.width, res.image.height),
              std::make_pair(int64_t{28}, int64_t{28}));
    EXPECT_EQ(res.image.pixels.size(), 28u * 28u);
    // The deltas reassemble into exactly the final grid, in order, with nothing repeated.
    std::vector<int32_t> grid;
    int64_t verified = 0, accepted = 0;
    for (size_t k = 0; k < r.events.size(); ++k) {
      const StepEvent& e = r.events[k];
      EXPECT_EQ(e.step, static_cast<int64_t>(k) + 1);
      ASSERT_FALSE(e.positions.empty()) << "every step commits at least one token";
      for (size_t t = 0; t < e.positions.size(); ++t) {
        ASSERT_EQ(e.positions[t], static_cast<int32_t>(grid.size()));
        grid.push_back(e.tokens[t]);
      }
      EXPECT_EQ(e.totals.tokens, static_cast<int64_t>(grid.size()));
      verified += e.verified;
      accepted += e.accepted;
      if (!e.draft_positions.empty()) {
        EXPECT_EQ(i % 2, 0u) << "drafts only when asked for";
        EXPECT_EQ(e.draft_positions[0], static_cast<int32_t>(grid.size()));
      }
      if (i == 1 && e.step % 10 == 0 && grid.size() < 196) {
        EXPECT_EQ(e.preview.pixels.size(), 28u * 28u);
      }
    }
    EXPECT_EQ(grid, res.tokens);
    const RequestStats& st = res.stats;
    EXPECT_EQ(st.counters.nfe, static_cast<int64_t>(r.events.size()));
    EXPECT_EQ(st.counters.drafts_verified, verified);
    EXPECT_EQ(st.counters.drafts_accepted, accepted);
    EXPECT_NEAR(st.step_compression, 196.0 / st.counters.nfe, 1e-12);
    int64_t steps = 0, tokens = 0;
    for (size_t k = 0; k < st.accepted_length_histogram.size(); ++k) {
      steps += st.accepted_length_histogram[k];
      tokens += static_cast<int64_t>(k) * st.accepted_length_histogram[k];
    }
    EXPECT_EQ(steps, st.counters.nfe);
    EXPECT_EQ(tokens, 196);
    if (res.policy.draft == DraftSource::kNone) {
      EXPECT_EQ(st.counters.nfe, 196);
    } else {
      EXPECT_LT(st.counters.nfe, 196) << res.policy.preset;
    }
    EXPECT_EQ(res.policy.draft == DraftSource::kDraftModel, st.counters.draft_forwards > 0);
    EXPECT_GE(st.first_token_seconds, st.queue_seconds);
  }
  WaitIdle(*engine);  // the engine's figures are updated after the round's observers ran
  {
    // Requests of different methods shared steps.
    std::lock_guard<std::mutex> l(log.mu);
    int64_t max_requests = 0;
    for (const auto& s : log.samples) max_requests = std::max(max_requests, s.requests);
    EXPECT_GE(max_requests, 10);
  }
  EngineStats s = engine->Stats();
  EXPECT_EQ(s.completed, 12);
  EXPECT_EQ(s.models[0].slots_used, 0);
}

// The same request (params + seed) gives the same grid alone and beside 15 others of every
// method (batch-invariant forwards, the default, and a token budget that does not bind).
TEST(EngineTest, BatchInvarianceAloneVersusFifteenMixedNeighbours) {
  StepLog log;
  EngineOptions o = BundledOptions();
  o.window_policy = "full";  // the guarantee holds while no window is shrunk
  auto engine = StartOrDie(o, &log);
  const auto& methods = PresetNames();
  std::vector<GenerateParams> ps;
  for (int i = 0; i < 16; ++i)
    ps.push_back(Params(methods[i % methods.size()], (i * 3) % 10, 9000 + i));
  std::vector<std::shared_ptr<Recorder>> together;
  for (const auto& p : ps) {
    together.push_back(std::make_shared<Recorder>());
    ASSERT_TRUE(engine->Submit(p, together.back()).ok());
  }
  for (auto& r : together) ASSERT_TRUE(r->Wait() && r->result.has_value());
  for (size_t i = 0; i < ps.size(); ++i) {
    auto alone = std::make_shared<Recorder>();
    ASSERT_TRUE(engine->Submit(ps[i], alone).ok());
    ASSERT_TRUE(alone->Wait() && alone->result.has_value());
    EXPECT_EQ(alone->result->tokens, together[i]->result->tokens) << ps[i].policy.preset;
    EXPECT_EQ(alone->result->stats.counters.nfe, together[i]->result->stats.counters.nfe);
  }
  std::lock_guard<std::mutex> l(log.mu);
  int64_t max_requests = 0;
  for (const auto& s : log.samples) {
    EXPECT_FALSE(s.budget_limited);  // the precondition: no window was shrunk
    max_requests = std::max(max_requests, s.requests);
  }
  EXPECT_EQ(max_requests, 16);
}

// EngineOptions::cpu_threads: one intra-op thread and two draw the same images, bit for bit,
// with the methods' kinds of verification (fp32, and bf16 products where the CPU has AMX): the
// engine's CPU kernels (the forward's, the fused verification's and the final distributions') split
// their work over the threads (DeviceTest.TheEnginesKernelsRunOnTheIntraOpThreads) and none of
// their results depends on the split. ctest runs with OMP_NUM_THREADS=1; the option sets the
// threads.
TEST(EngineTest, OneIntraOpThreadAndTwoDrawTheSameImages) {
  if (testing::TestLoadOptions().device.is_cuda()) GTEST_SKIP() << "the CPU's threads";
  // A chain, a tree (PAC), GSD's clusters, the draft model, and AR.
  const std::vector<std::string> methods = {"ar", "scd-mc", "sjd-pac", "gsd", "sd"};
  std::vector<GenerateParams> ps;
  for (size_t i = 0; i < methods.size(); ++i) {
    ps.push_back(Params(methods[i], static_cast<int64_t>(i), 7300 + i));
  }
  std::vector<std::string> precisions = {"highest"};
  if (AmxBf16Linear::Supported()) precisions.push_back("medium");
  // cpu_threads sets LibTorch's thread count for the process (threads started later take it):
  // put it back for the tests that run after this one in the same process.
  const testing::ScopedIntraOpThreads restore(at::get_num_threads());
  for (const std::string& precision : precisions) {
    std::vector<std::vector<int32_t>> grids[2];
    for (const int threads : {1, 2}) {
      EngineOptions o = BundledOptions();
      o.window_policy = "full";
      o.fixed_step_cost = {0.005, 2e-5, 1e-3};  // no calibration: whole windows need no cost model
      o.cpu_threads = threads;
      o.matmul_precision = precision;
      auto engine = StartOrDie(o);
      std::vector<std::shared_ptr<Recorder>> rs;
      for (const auto& p : ps) {
        rs.push_back(std::make_shared<Recorder>());
        const auto st = engine->Submit(p, rs.back());
        ASSERT_TRUE(st.ok()) << st.status().ToString();
      }
      for (auto& r : rs) {
        ASSERT_TRUE(r->Wait() && r->result.has_value())
            << (r->error ? r->error->ToString() : std::string("no result"));
        grids[threads - 1].push_back(r->result->tokens);
      }
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      EXPECT_EQ(grids[0][i], grids[1][i]) << methods[i] << ", matmul precision " << precision;
    }
  }
}

// A schedstat file the test writes in place of the engine thread's, as beside a busy loop on
// one of two cores: while `busy` holds and the engine runs more than one intra-op thread
// (`threads()`), its run-queue wait grows as fast as the clock; at one thread, not at all (the
// daemon's measured 0.34-0.40 and 0.00-0.01). Beside it a /proc/stat whose CPUs (this process's)
// sit idle `idle_cpus` CPUs' worth. Fixed-width, rewritten in place, as the engine keeps its
// schedstat open.
class FakeSchedstat {
 public:
  FakeSchedstat(const std::string& dir, std::function<int64_t()> threads)
      : dir_(dir), threads_(std::move(threads)), cpus_(AllowedCpus()) {
    Write(0, 0);
    writer_ = std::thread([this] {
      int64_t wait_ns = 0;
      double idle_ticks = 0;
      const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
      auto last = std::chrono::steady_clock::now();
      while (!stop_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const auto now = std::chrono::steady_clock::now();
        const double dt = std::chrono::duration<double>(now - last).count();
        last = now;
        if (busy.load() && threads_() > 1) wait_ns += static_cast<int64_t>(dt * 1e9);
        idle_ticks += idle_cpus.load() * hz * dt / static_cast<double>(cpus_.size());
        Write(wait_ns, static_cast<uint64_t>(idle_ticks));
      }
    });
  }
  ~FakeSchedstat() {
    stop_.store(true);
    writer_.join();
  }
  std::string schedstat() const { return dir_ + "/schedstat"; }
  std::string proc_stat() const { return dir_ + "/stat"; }
  std::atomic<bool> busy{false};
  std::atomic<double> idle_cpus{0};

 private:
  void Write(int64_t wait_ns, uint64_t idle_ticks) {
    char line[64];
    std::snprintf(line, sizeof line, "1 %020lld 1\n", static_cast<long long>(wait_ns));
    FILE* f = std::fopen(schedstat().c_str(), first_ ? "w" : "r+");
    first_ = false;
    if (f != nullptr) {
      std::fputs(line, f);
      std::fclose(f);
    }
    std::string text = "cpu  0 0 0 0 0 0\n";
    for (int c : cpus_) {
      text += "cpu" + std::to_string(c) + " 5 0 5 " + std::to_string(idle_ticks) + " 0 0\n";
    }
    const std::string tmp = proc_stat() + ".tmp";  // the meter opens it afresh each reading
    if (FILE* g = std::fopen(tmp.c_str(), "w")) {
      std::fputs(text.c_str(), g);
      std::fclose(g);
      std::rename(tmp.c_str(), proc_stat().c_str());
    }
  }
  std::string dir_;
  std::function<int64_t()> threads_;
  std::vector<int> cpus_;
  bool first_ = true;
  std::atomic<bool> stop_{false};
  std::thread writer_;
};

// An engine at two intra-op threads with the thread governor on, reading a FakeSchedstat (the
// engine's own count, as its stats say, decides whether the fake's wait grows); its notices
// kept. Short windows: 4 steps and 20 ms.
struct Governed {
  explicit Governed(const std::string& name)
      : dir(testing::TempDir(name)), fake(dir, [this]() -> int64_t {
          std::lock_guard<std::mutex> l(engine_mu);
          return engine == nullptr ? 2 : engine->Stats().cpu_threads;
        }) {}
  // The engine the fake asks, until the returned guard goes (declared after the engine, it goes
  // first, also when an assertion returns early): then the fake's thread no longer touches it.
  std::shared_ptr<void> Watch(Engine* e) {
    Set(e);
    return std::shared_ptr<void>(nullptr, [this](void*) { Set(nullptr); });
  }
  void Set(Engine* e) {
    std::lock_guard<std::mutex> l(engine_mu);
    engine = e;
  }
  EngineOptions Options() {
    EngineOptions o = BundledOptions();
    o.window_policy = "full";
    o.fixed_step_cost = {0.005, 2e-5, 1e-3};  // no calibration
    o.cpu_threads = 2;
    o.adaptive_cpu_threads = 1;
    o.schedstat_path = fake.schedstat();
    o.cpu_thread_governor.window_seconds = 0.02;
    o.cpu_thread_governor.window_steps = 4;
    o.log = [this](const std::string& m) {
      std::lock_guard<std::mutex> l(mu);
      notices.push_back(m);
    };
    return o;
  }
  // Every notice so far, one a line.
  std::string Notices() {
    std::lock_guard<std::mutex> l(mu);
    std::string all;
    for (const std::string& n : notices) all += n + "\n";
    return all;
  }
  const std::string dir;
  std::mutex engine_mu;
  Engine* engine = nullptr;
  FakeSchedstat fake;
  std::mutex mu;
  std::vector<std::string> notices;
};

// EngineOptions::adaptive_cpu_threads: the engine checks at start that one thread's outputs
// are two's bit for bit, halves its threads once the engine thread waits for a CPU a fifth of
// its step time, tries two again after first_probe_seconds and goes back down while the wait
// goes on, and stays at two once it has stopped; the images are those of a fixed count.
TEST(EngineTest, IntraOpThreadsFollowTheEngineThreadsWaitForACpu) {
  if (testing::TestLoadOptions().device.is_cuda()) GTEST_SKIP() << "the CPU's threads";
  const testing::ScopedIntraOpThreads restore(at::get_num_threads());
  Governed g("imagegen-governor");
  EngineOptions o = g.Options();
  o.cpu_thread_governor.idle_try_share = 0;  // timed tries only (the next test: idle CPUs)
  o.cpu_thread_governor.first_probe_seconds = 0.5;
  o.cpu_thread_governor.max_probe_seconds = 1.0;
  auto engine = StartOrDie(o);
  std::shared_ptr<void> watched = g.Watch(engine.get());
  EXPECT_NE(g.Notices().find("cpu threads follow"), std::string::npos) << g.Notices();
  EXPECT_EQ(engine->Stats().cpu_threads, 2);
  EXPECT_EQ(engine->Stats().cpu_threads_max, 2);
  // Requests two at a time, until told to stop; each one's grid by its seed.
  std::atomic<bool> stop{false};
  std::mutex grids_mu;
  std::map<uint64_t, std::vector<int32_t>> grids;
  std::thread client([&] {
    for (uint64_t seed = 9000; !stop.load(); seed += 2) {
      std::vector<std::shared_ptr<Recorder>> rs;
      for (uint64_t k = 0; k < 2; ++k) {
        rs.push_back(std::make_shared<Recorder>());
        if (!engine->Submit(Params("scd-mc", static_cast<int64_t>(seed % 10), seed + k), rs.back())
                 .ok()) {
          return;
        }
      }
      for (uint64_t k = 0; k < 2; ++k) {
        if (!rs[k]->Wait() || !rs[k]->result) return;
        std::lock_guard<std::mutex> l(grids_mu);
        grids[seed + k] = rs[k]->result->tokens;
      }
    }
  });
  auto stats = [&] { return engine->Stats(); };
  // Quiet: two threads throughout a second of steps.
  const auto quiet_end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  EXPECT_TRUE(testing::WaitUntil(
      [&] { return stats().cpu_threads != 2 || std::chrono::steady_clock::now() > quiet_end; },
      std::chrono::seconds(60)));
  EXPECT_EQ(stats().cpu_threads, 2);
  EXPECT_EQ(stats().cpu_threads_lowered, 0);
  // Waiting as long as running: one thread.
  g.fake.busy.store(true);
  EXPECT_TRUE(
      testing::WaitUntil([&] { return stats().cpu_threads == 1; }, std::chrono::seconds(120)));
  // Still waiting: each try of two goes back down.
  EXPECT_TRUE(testing::WaitUntil([&] { return stats().cpu_threads_raised >= 2; },
                                 std::chrono::seconds(120)));
  EXPECT_TRUE(
      testing::WaitUntil([&] { return stats().cpu_threads == 1; }, std::chrono::seconds(120)));
  EXPECT_GE(stats().cpu_threads_lowered, 2);
  // The wait has stopped: a try holds, and two threads stay for two windows of tries.
  g.fake.busy.store(false);
  EXPECT_TRUE(
      testing::WaitUntil([&] { return stats().cpu_threads == 2; }, std::chrono::seconds(120)));
  const int64_t raised = stats().cpu_threads_raised;
  const auto held_end = std::chrono::steady_clock::now() + std::chrono::milliseconds(2500);
  EXPECT_TRUE(testing::WaitUntil(
      [&] { return stats().cpu_threads != 2 || std::chrono::steady_clock::now() > held_end; },
      std::chrono::seconds(60)));
  EXPECT_EQ(stats().cpu_threads, 2);
  EXPECT_EQ(stats().cpu_threads_raised, raised);
  // Enough images to compare: a slow build (ASan: 2 in the 10 s of the phases above) draws the
  // rest at two threads.
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        std::lock_guard<std::mutex> l(grids_mu);
        return grids.size() >= 4;
      },
      std::chrono::seconds(300)));
  stop.store(true);
  client.join();
  // The images drawn at whichever count, against an engine at two threads and no governor.
  std::map<uint64_t, std::vector<int32_t>> drawn;
  {
    std::lock_guard<std::mutex> l(grids_mu);
    drawn = grids;
  }
  ASSERT_GE(drawn.size(), 4u);
  watched.reset();
  engine.reset();
  o.adaptive_cpu_threads = 0;
  o.schedstat_path.clear();
  auto fixed = StartOrDie(o);
  int compared = 0;
  for (const auto& [seed, tokens] : drawn) {
    if (compared++ % 3 != 0) continue;  // a third of them: enough to span every phase
    auto r = std::make_shared<Recorder>();
    ASSERT_TRUE(
        fixed->Submit(Params("scd-mc", static_cast<int64_t>((seed & ~1ull) % 10), seed), r).ok());
    ASSERT_TRUE(r->Wait() && r->result.has_value());
    EXPECT_EQ(r->result->tokens, tokens) << "seed " << seed;
  }
}

// The engine reads its CPUs' idle time while the count is lowered: once the busy loop has gone
// and its CPU sits idle, two threads are tried at once, long before the timed try (1000 s here).
TEST(EngineTest, AnIdleCpuEndsTheLoweredCountBeforeItsTimedTry) {
  if (testing::TestLoadOptions().device.is_cuda()) GTEST_SKIP() << "the CPU's threads";
  const testing::ScopedIntraOpThreads restore(at::get_num_threads());
  Governed g("imagegen-governor-idle");
  EngineOptions o = g.Options();
  o.proc_stat_path = g.fake.proc_stat();
  o.cpu_thread_governor.first_probe_seconds = 1000;
  o.cpu_thread_governor.max_probe_seconds = 1000;
  auto engine = StartOrDie(o);
  std::shared_ptr<void> watched = g.Watch(engine.get());
  std::atomic<bool> stop{false};
  std::thread client([&] {
    for (uint64_t seed = 9500; !stop.load(); ++seed) {
      auto r = std::make_shared<Recorder>();
      if (!engine->Submit(Params("ar", static_cast<int64_t>(seed % 10), seed), r).ok()) return;
      if (!r->Wait()) return;
    }
  });
  auto stats = [&] { return engine->Stats(); };
  g.fake.busy.store(true);  // the loop holds the other CPU: none idle
  EXPECT_TRUE(
      testing::WaitUntil([&] { return stats().cpu_threads == 1; }, std::chrono::seconds(120)));
  const auto lowered_end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  EXPECT_TRUE(testing::WaitUntil(
      [&] { return stats().cpu_threads != 1 || std::chrono::steady_clock::now() > lowered_end; },
      std::chrono::seconds(60)));
  EXPECT_EQ(stats().cpu_threads, 1);  // no idle CPU, and the timed try is far off
  g.fake.busy.store(false);
  g.fake.idle_cpus.store(0.95);
  EXPECT_TRUE(
      testing::WaitUntil([&] { return stats().cpu_threads == 2; }, std::chrono::seconds(120)));
  stop.store(true);
  client.join();
  EXPECT_EQ(stats().cpu_threads_raised, 1);
  EXPECT_EQ(stats().cpu_threads_lowered, 1);
  EXPECT_NE(g.Notices().find("of its CPUs sat idle"), std::string::npos) << g.Notices();
}

// EngineOptions::cpu_threads is LibTorch's count for the whole process (threads take it at
// their first parallel op): while an engine runs with one count, another that asks for a
// different one is refused, naming the field; the same count, or 0 (the process's), starts
// beside it, and once it is gone the other count starts and draws.
TEST(EngineTest, LiveEnginesInOneProcessShareOneCpuThreadCount) {
  if (testing::TestLoadOptions().device.is_cuda()) GTEST_SKIP() << "the CPU's threads";
  const testing::ScopedIntraOpThreads restore(at::get_num_threads());
  auto options = [](int64_t threads) {
    EngineOptions o = BundledOptions();
    o.window_policy = "full";
    o.fixed_step_cost = {0.005, 2e-5, 1e-3};  // no calibration
    o.cpu_threads = threads;
    return o;
  };
  auto one = StartOrDie(options(1));
  const Status refused = Engine::Start(options(2)).status();
  EXPECT_EQ(refused.code(), Code::kInvalidArgument);
  EXPECT_NE(refused.message().find("cpu_threads: 2"), std::string::npos) << refused.ToString();
  {
    auto same = StartOrDie(options(1));
    auto process_count = StartOrDie(options(0));
  }
  EXPECT_FALSE(Engine::Start(options(2)).ok());  // `one` still runs
  one.reset();
  auto two = StartOrDie(options(2));
  auto r = std::make_shared<Recorder>();
  ASSERT_TRUE(two->Submit(Params("ar", 1, 7400), r).ok());
  ASSERT_TRUE(r->Wait() && r->result.has_value())
      << (r->error ? r->error->ToString() : std::string("no result"));
}

// EngineOptions::cuda_graphs on the CPU: the engine runs every forward at static shapes
// (StaticForwardTest; on a CUDA device each bucket is then a graph), with the caches' scratch
// slots, and draws the default engine's images: the two forwards differ only in rounding, so
// at most one of the 8 images (196 draws each) may differ, where a uniform falls within that
// rounding of a token boundary.
TEST(EngineTest, CudaGraphsOptionRunsStaticShapesAndDrawsTheSameImages) {
  const auto& methods = PresetNames();
  std::vector<GenerateParams> ps;
  for (int i = 0; i < 8; ++i) ps.push_back(Params(methods[i % methods.size()], i, 7100 + i));
  std::vector<std::vector<int32_t>> grids[2];
  for (const bool graphs : {false, true}) {
    EngineOptions o = BundledOptions();
    o.window_policy = "full";
    o.fixed_step_cost = {0.005, 2e-5, 1e-3};  // no calibration: whole windows need no cost model
    o.cuda_graphs = graphs;
    o.dtype = "fp32";  // also on CUDA (bf16 there by default): the forwards' rounding is compared
    StepLog log;
    auto engine = StartOrDie(o, &log);
    std::vector<std::shared_ptr<Recorder>> rs;
    for (const auto& p : ps) {
      rs.push_back(std::make_shared<Recorder>());
      ASSERT_TRUE(engine->Submit(p, rs.back()).ok());
    }
    for (auto& r : rs) {
      ASSERT_TRUE(r->Wait() && r->result.has_value())
          << (r->error ? r->error->ToString() : std::string("no result"));
      grids[graphs ? 1 : 0].push_back(r->result->tokens);
    }
    std::lock_guard<std::mutex> l(log.mu);
    double seconds = 0;
    int64_t tokens = 0, captures = 0;
    for (const StepSample& st : log.samples) {
      seconds += st.seconds;
      tokens += st.tokens;
      captures += st.graph_captures;
    }
    std::printf("%s: %zu steps, %.1f s, %lld forward tokens, %lld graphs captured\n",
                graphs ? "static" : "eager", log.samples.size(), seconds,
                static_cast<long long>(tokens), static_cast<long long>(captures));
    // Steps report their captures (the step-cost model bounds what they teach it): graphs are
    // captured on a CUDA device only, and a few buckets serve all the steps.
    if (graphs && o.device == "cuda") {
      EXPECT_GT(captures, 0);
      EXPECT_LT(captures, static_cast<int64_t>(log.samples.size()));
    } else {
      EXPECT_EQ(captures, 0);
    }
  }
  int same = 0;
  for (size_t i = 0; i < ps.size(); ++i) same += grids[0][i] == grids[1][i] ? 1 : 0;
  std::printf("static shapes: %d of %zu images identical to the default engine's\n", same,
              ps.size());
  EXPECT_GE(same, 7);
}

// The static forward's scratch slot comes out of the KV memory budget: with the same bytes,
// cuda_graphs leaves one slot fewer to requests. By default (-1) the engine takes graphs on a
// CUDA device and the eager forward on the CPU, which the scratch slot shows.
TEST(EngineTest, CudaGraphsScratchSlotIsCountedInTheKvBudget) {
  int64_t slots[3] = {0, 0, 0};  // off, on, by device
  for (const int graphs : {0, 1, -1}) {
    EngineOptions o = BundledOptions();
    o.fixed_step_cost = {0.005, 2e-5, 1e-3};
    o.max_slots = int64_t{1} << 30;  // the memory decides
    o.kv_cache_bytes = int64_t{8} << 20;
    o.cuda_graphs = graphs;
    auto engine = StartOrDie(o);
    slots[graphs < 0 ? 2 : graphs] = engine->Models()[0].kv_slots;
  }
  const bool cuda = testing::TestLoadOptions().device.is_cuda();
  std::printf("8 MiB of KV cache: %lld slots eager, %lld with cuda_graphs, %lld by default on %s\n",
              static_cast<long long>(slots[0]), static_cast<long long>(slots[1]),
              static_cast<long long>(slots[2]), cuda ? "CUDA" : "the CPU");
  EXPECT_GE(slots[0], 3);
  EXPECT_EQ(slots[1], slots[0] - 1);
  EXPECT_EQ(slots[2], cuda ? slots[1] : slots[0]);
  EngineOptions bad = BundledOptions();
  bad.cuda_graphs = 2;
  const Status refused = Engine::Start(bad).status();
  EXPECT_EQ(refused.code(), Code::kInvalidArgument);
  EXPECT_NE(refused.message().find("cuda_graphs"), std::string::npos) << refused.ToString();
}

// The forward itself: one row's logits alone and inside a ragged batch of other rows.
TEST(EngineTest, BatchInvariantForwardGivesBitIdenticalLogits) {
  auto m = LoadImageModel(imagegen::testing::TestModelsDir(), "fmnist-gpt", {});
  ASSERT_TRUE(m.ok());
  std::vector<BatchRow> rows;
  for (int i = 0; i < 12; ++i) {
    BatchRow r;
    r.slot = i;
    r.group = i / 2;
    const int n = 1 + (i / 2) * 7;
    for (int k = 0; k < n; ++k) {
      r.tokens.push_back(k == 0 ? (i % 2 ? 10 : i / 2) : (k * 37 + i / 2) % 512);
      r.positions.push_back(k);
    }
    rows.push_back(r);
  }
  for (bool invariant : {true, false}) {
    ForwardOptions fo{invariant};
    KvCache all = m->gpt->NewCache(12), one = m->gpt->NewCache(2);
    at::Tensor big = *m->gpt->Forward(rows, all, at::Tensor(), fo);
    std::vector<BatchRow> pair = {rows[6], rows[7]};
    pair[0].slot = 0;
    pair[1].slot = 1;
    at::Tensor small = *m->gpt->Forward(pair, one, at::Tensor(), fo);
    int64_t off = 0;
    for (int i = 0; i < 6; ++i) off += static_cast<int64_t>(rows[i].tokens.size());
    at::Tensor same = big.narrow(0, off, small.size(0));
    const double diff = (same - small).abs().max().item<double>();
    std::printf("batch_invariant=%d: max |logit difference| alone vs batched %.3g\n", invariant,
                diff);
    if (invariant) {
      EXPECT_TRUE(at::equal(same, small));
    }
  }
}

TEST(EngineTest, CancelMidGenerationEndsTheRequestAndFreesItsSlots) {
  auto engine = StartOrDie(BundledOptions());
  auto r = std::make_shared<Recorder>(engine.get(), /*cancel_after_steps=*/5);
  ASSERT_TRUE(engine->Submit(Params("ar", 3, 1), r).ok());
  ASSERT_TRUE(r->Wait());
  ASSERT_TRUE(r->error.has_value());
  EXPECT_EQ(r->error->code(), Code::kCancelled);
  EXPECT_EQ(r->terminal_calls, 1);
  EXPECT_LE(r->events.size(), 6u);  // takes effect at the next step
  // Cancel from another thread, and cancel a request still waiting for a slot.
  EngineOptions o = BundledOptions();
  o.max_slots = 2;  // one CFG request at a time
  auto small = StartOrDie(o);
  auto running = std::make_shared<Recorder>(), waiting = std::make_shared<Recorder>();
  auto id1 = small->Submit(Params("sjd", 1, 2), running);
  auto id2 = small->Submit(Params("sjd", 2, 3), waiting);
  ASSERT_TRUE(id1.ok() && id2.ok());
  small->Cancel(*id2);
  small->Cancel(*id1);
  small->Cancel(12345);  // unknown ids are ignored
  ASSERT_TRUE(running->Wait() && waiting->Wait());
  EXPECT_EQ(waiting->error->code(), Code::kCancelled);
  EXPECT_TRUE(waiting->events.empty());
  EXPECT_EQ(running->error->code(), Code::kCancelled);
  WaitIdle(*small);
  EngineStats s = small->Stats();
  EXPECT_EQ(s.models[0].slots_used, 0);
  EXPECT_EQ(s.cancelled, 2);
  // The engine goes on serving.
  auto after = std::make_shared<Recorder>();
  ASSERT_TRUE(small->Submit(Params("scd-mc", 4, 4), after).ok());
  ASSERT_TRUE(after->Wait() && after->result.has_value());
}

// Observers and listeners are called on the engine thread; one that throws used to end that
// thread (std::terminate: the process, every request). Now its exception is dropped where the
// engine calls it: the request goes on after OnStep, is over after OnError, and the others
// never notice.
TEST(EngineTest, AnObserverOrListenerThatThrowsEndsNeitherTheEngineNorOtherRequests) {
  class ThrowsOnStep : public Recorder {
   public:
    void OnStep(const StepEvent& e) override {
      Recorder::OnStep(e);
      throw std::runtime_error("observer bug");
    }
  };
  class ThrowsOnError : public Recorder {
   public:
    void OnError(const Status& s) override {
      Recorder::OnError(s);
      throw std::runtime_error("observer bug");
    }
  };
  class ThrowingListener : public EngineListener {
   public:
    void OnStep(const StepSample&) override {
      steps.fetch_add(1);
      throw std::runtime_error("listener bug");
    }
    std::atomic<int64_t> steps{0};
  };
  ThrowingListener listener;
  auto engine = StartOrDie(BundledOptions(), &listener);
  auto step_thrower = std::make_shared<ThrowsOnStep>();
  auto error_thrower = std::make_shared<ThrowsOnError>();
  auto plain = std::make_shared<Recorder>();
  auto id = engine->Submit(Params("sjd", 2, 11), error_thrower);
  ASSERT_TRUE(id.ok());
  engine->Cancel(*id);
  ASSERT_TRUE(engine->Submit(Params("scd-mc", 1, 12), step_thrower).ok());
  ASSERT_TRUE(engine->Submit(Params("ar", 3, 13), plain).ok());
  ASSERT_TRUE(error_thrower->Wait() && step_thrower->Wait() && plain->Wait());
  ASSERT_TRUE(error_thrower->error.has_value());
  EXPECT_EQ(error_thrower->error->code(), Code::kCancelled);
  // Every step reached the observer that throws, and the request completed.
  ASSERT_TRUE(step_thrower->result.has_value())
      << (step_thrower->error ? step_thrower->error->ToString() : "");
  EXPECT_TRUE(step_thrower->all_decided());
  ASSERT_TRUE(plain->result.has_value()) << (plain->error ? plain->error->ToString() : "");
  EXPECT_GT(listener.steps.load(), 0);
  // And the engine serves the next request.
  auto after = std::make_shared<Recorder>();
  ASSERT_TRUE(engine->Submit(Params("ar", 4, 14), after).ok());
  ASSERT_TRUE(after->Wait() && after->result.has_value());
  WaitIdle(*engine);
  EXPECT_EQ(engine->Stats().models[0].slots_used, 0);
}

// A recorder whose every step event holds the engine thread 2 ms: a request it observes takes
// at least 196 x 2 ms, whatever the machine's speed.
class SlowRecorder : public Recorder {
 public:
  void OnStep(const StepEvent& e) override {
    Recorder::OnStep(e);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
};

TEST(EngineTest, DeadlinesEndRunningAndWaitingRequests) {
  EngineOptions o = BundledOptions();
  o.max_slots = 2;
  auto engine = StartOrDie(o);
  GenerateParams p = Params("ar", 0, 5);
  p.deadline = Clock::now() + std::chrono::milliseconds(150);
  GenerateParams q = Params("ar", 1, 6);
  q.deadline = Clock::now() + std::chrono::milliseconds(50);  // expires while queued
  // p's steps are held (SlowRecorder), so that it is still running at its deadline: on a fast
  // machine 196 AR steps of the bundled model took under 150 ms and p completed (CI, 2026-12-07).
  auto rp = std::make_shared<SlowRecorder>();
  auto rq = std::make_shared<Recorder>();
  ASSERT_TRUE(engine->Submit(p, rp).ok());
  ASSERT_TRUE(engine->Submit(q, rq).ok());
  ASSERT_TRUE(rp->Wait() && rq->Wait());
  ASSERT_TRUE(rp->error && rq->error);
  EXPECT_EQ(rp->error->code(), Code::kDeadlineExceeded);
  EXPECT_EQ(rq->error->code(), Code::kDeadlineExceeded);
  EXPECT_GT(rp->events.size(), 0u);
  EXPECT_LT(rp->events.size(), 196u);
  EXPECT_TRUE(rq->events.empty());
  WaitIdle(*engine);
  EXPECT_EQ(engine->Stats().expired, 2);
  EXPECT_EQ(engine->Stats().models[0].slots_used, 0);
}

TEST(EngineTest, FullQueueIsRejectedAsResourceExhausted) {
  EngineOptions o = BundledOptions();
  o.max_slots = 2;
  o.max_queue = 2;
  auto engine = StartOrDie(o);
  std::vector<std::shared_ptr<Recorder>> ok;
  int rejected = 0;
  for (int i = 0; i < 8; ++i) {
    auto r = std::make_shared<Recorder>();
    auto id = engine->Submit(Params("scd-mc", i % 10, 100 + i), r);
    if (id.ok()) {
      ok.push_back(r);
    } else {
      EXPECT_EQ(id.status().code(), Code::kResourceExhausted) << id.status().ToString();
      EXPECT_NE(id.status().message().find("queue full"), std::string::npos);
      EXPECT_EQ(r->terminal_calls, 0);
      ++rejected;
    }
  }
  EXPECT_GE(rejected, 8 - 3);  // at most 1 running + 2 waiting
  EXPECT_LE(rejected, 8 - 2);
  for (auto& r : ok) ASSERT_TRUE(r->Wait() && r->result.has_value());
  EXPECT_EQ(engine->Stats().rejected, rejected);
}

TEST(EngineTest, InvalidRequestsNameTheFieldAndReachNoObserver) {
  auto engine = StartOrDie(BundledOptions());
  auto r = std::make_shared<Recorder>();
  auto field = [&](GenerateParams p) {
    auto id = engine->Submit(p, r);
    EXPECT_FALSE(id.ok());
    return id.ok() ? std::string("(accepted)") : id.status().field();
  };
  GenerateParams p = Params("sjd", 0, 1);
  p.class_id.reset();
  EXPECT_EQ(field(p), "class_id");  // neither id nor name
  p.class_name = "unicorn";
  EXPECT_EQ(field(p), "class_name");
  p.class_name = "7";  // a name, not an id: no class of the bundled model is called "7"
  EXPECT_EQ(field(p), "class_name");
  p.class_name = std::string(3000, 'x');  // echoed, but not at any length
  {
    auto id = engine->Submit(p, r);
    ASSERT_FALSE(id.ok());
    EXPECT_LT(id.status().message().size(), 400u) << id.status().message();
    EXPECT_NE(id.status().message().find("(3000 bytes)"), std::string::npos);
  }
  p.class_id = 1;  // and a name
  EXPECT_EQ(field(p), "class_name");
  p.class_name.clear();
  p.class_id = 10;
  EXPECT_EQ(field(p), "class_id");
  p.class_id = -1;
  EXPECT_EQ(field(p), "class_id");
  p = Params("sjd", 0, 1);
  p.cfg_scale = std::nan("");
  EXPECT_EQ(field(p), "cfg_scale");
  p = Params("sjd", 0, 1);
  p.temperature = -1;
  EXPECT_EQ(field(p), "temperature");
  p = Params("sjd", 0, 1);
  p.top_k = -1;
  EXPECT_EQ(field(p), "top_k");
  p = Params("sjd", 0, 1);
  p.top_p = 0;
  EXPECT_EQ(field(p), "top_p");
  p = Params("sjd", 0, 1);
  p.policy.window = 197;
  EXPECT_EQ(field(p), "window");
  p = Params("sjd-pac", 0, 1);
  p.policy.tree_depth = 5;  // 1 + 4 + 16 + 64 + 256 nodes > 64
  EXPECT_EQ(field(p), "tree_depth");
  p = Params("cool-sd", 0, 1);
  p.policy.cool_delta = std::nan("");
  EXPECT_EQ(field(p), "cool_delta");
  p = Params("sjd", 0, 1);
  p.preview_every = -2;
  EXPECT_EQ(field(p), "preview_every");
  p = Params("sjd", 0, 1);
  p.model = "no-such-model";
  auto nf = engine->Submit(p, r);
  ASSERT_FALSE(nf.ok());
  EXPECT_EQ(nf.status().code(), Code::kNotFound);
  EXPECT_EQ(r->terminal_calls, 0);
  EXPECT_TRUE(r->events.empty());
  EXPECT_EQ(engine->Stats().submitted, 0);
}

// Previews are decoded on the engine thread, so they get a share of its time and no more.
// Share 0 (no budget): every due preview comes, one per step but the last. A share so small
// that the first preview's cost (measured by decoding it) is never earned back: one preview in
// the whole run, whatever the four clients ask for; the images are the same either way.
TEST(EngineTest, PreviewsTakeNoMoreThanTheirShareOfTheEngine) {
  std::vector<std::vector<int32_t>> images[2];
  for (int pass = 0; pass < 2; ++pass) {
    EngineOptions o = BundledOptions();
    o.preview_share = pass == 0 ? 0.0 : 1e-12;
    auto engine = StartOrDie(o);
    std::vector<std::shared_ptr<Recorder>> rec;
    for (int i = 0; i < 5; ++i) {
      GenerateParams p = Params("ar", i, 40 + i);
      p.preview_every = i < 4 ? 1 : 0;
      rec.push_back(std::make_shared<Recorder>());
      ASSERT_TRUE(engine->Submit(p, rec.back()).ok());
    }
    int64_t previews = 0, steps = 0;
    for (size_t i = 0; i < rec.size(); ++i) {
      ASSERT_TRUE(rec[i]->Wait());
      ASSERT_TRUE(rec[i]->result.has_value());
      images[pass].push_back(rec[i]->result->tokens);
      for (const StepEvent& e : rec[i]->events) {
        previews += e.preview.empty() ? 0 : 1;
        if (i < 4) {
          EXPECT_TRUE(e.preview.empty() || e.preview.pixels.size() == 28u * 28u);
        } else {
          EXPECT_TRUE(e.preview.empty()) << "no preview unless asked for";
        }
      }
      if (i < 4) steps += static_cast<int64_t>(rec[i]->events.size());
    }
    if (pass == 0) {
      EXPECT_EQ(previews, steps - 4);  // every step of the four but their last
    } else {
      EXPECT_EQ(previews, 1);
    }
  }
  EXPECT_EQ(images[0], images[1]);
}

// The budget's arithmetic: previews take about their share of the engine's time, however
// costly one is. A preview that cost more than the bank's cap (a quarter second: a large
// decoder on the CPU, a cold first call on a GPU) used to stop every later preview, since the
// credit never reached its cost.
TEST(PreviewBudgetTest, PreviewsTakeTheirShareEvenWhenOneCostsMoreThanTheBank) {
  for (const double cost : {0.4, 0.002}) {
    SCOPED_TRACE("cost " + std::to_string(cost));
    PreviewBudget b(0.05);
    const double step = 0.01;
    int64_t steps = 20000, served = 0;
    double spent = 0;
    for (int64_t i = 0; i < steps; ++i) {
      const size_t n = b.Grant(4, step);  // four requests due every step
      if (n > 0) {
        b.Spent(n, cost * static_cast<double>(n));
        served += static_cast<int64_t>(n);
        spent += cost * static_cast<double>(n);
      }
    }
    const double share = 0.05 * step * static_cast<double>(steps);  // 10 s
    EXPECT_LE(spent, share + std::max(PreviewBudget::kMaxCredit, cost) + cost);
    EXPECT_GE(spent, share - std::max(PreviewBudget::kMaxCredit, cost) - cost);
    std::printf("cost %.3f s: %lld previews in %.2f s of %lld steps (share %.2f s)\n", cost,
                static_cast<long long>(served), spent, static_cast<long long>(steps), share);
  }
  PreviewBudget none(0);  // no budget: every due preview
  EXPECT_EQ(none.Grant(7, 0.01), 7u);
}

// GenerateParams::previews (the HTTP API's partial images): k previews, preview j in the first
// step after (j + 1) / (k + 1) of the tokens are decided, none after; without a budget (share
// 0) every one comes, each showing more of the grid. A method that commits several tokens a
// step may pass two thresholds at once: then one preview stands for both.
TEST(EngineTest, PreviewsSpreadOverTheImageComeAtTheirFractions) {
  EngineOptions o = BundledOptions();
  o.preview_share = 0;
  auto engine = StartOrDie(o);
  for (const std::string method : {"ar", "scd-mc"}) {
    GenerateParams p = Params(method, 3, 7);
    p.previews = 3;
    auto rec = std::make_shared<Recorder>();
    ASSERT_TRUE(engine->Submit(p, rec).ok());
    ASSERT_TRUE(rec->Wait());
    ASSERT_TRUE(rec->result.has_value());
    std::vector<int64_t> at;  // tokens decided at each preview
    for (const StepEvent& e : rec->events) {
      if (!e.preview.empty()) at.push_back(e.totals.tokens);
    }
    std::printf("%s: previews after %s tokens of 196\n", method.c_str(),
                [&] {
                  std::string s;
                  for (int64_t t : at) s += (s.empty() ? "" : ", ") + std::to_string(t);
                  return s;
                }()
                    .c_str());
    if (method == "ar") {
      EXPECT_EQ(at, (std::vector<int64_t>{49, 98, 147}));  // 196 / 4, 2 / 4, 3 / 4
    } else {
      ASSERT_GE(at.size(), 1u);
      EXPECT_LE(at.size(), 3u);
      EXPECT_GE(at[0], 49);
      EXPECT_LT(at.back(), 196);
    }
  }
  GenerateParams bad = Params("ar", 0, 1);
  bad.previews = -1;
  EXPECT_EQ(engine->Submit(bad, std::make_shared<Recorder>()).status().field(), "previews");
}

// The bundled models with fmnist-gpt's classes renamed "9", "8", ..., "0" (weights linked,
// config.json rewritten): class_id 7 draws class 7, class_name "7" draws class 2. (The engine
// once looked an id up as a name first, and drew class 2 for class_id 7.)
TEST(EngineTest, ClassIdIsAnIdEvenWhenClassNamesAreNumbers) {
  namespace fs = std::filesystem;
  const std::string bundled = imagegen::testing::TestModelsDir();
  const std::string dir = testing::TempDir("numeric_names");
  for (const char* m : {"fmnist-vq", "fmnist-draft"}) {
    fs::create_directory_symlink(fs::absolute(bundled + "/" + m), dir + "/" + m);
  }
  fs::create_directory(dir + "/fmnist-gpt");
  fs::create_symlink(fs::absolute(bundled + "/fmnist-gpt/model.safetensors"),
                     dir + "/fmnist-gpt/model.safetensors");
  auto text = ReadFile(bundled + "/fmnist-gpt/config.json");
  ASSERT_TRUE(text.ok());
  auto cfg = ParseJson(*text);
  ASSERT_TRUE(cfg.ok());
  Json j = *cfg;
  j["class_names"] = Json::array();
  for (int c = 9; c >= 0; --c) j["class_names"].push_back(std::to_string(c));
  testing::WriteText(dir + "/fmnist-gpt/config.json", j.dump(2));

  EngineOptions o = BundledOptions();
  o.models_dir = dir;
  auto engine = StartOrDie(o);
  auto run = [&](GenerateParams p) {
    auto r = std::make_shared<Recorder>();
    EXPECT_TRUE(engine->Submit(p, r).ok());
    EXPECT_TRUE(r->Wait());
    return r->result.has_value() ? r->result->class_id : -1;
  };
  EXPECT_EQ(run(Params("ar", 7, 1)), 7);
  GenerateParams by_name = Params("ar", 0, 1);
  by_name.class_id.reset();
  by_name.class_name = "7";
  EXPECT_EQ(run(by_name), 2);
  engine.reset();
  testing::RemoveTree(dir);
}

// The goodput controller (the default) with a step cost where every token counts: 16
// concurrent scd-mc requests get windows below their 32, and report what the controller
// expected and predicted; a request alone keeps its whole window, so its seed gives the same
// image as under whole windows.
TEST(EngineTest, GoodputShrinksWindowsUnderLoadAndKeepsALoneRequestWhole) {
  EngineOptions o = BundledOptions();
  o.lone_request_max_window = 0;  // whole, on every device (the CPU's ceiling: the next test)
  // A step whose tokens cost (10 ms + 20 us per row + 0.1 ms per request): 16 whole windows
  // of 32 would take 32 ms for about 58 tokens, windows of 12-16 take 19-22 ms for 40-46.
  o.fixed_step_cost = {10e-3, 2e-5, 1e-4};
  o.trace_steps = true;  // and the controller's view of each request, checked below
  StepLog log;
  auto engine = StartOrDie(o, &log);
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int i = 0; i < 16; ++i) {
    rec.push_back(std::make_shared<Recorder>());
    ASSERT_TRUE(engine->Submit(Params("scd-mc", i % 10, 40 + i), rec.back()).ok());
  }
  double windows = 0, changes = 0;
  for (auto& r : rec) {
    ASSERT_TRUE(r->Wait());
    ASSERT_TRUE(r->result.has_value());
    const RequestStats& st = r->result->stats;
    EXPECT_GT(st.mean_window, 1.0);
    EXPECT_GT(st.expected_tokens, 0.0);
    EXPECT_GT(st.predicted_step_seconds, 0.0);
    EXPECT_GT(st.measured_step_seconds, 0.0);
    windows += st.mean_window;
    changes += st.mean_window_change;
  }
  EXPECT_LT(windows / 16, 20.0);  // shrunk: whole windows would average about 31
  WaitIdle(*engine);
  {
    std::lock_guard<std::mutex> l(log.mu);
    int64_t limited = 0, explored = 0, cut = 0;
    for (const StepSample& s : log.samples) {
      limited += s.budget_limited ? 1 : 0;
      if (s.requests > 1) {
        EXPECT_GT(s.expected_committed, 0.0);
      }
      EXPECT_GT(s.predicted_seconds, 0.0);
      // The trace: every request of the step, with what it was granted and committed.
      ASSERT_EQ(static_cast<int64_t>(s.trace.size()), s.requests);
      int64_t tokens = 0, committed = 0;
      double expected = 0;
      for (const StepSample::RequestTrace& t : s.trace) {
        EXPECT_EQ(t.method, "scd-mc");
        EXPECT_GE(t.window, 1);
        EXPECT_LE(t.window, t.wanted);
        EXPECT_GE(t.committed, 1);
        EXPECT_LE(t.committed, t.window);
        EXPECT_GE(t.factor, 0.25);
        EXPECT_LE(t.factor, 4.0);
        EXPECT_GE(t.expected, 1.0);
        tokens += t.window * t.rows;
        committed += t.committed;
        expected += t.expected;
        cut += t.window < t.wanted ? 1 : 0;
      }
      EXPECT_EQ(tokens, s.tokens);
      EXPECT_EQ(committed, s.committed);
      if (s.requests > 1) {
        EXPECT_NEAR(expected, s.expected_committed, 1e-6 * expected);
      }
      EXPECT_GE(s.wanted_predicted_seconds, s.predicted_seconds * (1 - 1e-9));
      explored += s.explore ? 1 : 0;
    }
    EXPECT_GT(limited, 0);
    EXPECT_GT(cut, 0);
    EXPECT_GT(explored, 0);  // one planned step in 16
  }
  auto alone = [](Engine& e) { return DrawOne(e, Params("scd-mc", 3, 77)); };
  const RequestResult g = alone(*engine);
  engine.reset();
  EngineOptions full = BundledOptions();
  full.window_policy = "full";
  auto whole = StartOrDie(full);
  const RequestResult f = alone(*whole);
  EXPECT_EQ(g.tokens, f.tokens);
  EXPECT_EQ(g.stats.counters.nfe, f.stats.counters.nfe);
  EXPECT_DOUBLE_EQ(g.stats.mean_window, f.stats.mean_window);
  std::printf("mean window change per step: 16 under load %.2f, alone %.2f (whole windows %.2f)\n",
              changes / 16, g.stats.mean_window_change, f.stats.mean_window_change);
  EXPECT_DOUBLE_EQ(g.stats.mean_window_change, f.stats.mean_window_change);
  // Whole windows move only at the image's end (the last windows are cut to what is left); AR's
  // never (a first step counts no change).
  EXPECT_GT(f.stats.mean_window_change, 0.0);
  auto ar = std::make_shared<Recorder>();
  ASSERT_TRUE(whole->Submit(Params("ar", 3, 77), ar).ok());
  ASSERT_TRUE(ar->Wait());
  ASSERT_TRUE(ar->result.has_value());
  EXPECT_EQ(ar->result->stats.mean_window_change, 0.0);
  whole.reset();
  // Planned as any other (lone_request_full_window off), the same request alone gets the
  // window a steep cost makes fastest (2 ms + 0.1 ms per row: about 8 nodes, by the prior's
  // commits), narrower than its whole window and wider than AR's.
  o.fixed_step_cost = {2e-3, 1e-4, 1e-4};
  o.lone_request_full_window = false;
  o.trace_steps = false;
  auto planned = StartOrDie(o);
  const RequestResult p = alone(*planned);
  EXPECT_EQ(p.tokens.size(), f.tokens.size());
  EXPECT_GT(p.stats.mean_window, 2.0);
  EXPECT_LT(p.stats.mean_window, 0.75 * f.stats.mean_window);
  std::printf("alone: mean window %.1f planned, %.1f whole\n", p.stats.mean_window,
              f.stats.mean_window);
}

// A lone request's ceiling is a number fixed while the engine runs: given
// (lone_request_max_window >= 1), or, with -2 (the CPU's default, -1), the one LoneRequestCeiling
// derives at start from the step-cost calibration. A given ceiling draws the same image for a
// seed whatever the step cost says (a flat and a steep one here); one from the calibration
// follows it (flat: the whole window; steep: the window it makes fastest), the same image on
// every start with that calibration.
TEST(EngineTest, ALoneRequestsWindowCeilingIsFixedByTheOptionsOrTheCalibration) {
  const std::vector<double> flat = {2e-3, 0, 0}, steep = {2e-3, 1e-4, 1e-4};
  auto alone = [](const std::vector<double>& cost, int64_t ceiling) {
    EngineOptions o = BundledOptions();
    o.fixed_step_cost = cost;
    o.lone_request_max_window = ceiling;
    return DrawOne(*StartOrDie(o), Params("scd-mc", 3, 77));
  };
  const RequestResult flat12 = alone(flat, 12);
  const RequestResult steep12 = alone(steep, 12);
  ASSERT_FALSE(flat12.tokens.empty());
  EXPECT_EQ(flat12.tokens, steep12.tokens);
  EXPECT_EQ(flat12.stats.counters.nfe, steep12.stats.counters.nfe);
  EXPECT_DOUBLE_EQ(flat12.stats.mean_window, steep12.stats.mean_window);
  EXPECT_LE(flat12.stats.mean_window, 12.0);
  EXPECT_GT(flat12.stats.mean_window, 5.0);
  const RequestResult whole = alone(steep, 0);
  const RequestResult five = alone(flat, 5);
  EXPECT_LE(five.stats.mean_window, 5.0);
  EXPECT_GT(five.stats.mean_window, 2.0);
  EXPECT_GT(whole.stats.mean_window, 20.0);  // the preset's 32, cut only at the image's end
  EXPECT_NE(flat12.tokens, whole.tokens);    // another window, another sample of the same law

  // From the calibration (here the fixed costs themselves): 2 ms + 0.1 ms per row makes about
  // 8 of scd-mc's 32 nodes fastest by its prior; a flat cost the whole window.
  const int64_t ceiling = LoneRequestCeiling(StepCostModel::Linear(steep[0], steep[1], steep[2]),
                                             "scd-mc", 2, 32, EngineOptions().min_speculation_gain);
  ASSERT_GT(ceiling, 4);
  ASSERT_LT(ceiling, 16);
  const RequestResult by_cost = alone(steep, kLoneWindowFromCalibration);
  const RequestResult again = alone(steep, kLoneWindowFromCalibration);
  EXPECT_EQ(by_cost.tokens, again.tokens);
  EXPECT_LE(by_cost.stats.mean_window, static_cast<double>(ceiling));
  EXPECT_GT(by_cost.stats.mean_window, 0.8 * static_cast<double>(ceiling));
  EXPECT_NE(by_cost.tokens, flat12.tokens);
  EXPECT_EQ(alone(flat, kLoneWindowFromCalibration).tokens, whole.tokens);

  // The default (-1): the calibration's on the CPU, none on CUDA.
  const RequestResult by_default = alone(steep, -1);
  EngineOptions o = BundledOptions();
  o.lone_request_max_window = -1;
  if (testing::TestLoadOptions().device.is_cuda()) {
    EXPECT_EQ(by_default.tokens, whole.tokens);
    EXPECT_EQ(StartOrDie(o)->lone_request_max_window(), 0);
  } else {
    EXPECT_EQ(by_default.tokens, by_cost.tokens);
    EXPECT_EQ(StartOrDie(o)->lone_request_max_window(), kLoneWindowFromCalibration);
  }
  std::printf(
      "alone (scd-mc, 32 nodes): mean window %.1f at most 12, %.1f whole, %.1f at most 5, %.1f "
      "from a steep cost (ceiling %lld)\n",
      flat12.stats.mean_window, whole.stats.mean_window, five.stats.mean_window,
      by_cost.stats.mean_window, static_cast<long long>(ceiling));
}

// With a real calibration, measured by one engine and read from the cache by the next: a lone
// request's ceiling is the one the calibration's one-request steps give (StepCostModel::
// OneRequest, which the online refinement never changes; said at start), so a seed alone draws
// the same image after a restart, also after the first engine ran and learned from other steps.
// (With the whole calibration's fit in place of OneRequest the said ceiling differs here: 1
// node for every preset on the dev VM.)
TEST(EngineTest, ALoneRequestsCalibratedCeilingIsTheSameAfterARestart) {
  const std::string dir = testing::TempDir("lone_ceiling");
  EngineOptions o = BundledOptions();
  o.cache_dir = dir + "/cache";
  o.step_cost_spot_check = 0;  // the second start reads the file whatever the load is now
  o.lone_request_max_window = kLoneWindowFromCalibration;
  std::vector<std::string> said;
  o.log = [&](const std::string& m) {
    if (m.find("a request alone runs at most") != std::string::npos) said.push_back(m);
  };
  RequestResult first;
  {
    auto engine = StartOrDie(o);
    std::vector<std::shared_ptr<Recorder>> rec;
    for (int i = 0; i < 6; ++i) {
      rec.push_back(std::make_shared<Recorder>());
      ASSERT_TRUE(engine->Submit(Params(i % 2 ? "sjd" : "scd-mc", i, 300 + i), rec.back()).ok());
    }
    for (auto& r : rec) ASSERT_TRUE(r->Wait());
    first = DrawOne(*engine, Params("scd-mc", 3, 77));
  }
  const RequestResult second = DrawOne(*StartOrDie(o), Params("scd-mc", 3, 77));
  ASSERT_FALSE(first.tokens.empty());
  EXPECT_EQ(first.tokens, second.tokens);
  EXPECT_EQ(first.stats.counters.nfe, second.stats.counters.nfe);
  // What the engine said at both starts is the ceiling the cached file's one-request steps give.
  ASSERT_EQ(said.size(), 2u);
  EXPECT_EQ(said[0], said[1]);
  // The step-cost files (the few-row kernel's rows beside them).
  const std::vector<std::string> files = testing::FilesStartingWith(o.cache_dir, "step-cost-");
  ASSERT_EQ(files.size(), 1u);
  auto text = ReadFile(files[0]);
  ASSERT_TRUE(text.ok());
  auto json = ParseJson(*text);
  ASSERT_TRUE(json.ok());
  // One request's knots, timed in rounds (ModelScheduler::MeasureLoneRequest): every width of
  // the calibration's sjd request, 1 to 64 nodes of two rows, each the median of its rounds.
  std::set<int64_t> one_request_rows;
  for (const auto& sample : (*json)["samples"]) {
    if (sample[1].get<int64_t>() == 1) one_request_rows.insert(sample[0].get<int64_t>());
  }
  EXPECT_EQ(one_request_rows, (std::set<int64_t>{2, 4, 8, 16, 32, 64, 128}));
  StepCostModel calibration;  // read as the scheduler reads it, under the file's own key
  ASSERT_TRUE(calibration.Deserialize(*text, (*json)["key"].get<std::string>(), files[0]).ok());
  const int64_t ceiling =
      LoneRequestCeiling(calibration.OneRequest(), "scd-mc", 2, 32, o.min_speculation_gain);
  EXPECT_NE(said[0].find("scd-mc " + std::to_string(ceiling) + " of 32"), std::string::npos)
      << said[0];
  EXPECT_LE(first.stats.mean_window, static_cast<double>(ceiling));
  std::printf("%s\nalone: scd-mc mean window %.2f, NFE %lld\n", said[0].c_str(),
              first.stats.mean_window, static_cast<long long>(first.stats.counters.nfe));
  testing::RemoveTree(dir);
}

// A custom policy (parts set by hand) is planned from its nearest preset's prior and learns in
// a table of its own (CommitModel::Key, kept on the request from its admission): through the
// engine, not only the model's bookkeeping (GoodputTest.CustomPolicies...).
TEST(EngineTest, GoodputPlansACustomPolicyFromItsOwnTable) {
  EngineOptions o = BundledOptions();
  // Whole windows alone: the table learns at the window a request is granted, and what is
  // checked is the expectation at the wanted one.
  o.lone_request_max_window = 0;
  o.trace_steps = true;
  StepLog log;
  auto engine = StartOrDie(o, &log);
  GenerateParams custom = Params("scd-mc", 4, 31);
  custom.policy.preset = "custom";  // scd-mc's parts, set by hand
  ASSERT_EQ(CommitModel::NearestPreset(custom.policy), "scd-mc");
  // What the controller expected of each request's first step at its wanted window.
  auto first_step = [&](const GenerateParams& p) {
    {
      std::lock_guard<std::mutex> l(log.mu);
      log.samples.clear();
    }
    auto r = std::make_shared<Recorder>();
    EXPECT_TRUE(engine->Submit(p, r).ok());
    EXPECT_TRUE(r->Wait());
    WaitIdle(*engine);
    std::lock_guard<std::mutex> l(log.mu);
    EXPECT_FALSE(log.samples.empty());
    StepSample::RequestTrace t;
    if (!log.samples.empty() && !log.samples.front().trace.empty()) {
      t = log.samples.front().trace.front();
    }
    return t;
  };
  const StepSample::RequestTrace a = first_step(custom);
  ASSERT_GE(a.wanted, 16);
  EXPECT_EQ(a.method, "custom");
  EXPECT_DOUBLE_EQ(a.factor, 1.0);
  // scd-mc's prior (3.6 tokens at 32 nodes), not sjd's (2.4), which every custom policy got
  // before its table had a key, and which an unset key would give.
  EXPECT_DOUBLE_EQ(a.expected_wanted, CommitModel::Prior("scd-mc", a.wanted));
  EXPECT_GT(a.expected_wanted, CommitModel::Prior("sjd", a.wanted) + 0.5);
  // The second custom request starts from what the first taught its table; the preset's table
  // learned nothing from either.
  const StepSample::RequestTrace b = first_step(custom);
  EXPECT_EQ(b.wanted, a.wanted);
  EXPECT_NE(b.expected_wanted, a.expected_wanted);
  const StepSample::RequestTrace c = first_step(Params("scd-mc", 4, 31));
  EXPECT_EQ(c.method, "scd-mc");
  EXPECT_EQ(c.wanted, a.wanted);
  EXPECT_DOUBLE_EQ(c.expected_wanted, CommitModel::Prior("scd-mc", c.wanted));
  std::printf("first step's expected commits at %lld nodes: custom %.3f then %.3f; scd-mc %.3f\n",
              static_cast<long long>(a.wanted), a.expected_wanted, b.expected_wanted,
              c.expected_wanted);
}

// explore_every = 0: no planned step explores, where the default explores one in 16
// (GoodputShrinksWindowsUnderLoadAndKeepsALoneRequestWhole counts them).
TEST(EngineTest, GoodputNeverExploresWithExploreEveryZero) {
  EngineOptions o = BundledOptions();
  o.fixed_step_cost = {2e-3, 1e-4, 1e-4};  // steep: the two requests' windows are planned
  o.explore_every = 0;
  o.trace_steps = true;
  StepLog quiet;
  auto never = StartOrDie(o, &quiet);
  std::vector<std::shared_ptr<Recorder>> two = {std::make_shared<Recorder>(),
                                                std::make_shared<Recorder>()};
  for (size_t i = 0; i < two.size(); ++i) {
    ASSERT_TRUE(never->Submit(Params("scd-mc", 3, 90 + i), two[i]).ok());
  }
  for (auto& r : two) ASSERT_TRUE(r->Wait());
  WaitIdle(*never);
  std::lock_guard<std::mutex> l(quiet.mu);
  int64_t shared = 0;
  for (const StepSample& s : quiet.samples) {
    EXPECT_FALSE(s.explore);
    shared += s.requests > 1 ? 1 : 0;
  }
  EXPECT_GE(shared, 16);  // enough planned steps of two for the default to have explored
}

// explore_budget: the exploring steps' predicted time over the plans they replaced stays within
// the budget's share of the planned steps' predicted time (0.5% here), so they are fewer than
// the one in 16 that explore_every alone takes; with a budget of 1 there is one in 16 again,
// costing more than twice the budget.
TEST(EngineTest, GoodputExploresWithinItsBudget) {
  auto run = [](double budget, int64_t* planned, double* planned_seconds, double* extra) {
    EngineOptions o = BundledOptions();
    // Steep: 2 ms + 0.1 ms a row, so that a plan twice as wide costs about half a step more.
    o.fixed_step_cost = {2e-3, 1e-4, 1e-4};
    o.explore_budget = budget;
    o.trace_steps = true;
    StepLog log;
    auto engine = StartOrDie(o, &log);
    RunAtOnce(*engine, "scd-mc", 4, 120);
    std::lock_guard<std::mutex> l(log.mu);
    int64_t explored = 0;
    *planned = 0;
    *planned_seconds = *extra = 0;
    for (const StepSample& s : log.samples) {
      if (s.requests < 2) continue;  // a request alone keeps its whole window: not planned
      ++*planned;
      *planned_seconds += s.predicted_seconds;
      explored += s.explore ? 1 : 0;
      *extra += s.explore_extra_seconds;
      if (!s.explore) {
        EXPECT_EQ(s.explore_extra_seconds, 0);
      }
    }
    return explored;
  };
  int64_t planned = 0;
  double seconds = 0, extra = 0;
  const int64_t budgeted = run(0.005, &planned, &seconds, &extra);
  std::printf("budget 0.005: %lld of %lld planned steps explored, %.2f%% of their predicted time\n",
              static_cast<long long>(budgeted), static_cast<long long>(planned),
              100 * extra / seconds);
  EXPECT_GE(planned, 48);
  EXPECT_GT(budgeted, 0);
  EXPECT_LE(extra, 0.005 * seconds * (1 + 1e-9));
  EXPECT_LT(budgeted, planned / 16);  // the budget, not the cadence, limited them
  const int64_t unlimited = run(1, &planned, &seconds, &extra);
  std::printf("budget 1: %lld of %lld planned steps explored, %.2f%% of their predicted time\n",
              static_cast<long long>(unlimited), static_cast<long long>(planned),
              100 * extra / seconds);
  EXPECT_GE(unlimited, planned / 16 - 1);
  EXPECT_GT(extra, 0.01 * seconds);  // twice what the budget let through
}

// The match rule (scd-gm) makes a seed's image independent of its windows, so the controller
// plans a lone scd-gm request as any other (GoodputRequest::window_invariant) with
// lone_request_full_window on (the default): on a steep cost its windows shrink well below the
// whole window, and the image is still the one ar-gm draws for the seed, as it is under load
// beside other requests whose windows move every step. The same lone plan for scd-gs (the
// exact rule) keeps its whole window (the power: without the exemption nothing shrinks).
TEST(EngineTest, GoodputPlansALoneMatchRequestAndItStillDrawsTheArGmImage) {
  auto run = [](Engine& e, const std::string& method, int64_t cls, uint64_t seed) {
    auto r = std::make_shared<Recorder>();
    EXPECT_TRUE(e.Submit(Params(method, cls, seed), r).ok());
    return r;
  };
  auto result = [](const std::shared_ptr<Recorder>& r) {
    EXPECT_TRUE(r->Wait());
    EXPECT_TRUE(r->result.has_value());
    return r->result.value_or(RequestResult{});
  };
  EngineOptions o = BundledOptions();
  o.fixed_step_cost = {2e-3, 1e-4, 1e-4};  // steep: a few nodes are fastest
  // On this cost a few nodes are predicted only 2-3% faster than AR while the drafts are young:
  // no margin over AR here (GoodputTest covers it), so that the lone plan is what is tested.
  o.min_speculation_gain = 0;
  auto steep = StartOrDie(o);
  const RequestResult ar = result(run(*steep, "ar-gm", 3, 77));
  const RequestResult gm = result(run(*steep, "scd-gm", 3, 77));
  const RequestResult gs = result(run(*steep, "scd-gs", 3, 77));
  ASSERT_EQ(ar.tokens.size(), 196u);
  EXPECT_EQ(gm.tokens, ar.tokens);
  EXPECT_LT(gm.stats.counters.nfe, 196 * 4 / 5);  // it did speculate
  EXPECT_GT(gm.stats.mean_window, 2.0);
  EXPECT_LT(gm.stats.mean_window, 0.5 * gs.stats.mean_window);  // planned, not whole
  std::printf("alone: scd-gm mean window %.1f (%lld steps), scd-gs %.1f (whole)\n",
              gm.stats.mean_window, static_cast<long long>(gm.stats.counters.nfe),
              gs.stats.mean_window);
  steep.reset();
  // Under load, on a gentler cost (windows of 12-16 for 16 scd-mc requests): eight scd-gm
  // requests beside ar-gm and scd-mc ones, their windows moving from step to step.
  o.fixed_step_cost = {10e-3, 2e-5, 1e-4};
  auto gentle = StartOrDie(o);
  std::vector<std::shared_ptr<Recorder>> load, ref;
  for (int i = 0; i < 12; ++i) {
    const std::string method = i < 8 ? "scd-gm" : (i % 2 ? "ar-gm" : "scd-mc");
    load.push_back(run(*gentle, method, i % 10, 300 + i));
  }
  std::vector<RequestResult> under;
  for (auto& r : load) under.push_back(result(r));
  for (int i = 0; i < 8; ++i) ref.push_back(run(*gentle, "ar-gm", i % 10, 300 + i));
  double window = 0, change = 0;
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(under[i].tokens, result(ref[i]).tokens) << "seed " << 300 + i;
    window += under[i].stats.mean_window / 8;
    change += under[i].stats.mean_window_change / 8;
  }
  std::printf("under load: scd-gm mean window %.1f, mean change per step %.2f\n", window, change);
  EXPECT_GT(window, 2.0);
  EXPECT_GT(change, 0.5);  // the windows moved
}

// A step that widens a request's window commits what its refined drafts allow, so neither the
// method's commit table nor the request's factor learns from it (EngineOptions::
// commit_learn_growth): in the trace a request's factor moves only after a step that held or
// narrowed its window. With the option on, growth steps move it too (the test's power).
TEST(EngineTest, GoodputLearnsCommitsOnlyFromStepsThatHoldTheWindow) {
  struct Moves {
    int64_t after_growth = 0, after_growth_steps = 0, after_held = 0, after_held_steps = 0;
  };
  auto run = [](bool learn_growth) {
    EngineOptions o = BundledOptions();
    o.fixed_step_cost = {10e-3, 2e-5, 1e-4};  // as above: windows shrink under load
    o.trace_steps = true;
    o.commit_learn_growth = learn_growth;
    StepLog log;
    auto engine = StartOrDie(o, &log);
    RunAtOnce(*engine, "scd-mc", 8, 140);
    Moves m;
    struct Last {
      int64_t window = 0, previous = 0;
      double factor = 0;
    };
    std::map<int64_t, Last> last;  // per request: its last traced step
    std::lock_guard<std::mutex> l(log.mu);
    for (const StepSample& s : log.samples) {
      for (const StepSample::RequestTrace& t : s.trace) {
        auto it = last.find(t.id);
        if (it != last.end()) {
          // The step before this one: did it widen the window (or was it the first)?
          const bool grew = it->second.previous == 0 || it->second.window > it->second.previous;
          const bool moved = t.factor != it->second.factor;
          (grew ? m.after_growth_steps : m.after_held_steps) += 1;
          (grew ? m.after_growth : m.after_held) += moved ? 1 : 0;
        }
        Last& n = last[t.id];
        n.previous = it != last.end() ? it->second.window : 0;
        n.window = t.window;
        n.factor = t.factor;
      }
    }
    return m;
  };
  const Moves held = run(false), every = run(true);
  std::printf(
      "factor moved after growth steps: %lld of %lld (learn growth: %lld of %lld); after "
      "held steps %lld of %lld\n",
      static_cast<long long>(held.after_growth), static_cast<long long>(held.after_growth_steps),
      static_cast<long long>(every.after_growth), static_cast<long long>(every.after_growth_steps),
      static_cast<long long>(held.after_held), static_cast<long long>(held.after_held_steps));
  EXPECT_GT(held.after_growth_steps, 8);  // the first steps and the windows that grew
  EXPECT_EQ(held.after_growth, 0);
  EXPECT_GT(held.after_held, 0);
  EXPECT_GT(every.after_growth, 0);
}

// The calibration is measured once and kept in cache_dir, keyed by model, device and dtype: a
// restart reads it (the file is not rewritten), and a file for something else, or one measured
// with fewer concurrent requests than the engine's slots allow, is replaced.
TEST(EngineTest, StepCostCalibrationIsCachedAndAForeignOrSmallerOneReplaced) {
  namespace fs = std::filesystem;
  const std::string dir = testing::TempDir("step_cost_cache");
  EngineOptions o = BundledOptions();
  o.cache_dir = dir + "/cache";
  // Whether a restart keeps the file must not depend on this machine's load between two starts:
  // the spot check is off here, and on below with times far off.
  o.step_cost_spot_check = 0;
  // The engine's notices go to EngineOptions::log (the daemon's --log-format), not stderr: here
  // the warnings, apart from each start's line of where the step cost came from.
  std::vector<std::string> notices, sources;
  o.log = [&](const std::string& m) {
    (m.rfind("step cost of fmnist-gpt: ", 0) == 0 ? sources : notices).push_back(m);
  };
  StartOrDie(o).reset();
  EXPECT_TRUE(notices.empty()) << notices[0];
  // The step-cost files (the few-row kernel's rows beside them).
  const std::vector<std::string> files = testing::FilesStartingWith(o.cache_dir, "step-cost-");
  ASSERT_EQ(files.size(), 1u);
  const std::string file = files[0];
  EXPECT_NE(file.find("step-cost-fmnist-gpt-cpu"), std::string::npos) << file;
  ASSERT_EQ(sources.size(), 1u);
  EXPECT_NE(sources[0].find(": calibrated on "), std::string::npos) << sources[0];
  EXPECT_NE(sources[0].find(", cached in " + file), std::string::npos) << sources[0];
  auto first = ReadFile(file);
  ASSERT_TRUE(first.ok());
  EXPECT_NE(first->find("fmnist-gpt (dim 192"), std::string::npos) << *first;
  const auto written = fs::last_write_time(file);
  StartOrDie(o).reset();
  EXPECT_EQ(fs::last_write_time(file), written);
  ASSERT_EQ(sources.size(), 2u);
  EXPECT_EQ(sources[1], "step cost of fmnist-gpt: read from " + file) << sources[1];
  EXPECT_EQ(*ReadFile(file), *first);
  std::string foreign = *first;
  foreign.replace(foreign.find("fmnist-gpt (dim"), 10, "other-gpt!");
  testing::WriteText(file, foreign);
  StartOrDie(o).reset();
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].rfind("recalibrating the step cost: ", 0), 0u) << notices[0];
  EXPECT_NE(notices[0].find(file), std::string::npos) << notices[0];
  auto again = ReadFile(file);
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->find("fmnist-gpt (dim 192"), std::string::npos);
  EXPECT_EQ(again->find("other-gpt!"), std::string::npos);
  // A calibration whose times are far too slow for this device (timed during a stall, or on a
  // slower device) fails the spot check at start and is measured again: every sample's time
  // 10^4x too slow (a loaded machine's steps vary by tens of times, not thousands). One 10^4x
  // too fast is kept with a notice (the refinement corrects it). With the check off, both
  // files are kept without a notice.
  EngineOptions checked = o;
  checked.step_cost_spot_check = 3;
  auto scaled = [&](double factor) {
    auto j = nlohmann::json::parse(*ReadFile(file));
    for (auto& smp : j["samples"]) smp[2] = smp[2].get<double>() * factor;
    return j.dump();
  };
  auto median_seconds = [&] {
    const auto j = nlohmann::json::parse(*ReadFile(file));
    std::vector<double> t;
    for (const auto& smp : j["samples"]) t.push_back(smp[2].get<double>());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double measured = median_seconds();
  for (const auto& [factor, word] : {std::pair<double, std::string>{1e4, "faster"},
                                     std::pair<double, std::string>{1e-4, "slower"}}) {
    SCOPED_TRACE(word);
    testing::WriteText(file, scaled(factor));
    const std::string off = *ReadFile(file);
    notices.clear();
    StartOrDie(o).reset();
    EXPECT_TRUE(notices.empty()) << notices[0];
    EXPECT_EQ(*ReadFile(file), off);
    StartOrDie(checked).reset();
    ASSERT_EQ(notices.size(), 1u);
    EXPECT_NE(notices[0].find("ran more than 3x " + word), std::string::npos) << notices[0];
    EXPECT_NE(notices[0].find("measured"), std::string::npos) << notices[0];
    if (word == "faster") {
      EXPECT_EQ(notices[0].rfind("recalibrating the step cost: ", 0), 0u) << notices[0];
      // Measured again: within 100x of the first calibration, not the scaled file's 10^4x.
      EXPECT_LT(median_seconds(), measured * 100);
      EXPECT_GT(median_seconds(), measured / 100);
    } else {
      EXPECT_NE(notices[0].find("is kept"), std::string::npos) << notices[0];
      EXPECT_EQ(*ReadFile(file), off);
      testing::WriteText(file, scaled(1 / factor));  // as measured, for the parts below
    }
  }
  // A calibration an engine with two slots wrote (one request at a time) is measured again by
  // an engine that can run many; the small engine takes the larger one as it is.
  auto max_requests = [&] {
    const auto j = nlohmann::json::parse(*ReadFile(file));
    int64_t m = 0;
    for (const auto& s : j["samples"]) m = std::max(m, s[1].get<int64_t>());
    return m;
  };
  EXPECT_GE(max_requests(), 4);
  EngineOptions small = o;
  small.max_slots = 2;
  fs::remove(file);
  StartOrDie(small).reset();
  EXPECT_EQ(max_requests(), 1);
  StartOrDie(o).reset();
  EXPECT_GE(max_requests(), 4);
  const std::string large = *ReadFile(file);
  StartOrDie(small).reset();
  EXPECT_EQ(*ReadFile(file), large);
  // A calibration that set out to measure many requests but stopped short (the 20 s limit on a
  // slow device) is not measured again at every start.
  fs::remove(file);
  StartOrDie(small).reset();
  auto cut_short = nlohmann::json::parse(*ReadFile(file));
  cut_short["planned_requests"] = 1000;
  testing::WriteText(file, cut_short.dump());
  StartOrDie(o).reset();
  EXPECT_EQ(max_requests(), 1);
  testing::RemoveTree(dir);
}

// On the CPU each intra-op thread count keeps a calibration file of its own: an engine started
// at two threads, then one (a daemon restarted under another CPU quota), then each again reads
// its count's file, where one file for both counts was measured again at every change.
TEST(EngineTest, EachCpuThreadCountKeepsItsOwnStepCostCalibration) {
  if (testing::TestLoadOptions().device.is_cuda()) GTEST_SKIP() << "the CPU's threads";
  namespace fs = std::filesystem;
  const testing::ScopedIntraOpThreads restore(at::get_num_threads());
  const std::string dir = testing::TempDir("step_cost_threads");
  EngineOptions o = BundledOptions();
  o.cache_dir = dir + "/cache";
  o.step_cost_spot_check = 0;  // kept or not must not depend on this machine's load
  o.adaptive_cpu_threads = 0;
  std::vector<std::string> sources;
  o.log = [&](const std::string& m) {
    if (m.rfind("step cost of fmnist-gpt: ", 0) == 0) sources.push_back(m);
  };
  for (const int threads : {2, 1, 2, 1}) {
    o.cpu_threads = threads;
    StartOrDie(o).reset();
  }
  ASSERT_EQ(sources.size(), 4u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(sources[i].find(": calibrated on "), std::string::npos) << sources[i];
  }
  EXPECT_EQ(sources[2].rfind("step cost of fmnist-gpt: read from ", 0), 0u) << sources[2];
  EXPECT_NE(sources[2].find("-2threads"), std::string::npos) << sources[2];
  EXPECT_EQ(sources[3].rfind("step cost of fmnist-gpt: read from ", 0), 0u) << sources[3];
  EXPECT_NE(sources[3].find("-1threads"), std::string::npos) << sources[3];
  // The step-cost files' names (the few-row kernel's rows beside them).
  std::vector<std::string> files = testing::FilesStartingWith(o.cache_dir, "step-cost-");
  for (std::string& f : files) f = fs::path(f).filename().string();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].rfind("step-cost-fmnist-gpt-cpu-Float-1threads", 0), 0u) << files[0];
  EXPECT_EQ(files[1].rfind("step-cost-fmnist-gpt-cpu-Float-2threads", 0), 0u) << files[1];
  testing::RemoveTree(dir);
}

TEST(EngineTest, TokenBudgetShrinksWindowsAndBoundsAdmission) {
  EngineOptions o = BundledOptions();
  o.window_policy = "budget";
  o.max_tokens_per_step = 12;  // 6 CFG tokens: at most 6 requests feed one token each
  StepLog log;
  auto engine = StartOrDie(o, &log);
  std::vector<std::shared_ptr<Recorder>> rec;
  for (int i = 0; i < 8; ++i) {
    rec.push_back(std::make_shared<Recorder>());
    ASSERT_TRUE(engine->Submit(Params(i % 2 ? "sjd" : "scd-mc", i, 40 + i), rec.back()).ok());
  }
  for (auto& r : rec) ASSERT_TRUE(r->Wait() && r->result.has_value());
  std::lock_guard<std::mutex> l(log.mu);
  bool limited = false;
  for (const auto& s : log.samples) {
    EXPECT_LE(s.tokens, 12);
    EXPECT_LE(s.requests, 6);
    limited |= s.budget_limited;
  }
  EXPECT_TRUE(limited);
  int64_t widest = 0;
  for (auto& r : rec) {
    for (const auto& e : r->events) widest = std::max(widest, e.window);
    EXPECT_EQ(r->result->tokens.size(), 196u);
  }
  EXPECT_LE(widest, 6);
  EXPECT_GE(widest, 2);  // alone at the end, a request gets more than one token
}

// EngineOptions::warmup: each method at each concurrency runs before Start returns, through
// the static-shape forward that CUDA graphs capture (eager on the CPU), and leaves no trace a
// client could see: no steps reach the listener, the stats count nothing, the KV slots are
// free, and a request then draws the same image as on an engine that did not warm up.
TEST(EngineTest, WarmUpRunsBeforeStartReturnsAndLeavesNoTrace) {
  EngineOptions o = BundledOptions();
  o.cuda_graphs = 1;
  std::mutex mu;
  std::vector<std::string> notices;
  o.log = [&](const std::string& line) {
    std::lock_guard<std::mutex> l(mu);
    notices.push_back(line);
  };
  auto warm_notices = [&] {
    std::lock_guard<std::mutex> l(mu);
    int64_t n = 0;
    for (const std::string& line : notices) n += line.rfind("warm-up: ", 0) == 0 ? 1 : 0;
    return n;
  };
  EngineOptions warm = o;
  warm.warmup = 1;
  // sd needs the draft model, which this engine loads; "cspd" is a MAR method: skipped.
  warm.warmup_methods = {"ar", "sjd-pac", "sd", "cspd"};
  warm.warmup_concurrency = {1, 3, 3};         // a repeated count runs once
  warm.models = {"fmnist-gpt", "fmnist-t2i"};  // a class-conditional and a prompted model
  StepLog log;
  auto engine = StartOrDie(warm, &log);
  EXPECT_EQ(warm_notices(), 1);
  int64_t images = 0;  // 2 x (1 + 3) of each listed method a model serves
  for (const ModelInfo& m : engine->Models()) {
    for (const std::string& method : warm.warmup_methods) {
      images += std::count(m.methods.begin(), m.methods.end(), method) * 8;
    }
  }
  EXPECT_GE(images, 40);  // ar, sjd-pac and sd on fmnist-gpt; ar and sjd-pac at least on t2i
  {
    std::lock_guard<std::mutex> l(mu);
    ASSERT_FALSE(notices.empty());
    EXPECT_EQ(notices.back().rfind("warm-up: " + std::to_string(images) + " images in ", 0), 0u)
        << notices.back();
  }
  EXPECT_TRUE(log.samples.empty());
  EngineStats st = engine->Stats();
  EXPECT_EQ(st.completed, 0);
  EXPECT_EQ(st.failed, 0);
  EXPECT_EQ(st.steps, 0);
  EXPECT_EQ(st.decode_batches, 0);
  EXPECT_EQ(st.batch_decoded, 0);

  auto cold = StartOrDie(o);
  EXPECT_EQ(warm_notices(), 1);  // off: no warm-up
  auto a = std::make_shared<Recorder>(), b = std::make_shared<Recorder>();
  ASSERT_TRUE(engine->Submit(Params("ar", 3, 77), a).ok());
  ASSERT_TRUE(cold->Submit(Params("ar", 3, 77), b).ok());
  ASSERT_TRUE(a->Wait());
  ASSERT_TRUE(b->Wait());
  ASSERT_TRUE(a->result.has_value());
  ASSERT_TRUE(b->result.has_value());
  EXPECT_EQ(a->result->tokens, b->result->tokens);
  EXPECT_EQ(a->result->image.pixels, b->result->image.pixels);
  WaitIdle(*engine);
  st = engine->Stats();
  EXPECT_EQ(st.completed, 1);
  EXPECT_EQ(st.models[0].slots_used, 0);
  {
    std::lock_guard<std::mutex> l(log.mu);
    EXPECT_FALSE(log.samples.empty());  // the listener is back on after the warm-up
  }
}

TEST(EngineTest, ShutdownDrainsRunningRequestsThenRefusesNewOnes) {
  auto engine = StartOrDie(BundledOptions());
  auto a = std::make_shared<Recorder>(), b = std::make_shared<Recorder>();
  ASSERT_TRUE(engine->Submit(Params("scd-mc", 1, 1), a).ok());
  ASSERT_TRUE(engine->Submit(Params("ar", 2, 2), b).ok());
  engine->Shutdown(std::chrono::seconds(120));
  EXPECT_TRUE(a->result.has_value());
  EXPECT_TRUE(b->result.has_value());
  auto late = engine->Submit(Params("ar", 3, 3), std::make_shared<Recorder>());
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), Code::kUnavailable);
  // A grace period that runs out ends what is left with UNAVAILABLE.
  auto engine2 = StartOrDie(BundledOptions());
  auto c = std::make_shared<Recorder>();
  ASSERT_TRUE(engine2->Submit(Params("ar", 4, 4), c).ok());
  while (c->steps() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  engine2->Shutdown(std::chrono::milliseconds(0));
  ASSERT_TRUE(c->error.has_value());
  EXPECT_EQ(c->error->code(), Code::kUnavailable);
  EXPECT_EQ(c->terminal_calls, 1);
}

TEST(EngineTest, BadEngineOptionsAreRejected) {
  EngineOptions o = BundledOptions();
  o.models = {"missing-model"};
  EXPECT_EQ(Engine::Start(o).status().code(), Code::kNotFound);
  // Each option out of its range is refused, the message naming it.
  const std::vector<std::pair<std::string, std::function<void(EngineOptions&)>>> bad = {
      {"kv_cache_bytes", [](EngineOptions& e) { e.kv_cache_bytes = 1000; }},
      {"kv_cache_bytes", [](EngineOptions& e) { e.kv_cache_bytes = 0; }},
      {"kv_cache_bytes", [](EngineOptions& e) { e.kv_cache_bytes = -2; }},
      {"device", [](EngineOptions& e) { e.device = "tpu"; }},
      {"max_tokens_per_step", [](EngineOptions& e) { e.max_tokens_per_step = 1; }},
      {"max_tokens_per_step", [](EngineOptions& e) { e.max_tokens_per_step = -2; }},
      {"window_policy", [](EngineOptions& e) { e.window_policy = "fastest"; }},
      {"max_slowdown", [](EngineOptions& e) { e.max_slowdown = -0.5; }},
      {"window_stickiness", [](EngineOptions& e) { e.window_stickiness = 1.5; }},
      {"min_speculation_gain", [](EngineOptions& e) { e.min_speculation_gain = 2; }},
      {"explore_every", [](EngineOptions& e) { e.explore_every = -1; }},
      {"explore_budget", [](EngineOptions& e) { e.explore_budget = -0.1; }},
      {"lone_request_max_window", [](EngineOptions& e) { e.lone_request_max_window = -3; }},
      {"simulated_step_noise", [](EngineOptions& e) { e.simulated_step_noise = -1; }},
      {"fixed_step_cost", [](EngineOptions& e) { e.fixed_step_cost = {1.0}; }},
      {"fixed_step_cost",
       [](EngineOptions& e) {
         e.fixed_step_cost = {0, 0, 0};
       }},
      {"fixed_step_cost",
       [](EngineOptions& e) {
         e.fixed_step_cost = {1e-3, std::nan(""), 0};
       }},
      {"max_queue", [](EngineOptions& e) { e.max_queue = 0; }},
      {"simulated_capture_cost", [](EngineOptions& e) { e.simulated_capture_cost = -1; }},
      {"simulated_tree_cost", [](EngineOptions& e) { e.simulated_tree_cost = 2; }},
      {"step_cost_max_ratio", [](EngineOptions& e) { e.step_cost_max_ratio = 0.5; }},
      {"step_cost_spot_check", [](EngineOptions& e) { e.step_cost_spot_check = 1.2; }},
      {"commit_warmup_steps", [](EngineOptions& e) { e.commit_warmup_steps = -1; }},
      {"warmup", [](EngineOptions& e) { e.warmup = 2; }},
      {"adaptive_cpu_threads", [](EngineOptions& e) { e.adaptive_cpu_threads = 2; }},
      {"cpu_thread_governor: lower_share",
       [](EngineOptions& e) { e.cpu_thread_governor.lower_share = 0; }},
      {"cpu_thread_governor: counts",
       [](EngineOptions& e) {
         e.cpu_thread_governor.counts = {1, 2};
       }},
      {"small_rows_gemm_rows", [](EngineOptions& e) { e.small_rows_gemm_rows = -2; }},
      {"cpu_linear", [](EngineOptions& e) { e.cpu_linear = "mkl"; }},
      {"warmup_methods",
       [](EngineOptions& e) {
         e.warmup_methods = {"ar", "fastest"};
       }},
      {"warmup_concurrency",
       [](EngineOptions& e) {
         e.warmup_concurrency = {4, 0};
       }},
  };
  for (const auto& [field, set] : bad) {
    o = BundledOptions();
    set(o);
    EXPECT_NE(Engine::Start(o).status().message().find(field), std::string::npos) << field;
  }
}

// --- Decoding finished images off the engine thread (EngineOptions::decode_thread) -------------

TEST(DecodeQueueTest, AsyncRunsInOrderOnItsOwnThreadAndInlineRunsAtOnce) {
  DecodeQueue inline_q(false, c10::Device(c10::kCPU));
  std::thread::id ran_on;
  inline_q.Run([&] {
    ran_on = std::this_thread::get_id();
    return false;
  });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(inline_q.failed(), 1);
  EXPECT_EQ(inline_q.pending(), 0);

  DecodeQueue q(true, c10::Device(c10::kCPU));
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::vector<int> order;
  std::thread::id first_on;
  q.Run([&] {
    gate.wait();  // a slow decode: Run must not wait for it
    first_on = std::this_thread::get_id();
    order.push_back(1);
    return true;
  });
  q.Run([&] {
    order.push_back(2);
    return false;
  });
  q.Run([]() -> bool { throw std::runtime_error("escaped"); });
  EXPECT_EQ(q.pending(), 3);  // the first is held, the others wait behind it
  release.set_value();
  q.Stop();  // runs what is queued, then ends the thread
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_NE(first_on, std::this_thread::get_id());
  EXPECT_EQ(q.completed(), 1);
  EXPECT_EQ(q.failed(), 2);
  EXPECT_EQ(q.pending(), 0);
  q.Run([] { return true; });  // after Stop: at once, on the caller
  EXPECT_EQ(q.completed(), 2);
}

// A finished request for the queue's batched path: its label is its seed.
DecodeQueue::Finished FinishedFor(uint64_t label, std::shared_ptr<Recorder> r) {
  DecodeQueue::Finished f;
  f.observer = std::move(r);
  f.result.seed = label;
  f.finished = Clock::now();
  return f;
}

// An image 1 x 1 whose pixel is the request's label, and the sizes of the calls.
DecodeQueue::BatchDecode LabelDecode(std::vector<size_t>* calls, std::mutex* mu) {
  return [calls, mu](const std::vector<const RequestResult*>& rs) {
    std::lock_guard<std::mutex> l(*mu);
    calls->push_back(rs.size());
    std::vector<StatusOr<Image>> out;
    for (const RequestResult* r : rs) {
      if (r->seed == 99) {
        out.emplace_back(Internal("no image for 99"));
        continue;
      }
      Image img;
      img.width = img.height = img.channels = 1;
      img.pixels = std::string(1, static_cast<char>(r->seed));
      out.emplace_back(std::move(img));
    }
    return out;
  };
}

TEST(DecodeQueueTest, BatchesTheSameDecodersQueuedRequestsUpToItsLimit) {
  DecodeQueue q(true, c10::Device(c10::kCPU), 0, /*max_batch=*/4);
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  q.Run([&] {
    gate.wait();  // holds the thread while the batches queue behind
    return true;
  });
  std::mutex mu;
  std::vector<size_t> calls;
  int a = 0, b = 0;  // two decoders
  std::vector<std::shared_ptr<Recorder>> rs;
  auto submit = [&](const void* key, std::vector<uint64_t> labels) {
    std::vector<DecodeQueue::Finished> done;
    for (uint64_t l : labels) {
      rs.push_back(std::make_shared<Recorder>());
      done.push_back(FinishedFor(l, rs.back()));
    }
    q.CompleteBatch(key, std::move(done), LabelDecode(&calls, &mu));
  };
  submit(&a, {1});
  submit(&a, {2, 3});
  submit(&a, {4, 5});  // would make 5: the next call
  submit(&b, {6});     // another decoder: a call of its own
  submit(&a, {7, 99});
  submit(&a, {8, 9, 10, 11, 12});  // more than the limit: split
  EXPECT_EQ(q.pending(), 14);      // the held task and 13 requests
  release.set_value();
  q.Stop();
  EXPECT_EQ(calls, (std::vector<size_t>{3, 2, 1, 2, 4, 1}));
  EXPECT_EQ(q.batch_calls(), 6);
  EXPECT_EQ(q.batch_images(), 13);
  const std::vector<uint64_t> labels = {1, 2, 3, 4, 5, 6, 7, 99, 8, 9, 10, 11, 12};
  for (size_t i = 0; i < rs.size(); ++i) {
    EXPECT_EQ(rs[i]->terminal_calls, 1) << i;
    if (labels[i] == 99) {
      ASSERT_TRUE(rs[i]->error.has_value());
      EXPECT_NE(rs[i]->error->message().find("no image for 99"), std::string::npos);
      continue;
    }
    ASSERT_TRUE(rs[i]->result.has_value()) << i;
    EXPECT_EQ(rs[i]->result->image.pixels, std::string(1, static_cast<char>(labels[i]))) << i;
    EXPECT_GE(rs[i]->result->stats.decode_seconds, 0);
  }
  EXPECT_EQ(q.completed(), 1 + 12);  // the held task and 12 images
  EXPECT_EQ(q.failed(), 1);
}

TEST(DecodeQueueTest, InlineBatchesRunAtOnceInCallsOfTheLimitAndAFailedCallFailsEach) {
  DecodeQueue q(false, c10::Device(c10::kCPU), 0, /*max_batch=*/2);
  std::mutex mu;
  std::vector<size_t> calls;
  std::vector<std::shared_ptr<Recorder>> rs;
  std::vector<DecodeQueue::Finished> done;
  for (uint64_t l = 1; l <= 5; ++l) {
    rs.push_back(std::make_shared<Recorder>());
    done.push_back(FinishedFor(l, rs.back()));
  }
  q.CompleteBatch(nullptr, std::move(done), LabelDecode(&calls, &mu));
  EXPECT_EQ(calls, (std::vector<size_t>{2, 2, 1}));
  for (size_t i = 0; i < rs.size(); ++i) {
    ASSERT_TRUE(rs[i]->result.has_value()) << i;  // no waiting: inline
    EXPECT_EQ(rs[i]->result->image.pixels, std::string(1, static_cast<char>(i + 1)));
  }
  // A decoder that throws, or returns the wrong number of images: every request of the call
  // gets the error, none is lost.
  const std::vector<DecodeQueue::BatchDecode> broken = {
      [](const std::vector<const RequestResult*>&) -> std::vector<StatusOr<Image>> {
        throw std::runtime_error("out of memory");
      },
      [](const std::vector<const RequestResult*>&) {
        std::vector<StatusOr<Image>> one;
        one.emplace_back(Image{});
        return one;
      }};
  for (const auto& decode : broken) {
    std::vector<std::shared_ptr<Recorder>> failing;
    std::vector<DecodeQueue::Finished> two;
    for (uint64_t l = 1; l <= 2; ++l) {
      failing.push_back(std::make_shared<Recorder>());
      two.push_back(FinishedFor(l, failing.back()));
    }
    q.CompleteBatch(nullptr, std::move(two), decode);
    for (auto& r : failing) {
      EXPECT_EQ(r->terminal_calls, 1);
      ASSERT_TRUE(r->error.has_value());
      EXPECT_EQ(r->error->code(), Code::kInternal) << r->error->ToString();
    }
  }
  EXPECT_EQ(q.completed(), 5);
  EXPECT_EQ(q.failed(), 4);
}

// Complete (one request, the path of the eager engine and of MAR): no image wanted, an image,
// a decoder that throws, and an observer that throws; inline, nothing escapes to the caller.
TEST(DecodeQueueTest, CompleteDeliversEachOutcomeAndAnObserversErrorStaysInTheQueue) {
  class Throwing : public Recorder {
   public:
    void OnComplete(RequestResult) override { throw std::runtime_error("client gone"); }
  };
  DecodeQueue q(false, c10::Device(c10::kCPU));
  const Clock::time_point finished = Clock::now();
  RequestResult res;
  res.seed = 7;
  auto none = std::make_shared<Recorder>();
  q.Complete(none, res, finished, nullptr);
  ASSERT_TRUE(none->result.has_value());
  EXPECT_TRUE(none->result->image.pixels.empty());
  EXPECT_EQ(none->result->seed, 7u);
  EXPECT_GE(none->result->stats.decode_seconds, 0);

  auto imaged = std::make_shared<Recorder>();
  q.Complete(imaged, res, finished, [](const RequestResult& r) -> StatusOr<Image> {
    Image img;
    img.width = img.height = img.channels = 1;
    img.pixels = std::string(1, static_cast<char>(r.seed));
    return img;
  });
  ASSERT_TRUE(imaged->result.has_value());
  EXPECT_EQ(imaged->result->image.pixels, std::string(1, '\x07'));

  auto broken = std::make_shared<Recorder>();
  q.Complete(broken, res, finished,
             [](const RequestResult&) -> StatusOr<Image> { throw std::runtime_error("oom"); });
  ASSERT_TRUE(broken->error.has_value());
  EXPECT_NE(broken->error->message().find("image decoding failed: oom"), std::string::npos);
  EXPECT_EQ(broken->terminal_calls, 1);

  EXPECT_NO_THROW(q.Complete(std::make_shared<Throwing>(), res, finished, nullptr));
  EXPECT_EQ(q.completed(), 2);
  EXPECT_EQ(q.failed(), 2);
}

// Records which thread each callback came on; can hold OnComplete (a slow client) until released.
class ThreadRecorder : public Recorder {
 public:
  explicit ThreadRecorder(bool hold = false, std::chrono::milliseconds delay = {})
      : hold_(hold), delay_(delay) {}
  void OnStep(const StepEvent& e) override {
    {
      std::lock_guard<std::mutex> l(tmu_);
      step_threads_.push_back(std::this_thread::get_id());
    }
    Recorder::OnStep(e);
  }
  void OnComplete(RequestResult r) override {
    {
      std::unique_lock<std::mutex> l(tmu_);
      complete_thread_ = std::this_thread::get_id();
      in_complete_ = true;
      tcv_.notify_all();
      tcv_.wait(l, [&] { return !hold_; });
    }
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
    Recorder::OnComplete(std::move(r));
  }
  bool WaitInComplete() {
    std::unique_lock<std::mutex> l(tmu_);
    return tcv_.wait_for(l, std::chrono::seconds(300), [&] { return in_complete_; });
  }
  void Release() {
    std::lock_guard<std::mutex> l(tmu_);
    hold_ = false;
    tcv_.notify_all();
  }
  std::vector<std::thread::id> step_threads() {
    std::lock_guard<std::mutex> l(tmu_);
    return step_threads_;
  }
  std::thread::id complete_thread() {
    std::lock_guard<std::mutex> l(tmu_);
    return complete_thread_;
  }

 private:
  std::mutex tmu_;
  std::condition_variable tcv_;
  bool hold_;
  std::chrono::milliseconds delay_;
  bool in_complete_ = false;
  std::vector<std::thread::id> step_threads_;
  std::thread::id complete_thread_;
};

EngineOptions DecodeOptions(int decode_thread) {
  EngineOptions o = BundledOptions();
  o.window_policy = "full";  // the same windows whatever the timing: the same images
  o.fixed_step_cost = {0.005, 2e-5, 1e-3};
  o.decode_thread = decode_thread;
  // The batch-invariant forward on CUDA too (graphs are its default there): the same images
  // however the two runs happen to batch their requests.
  o.cuda_graphs = 0;
  return o;
}

TEST(EngineTest, DecodeThreadDrawsTheSameImagesAndCompletesOffTheEngineThread) {
  const auto& methods = PresetNames();
  std::vector<GenerateParams> ps;
  for (int i = 0; i < 6; ++i) ps.push_back(Params(methods[i % methods.size()], i, 9100 + i));
  std::vector<RequestResult> results[2];
  for (const int mode : {0, 1}) {
    auto engine = StartOrDie(DecodeOptions(mode));
    std::vector<std::shared_ptr<ThreadRecorder>> rs;
    for (const auto& p : ps) {
      rs.push_back(std::make_shared<ThreadRecorder>());
      ASSERT_TRUE(engine->Submit(p, rs.back()).ok());
    }
    for (auto& r : rs) {
      ASSERT_TRUE(r->Wait() && r->result.has_value())
          << (r->error ? r->error->ToString() : std::string("no result"));
      results[mode].push_back(*r->result);
      const std::vector<std::thread::id> steps = r->step_threads();
      ASSERT_FALSE(steps.empty());
      const std::thread::id engine_thread = steps[0];
      for (const auto& t : steps) EXPECT_EQ(t, engine_thread);
      if (mode == 1) {
        EXPECT_NE(r->complete_thread(), engine_thread) << "completed on the engine thread";
      } else {
        EXPECT_EQ(r->complete_thread(), engine_thread);
      }
      EXPECT_GE(r->result->stats.decode_seconds, 0);
    }
    bool counted = false;  // counted when the decoding returns, just after OnComplete
    for (int i = 0; i < 3000 && !counted; ++i) {
      counted = engine->Stats().completed == static_cast<int64_t>(ps.size());
      if (!counted) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(counted) << engine->Stats().completed;
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    EXPECT_EQ(results[0][i].tokens, results[1][i].tokens) << i;
    EXPECT_FALSE(results[1][i].image.empty());
    EXPECT_EQ(results[0][i].image.pixels, results[1][i].image.pixels) << i;
  }
}

// Batched decoding (decode_batch): requests that finish in the same step are decoded in one
// call, and each gets its own image, equal within rounding to decoding it alone.
TEST(EngineTest, BatchedDecodeGivesEachRequestItsOwnImageWithinRounding) {
  auto vq = LoadImageModel(DefaultModelsDir(), "fmnist-gpt", {});
  ASSERT_TRUE(vq.ok()) << vq.status().ToString();
  for (const int mode : {0, 1}) {
    EngineOptions o = DecodeOptions(mode);
    o.decode_batch = 8;
    auto engine = StartOrDie(o);
    EXPECT_EQ(engine->decode_batch(), 8);
    std::vector<std::shared_ptr<Recorder>> rs;
    std::vector<GenerateParams> ps;
    for (int i = 0; i < 12; ++i) ps.push_back(Params("ar", i % 10, 9400 + i));
    std::vector<std::shared_ptr<RequestObserver>> obs;
    for (size_t i = 0; i < ps.size(); ++i) {
      rs.push_back(std::make_shared<Recorder>());
      obs.push_back(rs.back());
    }
    ASSERT_TRUE(engine->SubmitGroup(ps, obs).ok());  // AR: they all finish in one step
    std::set<std::string> distinct;
    for (auto& r : rs) {
      ASSERT_TRUE(r->Wait() && r->result.has_value())
          << (r->error ? r->error->ToString() : std::string("no result"));
      auto alone = TokensToImage(*vq->vq, r->result->tokens);
      ASSERT_TRUE(alone.ok());
      const std::string& px = r->result->image.pixels;
      ASSERT_EQ(px.size(), alone->pixels.size());
      int64_t differ = 0;
      for (size_t k = 0; k < px.size(); ++k) {
        const int d = std::abs(static_cast<int>(static_cast<uint8_t>(px[k])) -
                               static_cast<int>(static_cast<uint8_t>(alone->pixels[k])));
        EXPECT_LE(d, 2) << "pixel " << k;
        differ += d > 0;
      }
      EXPECT_LE(differ, static_cast<int64_t>(px.size()) / 100);
      distinct.insert(px);
    }
    EXPECT_EQ(distinct.size(), ps.size());
    EngineStats st;
    for (int i = 0; i < 3000; ++i) {  // counted when the decoding returns, after OnComplete
      st = engine->Stats();
      if (st.batch_decoded == static_cast<int64_t>(ps.size())) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(st.batch_decoded, static_cast<int64_t>(ps.size()));
    EXPECT_EQ(st.decode_batches, 2) << "12 images that finish in one step: 8 and 4; mode " << mode
                                    << ", " << st.batch_decoded << " images";
  }
  // The defaults: one at a time with the batch-invariant forward, 16 with graphs.
  EXPECT_EQ(StartOrDie(DecodeOptions(0))->decode_batch(), 1);
  EngineOptions graphs = DecodeOptions(0);
  graphs.cuda_graphs = 1;
  EXPECT_EQ(StartOrDie(graphs)->decode_batch(), 16);
  EngineOptions bad = DecodeOptions(0);
  bad.decode_batch = 0;
  EXPECT_NE(Engine::Start(bad).status().message().find("decode_batch"), std::string::npos);
}

// A client slow to take its image (OnComplete held) stalls the step loop when images complete
// on the engine thread, and does not with a decode thread: another request gets every step.
TEST(EngineTest, DecodeThreadKeepsStepsGoingWhileAFinishedRequestIsSlow) {
  for (const int mode : {0, 1}) {
    auto engine = StartOrDie(DecodeOptions(mode));
    auto slow = std::make_shared<ThreadRecorder>(/*hold=*/true);
    ASSERT_TRUE(engine->Submit(Params("ar", 1, 9200), slow).ok());
    ASSERT_TRUE(slow->WaitInComplete());
    auto other = std::make_shared<Recorder>();
    ASSERT_TRUE(engine->Submit(Params("ar", 2, 9201), other).ok());
    if (mode == 1) {
      // Every step of the other request runs while the slow one's OnComplete is held.
      bool all = false;
      for (int i = 0; i < 30000 && !all; ++i) {
        all = other->all_decided();
        if (!all) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      EXPECT_TRUE(all) << other->steps() << " steps";
      EXPECT_EQ(other->ended(), 0);  // its completion queues behind the slow one's
    } else {
      // The engine thread is inside the slow OnComplete: nothing else can step.
      std::this_thread::sleep_for(std::chrono::seconds(1));
      EXPECT_EQ(other->steps(), 0u);
    }
    slow->Release();
    ASSERT_TRUE(other->Wait() && other->result.has_value());
    ASSERT_TRUE(slow->Wait() && slow->result.has_value());
  }
}

TEST(EngineTest, ShutdownDeliversEveryImageStillBeingDecoded) {
  auto engine = StartOrDie(DecodeOptions(1));
  std::vector<std::shared_ptr<ThreadRecorder>> rs;
  for (int i = 0; i < 8; ++i) {
    // Slow clients: the decode thread falls behind the steps.
    rs.push_back(std::make_shared<ThreadRecorder>(false, std::chrono::milliseconds(100)));
    ASSERT_TRUE(engine->Submit(Params("ar", i, 9300 + i), rs.back()).ok());
  }
  engine->Shutdown(std::chrono::seconds(300));
  for (auto& r : rs) {  // no waiting: Shutdown has returned
    EXPECT_EQ(r->terminal_calls, 1);
    EXPECT_TRUE(r->result.has_value());
  }
  EXPECT_EQ(engine->Stats().completed, 8);
}

// Holds the engine thread in its first OnStep until released: a wedged engine thread (a hung
// device, a deadlock), as far as the engine can tell.
class StepHolder : public Recorder {
 public:
  void OnStep(const StepEvent& e) override {
    release_.Wait();
    Recorder::OnStep(e);
  }
  void Release() { release_.Open(); }

 private:
  testing::Gate release_;
};

// Engine::Progress's failed steps (the daemon's --engine-failed-steps): counted per model in a
// row, reset by a step that succeeds, with the last failure's message.
TEST(EngineTest, ProgressCountsStepsThatFailInARowUntilOneSucceeds) {
  EngineOptions o = BundledOptions();
  o.fail_steps = std::make_shared<std::atomic<int64_t>>(3);
  auto engine = StartOrDie(o);
  for (int i = 0; i < 3; ++i) {
    auto r = std::make_shared<Recorder>();
    ASSERT_TRUE(engine->Submit(Params("scd-mc", i, 70 + i), r).ok());
    ASSERT_TRUE(r->Wait());
    ASSERT_TRUE(r->error.has_value());
    EXPECT_EQ(r->error->code(), Code::kInternal);
    WaitIdle(*engine);
    const EngineProgress p = engine->Progress();
    EXPECT_EQ(p.failed_steps, i + 1);
    EXPECT_EQ(p.failed_model, "fmnist-gpt");
    EXPECT_NE(p.last_error.find("injected step failure"), std::string::npos) << p.last_error;
  }
  auto ok = std::make_shared<Recorder>();
  ASSERT_TRUE(engine->Submit(Params("scd-mc", 5, 75), ok).ok());
  ASSERT_TRUE(ok->Wait());
  EXPECT_TRUE(ok->result.has_value());
  WaitIdle(*engine);
  EXPECT_EQ(engine->Progress().failed_steps, 0);
  EXPECT_EQ(engine->Stats().failed, 3);
}

// The failure drill (EngineOptions::fail_steps_for_seconds, the daemon's
// --inject-step-failures-seconds): every step fails from the first one for that long, with a
// message that says it was a drill, then steps run again. The warm-up does not start it.
TEST(EngineTest, AFailureDrillFailsEveryStepForItsSecondsThenStepsRunAgain) {
  EngineOptions o = BundledOptions();
  o.fail_steps_for_seconds = 1;
  o.warmup = 1;  // on the CPU too: its steps run before the drill is armed
  o.warmup_methods = {"ar"};
  o.warmup_concurrency = {1};
  auto engine = StartOrDie(o);
  int64_t failed = 0;
  std::optional<RequestResult> result;
  const auto start = Clock::now();
  for (int i = 0; !result.has_value() && Clock::now() - start < std::chrono::seconds(120); ++i) {
    auto r = std::make_shared<Recorder>();
    ASSERT_TRUE(engine->Submit(Params("ar", i % 10, 90 + i), r).ok());
    ASSERT_TRUE(r->Wait());
    if (r->result.has_value()) {
      result = r->result;
      break;
    }
    ASSERT_EQ(r->error->code(), Code::kInternal);
    EXPECT_NE(r->error->message().find("injected step failure (failure drill"), std::string::npos)
        << r->error->message();
    ++failed;
  }
  ASSERT_TRUE(result.has_value());
  EXPECT_GE(failed, 1);  // the first request after the warm-up failed
  // Its steps failed for at least the drill's second: the first success came after it.
  EXPECT_GE(std::chrono::duration<double>(Clock::now() - start).count(), 1.0);
  WaitIdle(*engine);
  EXPECT_EQ(engine->Progress().failed_steps, 0);
  auto after = std::make_shared<Recorder>();
  ASSERT_TRUE(engine->Submit(Params("scd-mc", 3, 99), after).ok());
  ASSERT_TRUE(after->Wait());
  EXPECT_TRUE(after->result.has_value());
}

// Engine::Progress, which the daemon's liveness reads (--engine-stall-seconds): the seconds a
// thread's work has waited on it count only while it has work, and name the thread that holds it
// up.
TEST(EngineTest, ProgressCountsOnlyWorkThatWaitsAndNamesTheThreadHoldingItUp) {
  auto engine = StartOrDie(DecodeOptions(1));
  EngineProgress p = engine->Progress();
  EXPECT_EQ(p.engine_seconds, 0.0);  // idle
  EXPECT_EQ(p.decoder_seconds, 0.0);
  // An engine idle for a while is handed a request: the wait counts from its arrival, not from
  // the last round's end (a sanity check: the engine thread usually wakes within microseconds,
  // and its round then restarts the count anyway).
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // idle time not to count
  auto quick = std::make_shared<Recorder>();
  ASSERT_TRUE(engine->Submit(Params("ar", 1, 5), quick).ok());
  EXPECT_LT(engine->Progress().engine_seconds, 1.0);
  ASSERT_TRUE(quick->Wait());
  ASSERT_TRUE(testing::WaitUntil([&] { return engine->Progress().seconds() == 0.0; },
                                 std::chrono::seconds(120)));

  // The engine thread held inside a step: its request's wait grows, the decoder's does not.
  auto held = std::make_shared<StepHolder>();
  ASSERT_TRUE(engine->Submit(Params("ar", 2, 6), held).ok());
  ASSERT_TRUE(testing::WaitUntil([&] { return engine->Progress().engine_seconds > 0.5; },
                                 std::chrono::seconds(120)));
  p = engine->Progress();
  EXPECT_STREQ(p.thread(), "engine");
  EXPECT_EQ(p.decoder_seconds, 0.0);
  // A second arrival while the thread is held does not restart the count (it is not asleep).
  auto behind = std::make_shared<Recorder>();
  ASSERT_TRUE(engine->Submit(Params("ar", 3, 7), behind).ok());
  EXPECT_GE(engine->Progress().engine_seconds, p.engine_seconds);
  held->Release();
  ASSERT_TRUE(held->Wait());
  ASSERT_TRUE(behind->Wait());
  EXPECT_TRUE(held->result.has_value());
  ASSERT_TRUE(testing::WaitUntil([&] { return engine->Progress().seconds() == 0.0; },
                                 std::chrono::seconds(120)));

  // The decode thread held in a client's OnComplete: the engine thread has nothing left, the
  // finished image waits on the decoder.
  auto decoding = std::make_shared<ThreadRecorder>(/*hold=*/true);
  ASSERT_TRUE(engine->Submit(Params("ar", 4, 8), decoding).ok());
  ASSERT_TRUE(decoding->WaitInComplete());
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        const EngineProgress q = engine->Progress();
        return q.engine_seconds == 0.0 && q.decoder_seconds > 0.5;
      },
      std::chrono::seconds(120)));
  EXPECT_STREQ(engine->Progress().thread(), "decoder");
  decoding->Release();
  ASSERT_TRUE(decoding->Wait());
  EXPECT_TRUE(testing::WaitUntil([&] { return engine->Progress().seconds() == 0.0; },
                                 std::chrono::seconds(120)));
}

}  // namespace
}  // namespace imagegen
