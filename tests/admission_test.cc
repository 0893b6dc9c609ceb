// Admission order and a full queue's choice (engine/scheduler/wait_queue.h): priority first,
// then, with the fair admission, the client with the fewest requests running, then age; a full
// queue gives up the newest request of the lowest priority's most-queued client to an arrival
// that ranks before it. The pure parts (Displace, WaitQueue::Next) directly, then the engine on
// the enumerable toy, where a gate (an observer that holds the engine thread inside a step
// event) lets the test queue requests while nothing is admitted, so the order is exact.
// Each engine test runs the same load under "fifo" too, where the fair order must not appear
// (the check's power).
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/scheduler/engine.h"
#include "engine/scheduler/wait_queue.h"
#include "tests/spec_toy.h"

namespace imagegen {
namespace {

using namespace imagegen::testing;  // NOLINT: the toy's constants and types

std::unique_ptr<Job> MakeJob(int64_t id, int32_t priority, const std::string& client,
                             int64_t group = -1) {
  auto j = std::make_unique<Job>();
  j->id = id;
  j->group = group < 0 ? id : group;
  j->params.priority = priority;
  j->params.client = client;
  return j;
}

TEST(WaitQueueTest, NextTakesPriorityThenTheLeastServedClientThenTheOldest) {
  WaitQueue fair(true), fifo(false);
  for (WaitQueue* q : {&fair, &fifo}) {
    q->Push(MakeJob(1, 0, "a"));
    q->Push(MakeJob(2, 0, "a"));
    q->Push(MakeJob(3, 0, "b"));
    q->Push(MakeJob(4, 5, "c"));
  }
  WaitQueue::Running running;
  running.per_client = {{{"", "a"}, 2}, {{"", "b"}, 0}};
  EXPECT_EQ(fair.Next(running)->id, 3);  // b has nothing running
  EXPECT_EQ(fifo.Next(running)->id, 1);  // the oldest
  running.per_client[{"", "b"}] = 2;
  EXPECT_EQ(fair.Next(running)->id, 1);  // equal shares: the oldest
  running.per_client[{"", "b"}] = 3;
  EXPECT_EQ(fair.Next(running)->id, 1);
  // A lower priority value goes first, whatever its client runs.
  fair.Push(MakeJob(5, -1, "a"));
  running.per_client[{"", "a"}] = 50;
  EXPECT_EQ(fair.Next(running)->id, 5);
  EXPECT_EQ(fair.Take(fair.Next(running))->id, 5);
  EXPECT_EQ(fair.TakeNewest({0, "a"})->id, 2);
  EXPECT_EQ(fair.TakeNewest({0, "z"}), nullptr);
  const WaitCensus c = fair.Census();
  EXPECT_EQ(c.at({0, "a"}), 1);
  EXPECT_EQ(c.at({0, "b"}), 1);
  EXPECT_EQ(c.at({5, "c"}), 1);
  EXPECT_EQ(fair.TakeAll().size(), 3u);
  EXPECT_TRUE(fair.empty());
  EXPECT_EQ(fair.Next(running), nullptr);
}

// The rest of a group whose first request runs follows it, ahead of other clients' requests.
TEST(WaitQueueTest, AGroupStaysTogether) {
  WaitQueue q(true);
  q.Push(MakeJob(11, 0, "a", 10));  // the group's request 10 runs
  q.Push(MakeJob(12, 0, "b"));
  WaitQueue::Running running;
  running.per_client = {{{"", "a"}, 1}};
  EXPECT_EQ(q.Next(running)->id, 12);  // without the group: a runs one, b none
  running.groups = {10};
  EXPECT_EQ(q.Next(running)->id, 11);
}

// Tenants (API keys) first, then clients within a tenant: a tenant's many clients count as one
// against another tenant.
TEST(WaitQueueTest, NextServesTheLeastServedTenantThenItsLeastServedClient) {
  WaitQueue q(true);
  auto job = [](int64_t id, const std::string& client, const std::string& tenant) {
    auto j = MakeJob(id, 0, client);
    j->params.tenant = tenant;
    return j;
  };
  q.Push(job(1, "u1", "A"));  // u1 runs nothing, but its tenant A runs three
  q.Push(job(2, "u2", "A"));
  q.Push(job(3, "b", "B"));  // b runs one, the only one of B's
  WaitQueue::Running running;
  running.per_tenant = {{"A", 3}, {"B", 1}};
  running.per_client = {{{"A", "u0"}, 1}, {{"A", "u2"}, 2}, {{"B", "b"}, 1}};
  EXPECT_EQ(q.Next(running)->id, 3);
  running.per_tenant["B"] = 3;  // equal tenants: A's client with fewer running (u1)
  EXPECT_EQ(q.Next(running)->id, 1);
  running.per_client[{"A", "u1"}] = 3;  // equal tenants: u1 3, u2 2, b 1 running
  EXPECT_EQ(q.Next(running)->id, 3);
  running.per_tenant["B"] = 4;  // B runs more: A's u2 before its u1
  EXPECT_EQ(q.Next(running)->id, 2);
  // A client name means nothing across tenants: b of A is not b of B.
  q.Push(job(4, "b", "A"));
  running.per_client[{"A", "b"}] = 0;
  EXPECT_EQ(q.Next(running)->id, 4);
}

TEST(WaitQueueTest, DisplaceWeighsTenantsBeforeClients) {
  // Tenant A's six clients have one request waiting each, tenant B's one client two. Between
  // tenants B's arrival takes one of A's places (6 >= 2 + 2); counted as clients (no tenants)
  // nobody has two more than b and the arrival is refused.
  WaitCensus by_tenant = {{{0, "b", "B"}, 2}};
  WaitCensus flat = {{{0, "b"}, 2}};
  for (int i = 0; i < 6; ++i) {
    by_tenant[{0, "u" + std::to_string(i), "A"}] = 1;
    flat[{0, "u" + std::to_string(i)}] = 1;
  }
  auto d = Displace(by_tenant, {0, "b", "B"}, 1, 0, true);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ((*d)[0].victim.tenant, "A");
  EXPECT_EQ((*d)[0].reason, ShedReason::kFairShare);
  EXPECT_FALSE(Displace(flat, {0, "b"}, 1, 0, true).has_value());
  // A: 6 -> 5 (B 3), 5 -> 4 (B 4); then 4 vs 4 stops.
  EXPECT_EQ(Displace(by_tenant, {0, "b", "B"}, 2, 0, true)->size(), 2u);
  EXPECT_FALSE(Displace(by_tenant, {0, "b", "B"}, 3, 0, true).has_value());
  // Within its own tenant an arrival weighs clients: u9 of A displaces A's client with the
  // most waiting when it has two more than u9, never another tenant's.
  EXPECT_FALSE(Displace(by_tenant, {0, "u9", "A"}, 1, 0, true).has_value());
  by_tenant[{0, "u3", "A"}] = 4;
  d = Displace(by_tenant, {0, "u9", "A"}, 1, 0, true);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ((*d)[0].victim, (WaitClass{0, "u3", "A"}));
  // A lower priority is given up first whatever its tenant; of it, the most-queued tenant's
  // most-queued client.
  by_tenant[{2, "x", "C"}] = 1;
  by_tenant[{2, "y", "D"}] = 1;
  by_tenant[{2, "z", "D"}] = 2;
  d = Displace(by_tenant, {0, "b", "B"}, 1, 0, true);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ((*d)[0].victim, (WaitClass{2, "z", "D"}));
  EXPECT_EQ((*d)[0].reason, ShedReason::kPriority);
}

TEST(WaitQueueTest, DisplaceGivesUpLowerPrioritiesThenTheMostQueuedClient) {
  const WaitCensus census = {{{0, "a"}, 6}, {{0, "b"}, 1}, {{3, "c"}, 2}};
  // Priority first: c's two (priority 3) go before anything of priority 0.
  auto d = Displace(census, {0, "b"}, 3, 0, /*fair=*/true);
  ASSERT_TRUE(d.has_value());
  ASSERT_EQ(d->size(), 3u);
  EXPECT_EQ((*d)[0].victim, (WaitClass{3, "c"}));
  EXPECT_EQ((*d)[0].reason, ShedReason::kPriority);
  EXPECT_EQ((*d)[1].victim, (WaitClass{3, "c"}));
  EXPECT_EQ((*d)[2].victim, (WaitClass{0, "a"}));
  EXPECT_EQ((*d)[2].reason, ShedReason::kFairShare);
  // Within a priority: a gives up while it has at least two more waiting than b would have.
  // b has 1: a's 6 -> 5 (b 2), 5 -> 4 (b 3), then 4 vs 3 stops.
  d = Displace({{{0, "a"}, 6}, {{0, "b"}, 1}}, {0, "b"}, 3, 0, true);
  EXPECT_FALSE(d.has_value());
  d = Displace({{{0, "a"}, 6}, {{0, "b"}, 1}}, {0, "b"}, 2, 0, true);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->size(), 2u);
  // The arrivals that fit count first: with room for one, b has 2 before it displaces.
  d = Displace({{{0, "a"}, 6}, {{0, "b"}, 1}}, {0, "b"}, 3, 1, true);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->size(), 2u);
  d = Displace({{{0, "a"}, 6}, {{0, "b"}, 1}}, {0, "b"}, 4, 1, true);
  EXPECT_FALSE(d.has_value());
  // A client never displaces itself, a higher priority value never displaces, and without
  // the fair admission only priority does.
  EXPECT_FALSE(Displace({{{0, "a"}, 6}}, {0, "a"}, 1, 0, true).has_value());
  EXPECT_FALSE(Displace({{{0, "a"}, 6}}, {1, "b"}, 1, 0, true).has_value());
  EXPECT_FALSE(Displace({{{0, "a"}, 6}}, {0, "b"}, 1, 0, false).has_value());
  d = Displace({{{0, "a"}, 6}}, {-1, "a"}, 1, 0, false);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ((*d)[0].reason, ShedReason::kPriority);
  // Classes already emptied (pending sheds) are skipped.
  EXPECT_FALSE(Displace({{{0, "a"}, 0}, {{0, "b"}, -1}}, {-5, "c"}, 1, 0, true).has_value());
}

