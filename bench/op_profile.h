// IMAGEGEN_OP_PROFILE=1: a per-op wall-clock profile of a bench program, printed to stderr at
// exit. Every ATen op is timed through a global RecordFunction callback (inclusive time, the
// host's view: an op that waits on the device includes the wait). Per thread it also sums the
// outermost ops, so that the time a thread spends outside ATen (the engine's own host code)
// shows as its busy time minus that sum. A diagnostic for the GPU sessions (docs/gpu.md): with
// a few device minutes and no Nsight Systems, it says which ops or which host code a step
// spends its time in.
#pragma once

#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace imagegen {

class OpProfile {
 public:
  static void InstallIfRequested() {
    const char* e = std::getenv("IMAGEGEN_OP_PROFILE");
    if (e == nullptr || std::string(e) != "1") return;
    static OpProfile* p = new OpProfile();  // lives until exit; printed by atexit
    Get() = p;
    at::addGlobalCallback(at::RecordFunctionCallback(&OnStart, &OnEnd)
                              .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
    std::atexit([] { Get()->Print(); });
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Ctx : at::ObserverContext {
    Clock::time_point t0;
    bool outer = false;
  };
  struct Stat {
    int64_t calls = 0;
    double seconds = 0;
  };
  struct ThreadStat {
    double outer_seconds = 0;
    int64_t outer_calls = 0;
    Clock::time_point first, last;
  };

  static OpProfile*& Get() {
    static OpProfile* p = nullptr;
    return p;
  }
  static int& Depth() {
    thread_local int d = 0;
    return d;
  }

  static std::unique_ptr<at::ObserverContext> OnStart(const at::RecordFunction&) {
    auto c = std::make_unique<Ctx>();
    c->outer = Depth()++ == 0;
    c->t0 = Clock::now();
    return c;
  }
  static void OnEnd(const at::RecordFunction& fn, at::ObserverContext* ctx) {
    --Depth();
    auto* c = static_cast<Ctx*>(ctx);
    const auto t1 = Clock::now();
    const double dt = std::chrono::duration<double>(t1 - c->t0).count();
    OpProfile* p = Get();
    std::lock_guard<std::mutex> lock(p->mu_);
    Stat& s = p->ops_[fn.name()];
    s.calls += 1;
    s.seconds += dt;
    if (c->outer) {
      ThreadStat& t = p->threads_[std::this_thread::get_id()];
      if (t.outer_calls == 0) t.first = c->t0;
      t.last = t1;
      t.outer_calls += 1;
      t.outer_seconds += dt;
    }
  }

  void Print() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<std::string, Stat>> v(ops_.begin(), ops_.end());
    std::sort(v.begin(), v.end(),
              [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    std::fprintf(stderr, "\nop profile (IMAGEGEN_OP_PROFILE=1): inclusive host seconds per op\n");
    std::fprintf(stderr, "%-44s %10s %10s %10s\n", "op", "calls", "seconds", "us/call");
    for (size_t i = 0; i < v.size() && i < 30; ++i) {
      std::fprintf(stderr, "%-44s %10lld %10.3f %10.1f\n", v[i].first.c_str(),
                   static_cast<long long>(v[i].second.calls), v[i].second.seconds,
                   1e6 * v[i].second.seconds / static_cast<double>(v[i].second.calls));
    }
    std::fprintf(stderr, "per thread: outermost ops (calls, seconds) within first..last op\n");
    for (const auto& [id, t] : threads_) {
      if (t.outer_calls < 100) continue;
      std::fprintf(stderr, "  thread: %lld outer ops, %.3f s in ops, %.3f s first..last\n",
                   static_cast<long long>(t.outer_calls), t.outer_seconds,
                   std::chrono::duration<double>(t.last - t.first).count());
    }
  }

  std::mutex mu_;
  std::map<std::string, Stat> ops_;
  std::unordered_map<std::thread::id, ThreadStat> threads_;
};

}  // namespace imagegen