// Holds the engine thread inside the gate request's step events from its second on (after the
// round that admitted it has ended, so the engine's counts no longer hold it as queued), each
// until released, all once opened.
class Gate : public RequestObserver {
 public:
  void OnStep(const StepEvent& e) override {
    if (e.step < 2) return;
    std::unique_lock<std::mutex> l(mu_);
    at_ = e.step;
    cv_.notify_all();
    cv_.wait(l, [&] { return open_ || released_ >= e.step; });
  }
  void OnComplete(RequestResult) override {}
  void OnError(const Status&) override {}
  // Whether the engine thread is held in step `step` (false after 120 s).
  bool WaitAt(int64_t step) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, std::chrono::seconds(120), [&] { return at_ >= step; });
  }
  void Release(int64_t step) {
    std::lock_guard<std::mutex> l(mu_);
    released_ = step;
    cv_.notify_all();
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t at_ = 0, released_ = 0;
  bool open_ = false;
};

// Records the order requests take their first step in and how each ends.
struct Log {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> started;
  std::map<std::string, Status> ended;
};

class Named : public RequestObserver {
 public:
  Named(Log* log, std::string name) : log_(log), name_(std::move(name)) {}
  void OnStep(const StepEvent& e) override {
    if (e.step != 1) return;
    std::lock_guard<std::mutex> l(log_->mu);
    log_->started.push_back(name_);
  }
  void OnComplete(RequestResult) override { End(Status()); }
  void OnError(const Status& s) override { End(s); }

 private:
  void End(const Status& s) {
    std::lock_guard<std::mutex> l(log_->mu);
    log_->ended[name_] = s;
    log_->cv.notify_all();
  }
  Log* log_;
  std::string name_;
};

struct Gated {
  Log log;
  std::shared_ptr<Gate> gate = std::make_shared<Gate>();
  std::unique_ptr<Engine> engine;  // destroyed first (its observers use the log)
  ~Gated() {
    gate->Open();  // a test that failed before opening it must not hang the shutdown
    engine.reset();
  }
};

// An engine with two KV slots (one request without guidance each) whose thread is held by the
// gate request (client "gate", one slot) once Start returns.
std::unique_ptr<Gated> StartGated(const std::string& admission, int64_t max_queue,
                                  bool preemption = true, int64_t slots = 2,
                                  int32_t gate_priority = 0) {
  auto g = std::make_unique<Gated>();
  EngineOptions o;
  o.models_dir = TheToy().dir;
  o.models = {"toy-gpt"};
  o.max_slots = slots;
  o.max_queue = max_queue;
  o.admission = admission;
  o.preemption = preemption;
  auto started = Engine::Start(o);
  if (!started.ok()) throw std::runtime_error(started.status().ToString());
  g->engine = std::move(*started);
  GenerateParams p;
  p.class_id = 0;
  p.cfg_scale = 1.0;
  p.client = "gate";
  p.priority = gate_priority;
  if (!g->engine->Submit(p, g->gate).ok()) throw std::runtime_error("gate refused");
  if (!g->gate->WaitAt(2)) throw std::runtime_error("the gate request did not reach step 2");
  return g;
}

GenerateParams OneSlot(const std::string& client, int32_t priority,
                       const std::string& tenant = "") {
  GenerateParams p;
  p.class_id = 1;
  p.cfg_scale = 1.0;  // one KV slot
  p.seed = 7;
  p.client = client;
  p.priority = priority;
  p.tenant = tenant;
  return p;
}

Status Submit(Gated& g, const std::string& name, const std::string& client, int32_t priority,
              const std::string& tenant = "") {
  auto id =
      g.engine->Submit(OneSlot(client, priority, tenant), std::make_shared<Named>(&g.log, name));
  return id.ok() ? Status() : id.status();
}

void WaitEnded(Gated& g, size_t n) {
  std::unique_lock<std::mutex> l(g.log.mu);
  ASSERT_TRUE(
      g.log.cv.wait_for(l, std::chrono::seconds(120), [&] { return g.log.ended.size() >= n; }))
      << g.log.ended.size() << " of " << n << " requests ended";
}

int64_t Position(const std::vector<std::string>& order, const std::string& name) {
  auto it = std::find(order.begin(), order.end(), name);
  return it == order.end() ? -1 : it - order.begin();
}

// Client a queues ten requests, then client b one: fair admission serves b as soon as the
// first slot frees (a already runs one), FIFO only after all ten of a's.
TEST(AdmissionTest, ALateClientIsNotHeldBehindAnotherClientsBurst) {
  for (const std::string admission : {"fair", "fifo"}) {
    SCOPED_TRACE(admission);
    auto g = StartGated(admission, 64);
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(Submit(*g, "a" + std::to_string(i), "a", 0).ok());
    ASSERT_TRUE(Submit(*g, "b0", "b", 0).ok());
    g->gate->Open();
    WaitEnded(*g, 11);
    const std::vector<std::string> order = g->log.started;
    ASSERT_EQ(order.size(), 11u);
    EXPECT_EQ(order[0], "a0");  // equal shares (nothing running): the oldest
    if (admission == "fair") {
      EXPECT_EQ(Position(order, "b0"), 1);
    } else {
      EXPECT_EQ(Position(order, "b0"), 10);
    }
    // Within a client, its own requests in arrival order.
    std::vector<std::string> as;
    for (const auto& n : order) {
      if (n[0] == 'a') as.push_back(n);
    }
    for (int i = 0; i < 10; ++i) EXPECT_EQ(as[static_cast<size_t>(i)], "a" + std::to_string(i));
    g->engine->Shutdown(std::chrono::seconds(10));
  }
}

// Tenant A sends six requests from six clients (one user each), then tenant B one: B's is
// admitted as soon as a slot frees, since A runs one and B none. Without tenants (the power
// control: the same clients, no API keys) all seven clients run nothing when a slot frees,
// and B's request waits for A's six as the newest.
TEST(AdmissionTest, ATenantsManyClientsCountAsOneAgainstAnotherTenant) {
  for (const bool tenants : {true, false}) {
    SCOPED_TRACE(tenants ? "tenants" : "no tenants");
    auto g = StartGated("fair", 64);
    for (int i = 0; i < 6; ++i) {
      const std::string u = "u" + std::to_string(i);
      ASSERT_TRUE(Submit(*g, u, u, 0, tenants ? "A" : "").ok());
    }
    ASSERT_TRUE(Submit(*g, "b0", "b", 0, tenants ? "B" : "").ok());
    g->gate->Open();
    WaitEnded(*g, 7);
    const std::vector<std::string> order = g->log.started;
    ASSERT_EQ(order.size(), 7u);
    EXPECT_EQ(order[0], "u0");
    EXPECT_EQ(Position(order, "b0"), tenants ? 1 : 6);
    g->engine->Shutdown(std::chrono::seconds(10));
  }
}

// A client's n images (one SubmitGroup) are admitted back to back even under fair share, so
// that they share a prefill: b's request, queued after a's group of three, comes fourth.
TEST(AdmissionTest, TheImagesOfOneCallStayTogether) {
  auto g = StartGated("fair", 64);
  std::vector<GenerateParams> params(3, OneSlot("a", 0));
  std::vector<std::shared_ptr<RequestObserver>> obs;
  for (int i = 0; i < 3; ++i)
    obs.push_back(std::make_shared<Named>(&g->log, "a" + std::to_string(i)));
  ASSERT_TRUE(g->engine->SubmitGroup(params, obs).ok());
  ASSERT_TRUE(Submit(*g, "b0", "b", 0).ok());
  g->gate->Open();
  WaitEnded(*g, 4);
  EXPECT_EQ(g->log.started, (std::vector<std::string>{"a0", "a1", "a2", "b0"}));
  g->engine->Shutdown(std::chrono::seconds(10));
}

// Submit weighs an arrival against the queue as the last round ended it; a request admitted in
// the round in progress has made room since, and then nobody gives way. Queue of 2: x0 and x1
// arrive, x0 is admitted in the round the gate then holds; y0 arrives and counts 2 waiting, so
// x1 is chosen to give way, but when the engine comes to it x1 and y0 fit: both are drawn.
TEST(AdmissionTest, NoRequestGivesWayWhenAdmissionsMadeRoom) {
  auto g = StartGated("fair", 2);
  ASSERT_TRUE(Submit(*g, "x0", "x", 0).ok());
  ASSERT_TRUE(Submit(*g, "x1", "x", 0).ok());
  g->gate->Release(2);
  ASSERT_TRUE(g->gate->WaitAt(3));  // the round that admitted x0
  ASSERT_TRUE(Submit(*g, "y0", "y", 0).ok());
  g->gate->Open();
  WaitEnded(*g, 3);
  for (const char* n : {"x0", "x1", "y0"}) {
    std::lock_guard<std::mutex> l(g->log.mu);
    EXPECT_TRUE(g->log.ended.at(n).ok()) << n << ": " << g->log.ended.at(n).ToString();
  }
  g->engine->Shutdown(std::chrono::seconds(10));
  EXPECT_EQ(g->engine->Stats().shed, 0);
}

// Priority before everything: a request of priority -1 queued last is admitted first, and one
// of priority 1 last, in both admissions.
TEST(AdmissionTest, LowerPriorityValuesAreAdmittedFirst) {
  for (const std::string admission : {"fair", "fifo"}) {
    SCOPED_TRACE(admission);
    auto g = StartGated(admission, 64);
    ASSERT_TRUE(Submit(*g, "late", "x", 1).ok());
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(Submit(*g, "n" + std::to_string(i), "x", 0).ok());
    ASSERT_TRUE(Submit(*g, "urgent", "y", -1).ok());
    g->gate->Open();
    WaitEnded(*g, 6);
    const std::vector<std::string> order = g->log.started;
    ASSERT_EQ(order.size(), 6u);
    EXPECT_EQ(order.front(), "urgent");
    EXPECT_EQ(order.back(), "late");
    g->engine->Shutdown(std::chrono::seconds(10));
  }
}

// Every step event and result of the requests it observes, in the order the engine sent them.
struct Trace {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> steps;  // "name:step"
  std::map<std::string, RequestResult> done;
  std::map<std::string, Status> failed;
};

class Traced : public RequestObserver {
 public:
  Traced(Trace* t, std::string name) : t_(t), name_(std::move(name)) {}
  void OnStep(const StepEvent& e) override {
    std::lock_guard<std::mutex> l(t_->mu);
    t_->steps.push_back(name_ + ":" + std::to_string(e.step));
  }
  void OnComplete(RequestResult r) override {
    std::lock_guard<std::mutex> l(t_->mu);
    t_->done[name_] = std::move(r);
    t_->cv.notify_all();
  }
  void OnError(const Status& s) override {
    std::lock_guard<std::mutex> l(t_->mu);
    t_->failed[name_] = s;
    t_->cv.notify_all();
  }

 private:
  Trace* t_;
  std::string name_;
};

// Both KV slots taken (the gate and a request of priority 5 that has taken one step), a
// request of priority -1 arrives: with preemption the priority-5 request gives up its slot,
// the urgent one takes its first step before the other's second, and the preempted one later
// recomputes its entries and completes its image. Without preemption (the check's power) the
// priority-5 request keeps its slot and its second step comes first.
TEST(AdmissionTest, AMoreUrgentRequestPreemptsALessUrgentOneThatThenCompletes) {
  for (const bool preemption : {true, false}) {
    SCOPED_TRACE(preemption ? "preemption" : "no preemption");
    auto g = StartGated("fair", 64, preemption);
    Trace trace;
    auto submit = [&](const std::string& name, int32_t priority) {
      ASSERT_TRUE(
          g->engine->Submit(OneSlot(name, priority), std::make_shared<Traced>(&trace, name)).ok());
    };
    submit("low", 5);
    g->gate->Release(2);
    ASSERT_TRUE(g->gate->WaitAt(3));  // the round that admitted low has stepped it once
    submit("urgent", -1);
    g->gate->Open();
    {
      std::unique_lock<std::mutex> l(trace.mu);
      ASSERT_TRUE(trace.cv.wait_for(l, std::chrono::seconds(120),
                                    [&] { return trace.done.size() + trace.failed.size() >= 2; }));
      ASSERT_TRUE(trace.failed.empty()) << trace.failed.begin()->second.ToString();
      const auto pos = [&](const std::string& s) {
        return std::find(trace.steps.begin(), trace.steps.end(), s) - trace.steps.begin();
      };
      ASSERT_EQ(pos("low:1"), 0);
      if (preemption) {
        EXPECT_LT(pos("urgent:1"), pos("low:2"));
      } else {
        EXPECT_LT(pos("low:2"), pos("urgent:1"));
      }
      const RequestResult& low = trace.done.at("low");
      EXPECT_EQ(low.tokens.size(), static_cast<size_t>(kN));
      EXPECT_EQ(low.stats.counters.tokens, kN);
      EXPECT_EQ(low.stats.preemptions, preemption ? 1 : 0);
      EXPECT_EQ(trace.done.at("urgent").stats.preemptions, 0);
      if (preemption) {
        EXPECT_GE(low.stats.prefill_forwards, 1);  // it recomputed its entries
      }
    }
    g->engine->Shutdown(std::chrono::seconds(10));
    const EngineStats st = g->engine->Stats();
    EXPECT_EQ(st.preempted, preemption ? 1 : 0);
    EXPECT_EQ(st.models[0].slots_used, 0);
  }
}

// Only the preemptions the arrival needs: four slots held by the gate (priority -5, one slot),
// v2 (priority 5, guided: two slots) and v1 (priority 5, one slot, newer). An arrival of
// priority 0 with guidance needs two: v1 (the newest) is chosen first, then v2, after which v1
// is not needed and keeps running. Suspending both would cost v1 its entries for nothing.
TEST(AdmissionTest, PreemptionSparesTheVictimsTheArrivalFitsWithout) {
  auto g = StartGated("fair", 64, true, 4, -5);
  Trace trace;
  auto submit = [&](const std::string& name, double cfg, int32_t priority) {
    GenerateParams p = OneSlot(name, priority);
    p.cfg_scale = cfg;
    return g->engine->Submit(p, std::make_shared<Traced>(&trace, name)).status();
  };
  ASSERT_TRUE(submit("v2", 1.5, 5).ok());
  ASSERT_TRUE(submit("v1", 1.0, 5).ok());
  g->gate->Release(2);
  ASSERT_TRUE(g->gate->WaitAt(3));  // both admitted and stepped once: every slot is held
  ASSERT_TRUE(submit("u", 1.5, 0).ok());
  g->gate->Open();
  std::unique_lock<std::mutex> l(trace.mu);
  ASSERT_TRUE(trace.cv.wait_for(l, std::chrono::seconds(120),
                                [&] { return trace.done.size() + trace.failed.size() >= 3; }));
  ASSERT_TRUE(trace.failed.empty()) << trace.failed.begin()->second.ToString();
  EXPECT_EQ(trace.done.at("v2").stats.preemptions, 1);
  EXPECT_EQ(trace.done.at("v1").stats.preemptions, 0);
  l.unlock();
  g->engine->Shutdown(std::chrono::seconds(10));
  EXPECT_EQ(g->engine->Stats().preempted, 1);
}

// A preempted request waits again and can be given up like any waiting request (the scheduler
// then drops its suspended state: ModelScheduler::Discard): queue of 1; low (priority 5) runs,
// urgent1 (-1) preempts it, then urgent2 (-1) arrives at the full queue and takes low's place
// (RESOURCE_EXHAUSTED for low); urgent2 then preempts the gate (priority 0). Every slot is free at
// the end.
TEST(AdmissionTest, APreemptedRequestCanBeGivenUpInAFullQueue) {
  auto g = StartGated("fair", 1);
  Trace trace;
  auto submit = [&](const std::string& name, int32_t priority) {
    return g->engine->Submit(OneSlot(name, priority), std::make_shared<Traced>(&trace, name))
        .status();
  };
  ASSERT_TRUE(submit("low", 5).ok());
  g->gate->Release(2);
  ASSERT_TRUE(g->gate->WaitAt(3));
  ASSERT_TRUE(submit("urgent1", -1).ok());
  g->gate->Release(3);
  ASSERT_TRUE(g->gate->WaitAt(4));  // the round that preempted low
  g->gate->Release(4);
  ASSERT_TRUE(g->gate->WaitAt(5));  // and the next: the engine's counts show low waiting
  ASSERT_TRUE(submit("urgent2", -1).ok());
  g->gate->Open();
  std::unique_lock<std::mutex> l(trace.mu);
  ASSERT_TRUE(trace.cv.wait_for(l, std::chrono::seconds(120),
                                [&] { return trace.done.size() + trace.failed.size() >= 3; }));
  ASSERT_EQ(trace.failed.count("low"), 1u);
  EXPECT_EQ(trace.failed.at("low").code(), Code::kResourceExhausted)
      << trace.failed.at("low").ToString();
  EXPECT_EQ(trace.done.count("urgent1"), 1u);
  EXPECT_EQ(trace.done.count("urgent2"), 1u);
  l.unlock();
  g->engine->Shutdown(std::chrono::seconds(10));
  const EngineStats st = g->engine->Stats();
  EXPECT_EQ(st.preempted, 2);
  EXPECT_EQ(st.shed, 1);
  EXPECT_EQ(st.models[0].slots_used, 0);
}

// A queue of 4, filled by client a: a's fifth is refused; client b's first two arrivals each
// take the place of a's newest waiting request (which ends RESOURCE_EXHAUSTED, saying why),
// b's third is refused (2 each); an arrival of priority -1 takes a place whatever its client,
// one of priority 1 never. FIFO admission gives up places to priority only.
TEST(AdmissionTest, AFullQueueGivesUpTheMostQueuedClientsNewestRequest) {
  for (const std::string admission : {"fair", "fifo"}) {
    SCOPED_TRACE(admission);
    const bool fair = admission == "fair";
    auto g = StartGated(admission, 4);
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(Submit(*g, "a" + std::to_string(i), "a", 0).ok());
    Status st = Submit(*g, "a4", "a", 0);
    EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.ToString();
    EXPECT_EQ(Submit(*g, "b0", "b", 0).ok(), fair);
    EXPECT_EQ(Submit(*g, "b1", "b", 0).ok(), fair);
    EXPECT_EQ(Submit(*g, "b2", "b", 0).code(), Code::kResourceExhausted);
    EXPECT_TRUE(Submit(*g, "c0", "c", -1).ok());
    EXPECT_EQ(Submit(*g, "d0", "d", 1).code(), Code::kResourceExhausted);
    EngineStats s = g->engine->Stats();
    EXPECT_EQ(s.models[0].queued, 4);  // the places given up count as gone at once
    g->gate->Open();
    const size_t accepted = fair ? 7 : 5;  // a0-a3, (b0, b1), c0
    WaitEnded(*g, accepted);
    std::map<std::string, Status> ended;
    {
      std::lock_guard<std::mutex> l(g->log.mu);
      ended = g->log.ended;
    }
    ASSERT_EQ(ended.size(), accepted);
    int shed = 0;
    for (const auto& [name, status] : ended) {
      if (status.ok()) continue;
      ++shed;
      EXPECT_EQ(status.code(), Code::kResourceExhausted) << name;
      EXPECT_EQ(name[0], 'a') << name << " " << status.ToString();
      const bool by_priority = status.message().find("higher priority") != std::string::npos;
      const bool by_share = status.message().find("fair share") != std::string::npos;
      EXPECT_TRUE(by_priority || by_share) << status.ToString();
    }
    if (fair) {
      // a3 and a2 gave up their places to b0 and b1, one more a (or b) to c0.
      EXPECT_FALSE(ended.at("a3").ok());
      EXPECT_FALSE(ended.at("a2").ok());
      EXPECT_TRUE(ended.at("a0").ok());
      EXPECT_TRUE(ended.at("b0").ok() || ended.at("b1").ok());
    } else {
      EXPECT_FALSE(ended.at("a3").ok());  // c0's place
      EXPECT_TRUE(ended.at("a2").ok());
    }
    EXPECT_TRUE(ended.at("c0").ok());
    EXPECT_EQ(shed, fair ? 3 : 1);
    g->engine->Shutdown(std::chrono::seconds(10));
    s = g->engine->Stats();
    EXPECT_EQ(s.shed, shed);
    EXPECT_EQ(s.rejected, fair ? 3 : 5);  // a4, b2, d0; and b0, b1 without fairness
    EXPECT_EQ(s.completed, static_cast<int64_t>(accepted) - shed + 1);  // + the gate
    EXPECT_EQ(s.models[0].slots_used, 0);
  }
}

}  // namespace
}  // namespace imagegen
