// ThreadGovernor (engine/scheduler/thread_governor.h): the intra-op thread count that follows the
// engine thread's run-queue wait, fed made-up steps on a made-up clock.
#include "engine/scheduler/thread_governor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace imagegen::testing {
namespace {

// Steps of 1/16 s (exact in binary: 16 make a window of 1 s) whose run-queue wait is `share` of
// each, on a clock that moves by the step.
struct Feed {
  ThreadGovernor gov;
  double now = 100;
  explicit Feed(ThreadGovernorOptions o) : gov(std::move(o)) {}
  // n steps; returns the counts the governor asked for after each.
  std::vector<int> Steps(int n, double share, double step = 0.0625) {
    std::vector<int> out;
    for (int i = 0; i < n; ++i) {
      now += step;
      out.push_back(gov.Observe(step, share * step, now));
    }
    return out;
  }
  // Steps until `seconds` of the clock have passed.
  void For(double seconds, double share) { Steps(static_cast<int>(seconds * 16 + 0.5), share); }
};

ThreadGovernorOptions Two() {
  ThreadGovernorOptions o;
  o.counts = {2, 1};
  return o;  // windows of 1 s and 16 steps
}

TEST(ThreadGovernorTest, HalvingCountsEndAtOne) {
  EXPECT_EQ(HalvingThreadCounts(8), (std::vector<int>{8, 4, 2, 1}));
  EXPECT_EQ(HalvingThreadCounts(6), (std::vector<int>{6, 3, 1}));
  EXPECT_EQ(HalvingThreadCounts(2), (std::vector<int>{2, 1}));
  EXPECT_EQ(HalvingThreadCounts(1), (std::vector<int>{1}));
  EXPECT_EQ(HalvingThreadCounts(0), (std::vector<int>{1}));
}

TEST(ThreadGovernorTest, BadOptionsNameTheField) {
  auto bad = [](auto edit) {
    ThreadGovernorOptions o = Two();
    edit(o);
    return ValidateThreadGovernorOptions(o);
  };
  EXPECT_EQ(ValidateThreadGovernorOptions(Two()), "");
  EXPECT_EQ(bad([](auto& o) { o.counts = {}; }).rfind("counts:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.counts = {1, 2}; }).rfind("counts:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.counts = {2, 0}; }).rfind("counts:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.lower_share = 0; }).rfind("lower_share:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.window_seconds = -1; }).rfind("window_seconds:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.window_steps = 0; }).rfind("window_steps:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.first_probe_seconds = 0; }).rfind("first_probe_seconds:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.max_probe_seconds = 10; }).rfind("max_probe_seconds:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.idle_try_share = -1; }).rfind("idle_try_share:", 0), 0u);
  EXPECT_EQ(bad([](auto& o) { o.idle_try_gap_seconds = -1; }).rfind("idle_try_gap_seconds:", 0),
            0u);
  EXPECT_EQ(bad([](auto& o) { o.verify_margin = 1; }).rfind("verify_margin:", 0), 0u);
  EXPECT_EQ(ValidateThreadGovernorOptions([] {
              ThreadGovernorOptions o = Two();
              o.verify_margin = -1;  // off
              return o;
            }()),
            "");
}

// Quiet (the daemon's 0.00-0.01 at 1-16 clients) and just under the bound: never lowered.
TEST(ThreadGovernorTest, AQuietMachineKeepsEveryThread) {
  for (const double share : {0.0, 0.01, 0.19}) {
    Feed f(Two());
    for (int c : f.Steps(16 * 60, share)) ASSERT_EQ(c, 2) << share;
    EXPECT_EQ(f.gov.lowered(), 0);
    EXPECT_NEAR(f.gov.last_share(), share, 1e-9);
  }
}

// Beside a busy loop (0.34-0.40 measured): one window at two threads, then one.
TEST(ThreadGovernorTest, ContentionLowersTheCountAfterOneWholeWindow) {
  Feed f(Two());
  const std::vector<int> first = f.Steps(15, 0.37);
  for (int c : first) EXPECT_EQ(c, 2);  // 0.94 s of steps: the window is not complete
  EXPECT_EQ(f.Steps(1, 0.37).back(), 1);
  EXPECT_EQ(f.gov.lowered(), 1);
  // More steps than a second's worth, when asked for.
  ThreadGovernorOptions o = Two();
  o.window_steps = 40;
  Feed g(o);
  for (int c : g.Steps(39, 0.37)) EXPECT_EQ(c, 2);
  EXPECT_EQ(g.Steps(1, 0.37).back(), 1);
}

// Steps without a reading (no schedstat) are not counted, whatever their length.
TEST(ThreadGovernorTest, UnknownWaitsChangeNothing) {
  Feed f(Two());
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(f.gov.Observe(0.0625, -1, 100 + i * 0.0625), 2);
  EXPECT_EQ(f.gov.last_share(), -1);
}

// At one thread the loop no longer shows (0.00-0.01): after 30 s the count above is tried for a
// window; while the loop runs each try goes back down and the next waits twice as long, up to
// the cap; once the loop has gone a try holds and the wait starts over.
TEST(ThreadGovernorTest, TriesTheCountAboveBackingOffWhileContended) {
  ThreadGovernorOptions o = Two();
  o.max_probe_seconds = 100;
  Feed f(o);
  f.Steps(16, 0.37);
  ASSERT_EQ(f.gov.threads(), 1);
  // Each try's start, as seconds after the previous return to one thread.
  std::vector<double> waits;
  double since = f.now;
  for (int i = 0; i < 12000 && waits.size() < 5; ++i) {
    const bool was_one = f.gov.threads() == 1;
    // At one thread, quiet; at two (a try), contended.
    const int c = f.Steps(1, was_one ? 0.005 : 0.37).back();
    if (was_one && c == 2) {
      waits.push_back(f.now - since);
      ASSERT_TRUE(f.gov.trying());
    }
    if (!was_one && c == 1) since = f.now;
  }
  ASSERT_EQ(waits.size(), 5u);
  // 30, 60, 100 (capped), 100, 100 s: within a window of each.
  const double want[] = {30, 60, 100, 100, 100};
  for (size_t i = 0; i < waits.size(); ++i) {
    EXPECT_GE(waits[i], want[i]) << i;
    EXPECT_LE(waits[i], want[i] + 1.0) << i;
  }
  EXPECT_EQ(f.gov.failed_tries(), 4);  // the fifth is still deciding
  // The loop has gone: the try holds, and two threads stay.
  f.For(1.0, 0.005);
  EXPECT_EQ(f.gov.threads(), 2);
  EXPECT_FALSE(f.gov.trying());
  f.For(600, 0.005);
  EXPECT_EQ(f.gov.threads(), 2);
  EXPECT_EQ(f.gov.failed_tries(), 4);
  // Contended again: down at once, and the first wait is 30 s again (the held try reset it).
  for (int i = 0; i < 32 && f.gov.threads() == 2; ++i) f.Steps(1, 0.37);
  ASSERT_EQ(f.gov.threads(), 1);
  const double down = f.now;
  while (f.gov.threads() == 1) f.Steps(1, 0.005);
  EXPECT_GE(f.now - down, 30);
  EXPECT_LE(f.now - down, 31.0);
}

// More threads: down a halving at a time while the share stays high, and back up one at a time.
TEST(ThreadGovernorTest, StepsThroughTheLadderOneCountAtATime) {
  ThreadGovernorOptions o;
  o.counts = HalvingThreadCounts(8);
  Feed f(o);
  std::vector<int> seen;
  for (int w = 0; w < 5; ++w) seen.push_back(f.Steps(16, 0.5).back());
  EXPECT_EQ(seen, (std::vector<int>{4, 2, 1, 1, 1}));
  EXPECT_EQ(f.gov.lowered(), 3);
  // Quiet at every count: each try holds, 30 s apart.
  f.For(31, 0.0);
  EXPECT_EQ(f.gov.threads(), 2);
  f.For(31, 0.0);
  EXPECT_EQ(f.gov.threads(), 4);
  f.For(31, 0.0);
  EXPECT_EQ(f.gov.threads(), 8);
  f.For(300, 0.0);
  EXPECT_EQ(f.gov.threads(), 8);
  EXPECT_EQ(f.gov.raised(), 3);
  EXPECT_EQ(f.gov.failed_tries(), 0);
}

// Steps of 1/16 s with an idle reading on each (as the engine gives one while lowered).
void IdleSteps(Feed& f, int n, double share, double idle) {
  for (int i = 0; i < n; ++i) {
    f.now += 0.0625;
    f.gov.Observe(0.0625, share * 0.0625, f.now, idle);
  }
}

// At one thread beside the busy loop no CPU sits idle (the loop has the other): no try before
// its 30 s. Once the loop has gone, its CPU is idle and the try starts at that window's end.
TEST(ThreadGovernorTest, AnIdleCpuStartsTheTryBeforeItsTime) {
  Feed f(Two());
  f.Steps(16, 0.37);
  ASSERT_EQ(f.gov.threads(), 1);
  const double down = f.now;
  IdleSteps(f, 16 * 10, 0.005, 0.05);
  EXPECT_EQ(f.gov.threads(), 1);
  IdleSteps(f, 16, 0.005, 0.95);
  EXPECT_EQ(f.gov.threads(), 2);
  EXPECT_TRUE(f.gov.trying());
  EXPECT_LT(f.now - down, 12);
  EXPECT_EQ(f.gov.idle_tries(), 1);
  f.Steps(16, 0.005);  // it holds
  EXPECT_EQ(f.gov.threads(), 2);
  EXPECT_FALSE(f.gov.trying());
  // Short of the share a CPU the try adds: no try.
  Feed g(Two());
  g.Steps(16, 0.37);
  IdleSteps(g, 16 * 20, 0.005, 0.70);
  EXPECT_EQ(g.gov.threads(), 1);
  // Off.
  ThreadGovernorOptions o = Two();
  o.idle_try_share = 0;
  Feed h(o);
  h.Steps(16, 0.37);
  IdleSteps(h, 16 * 20, 0.005, 2.0);
  EXPECT_EQ(h.gov.threads(), 1);
  EXPECT_EQ(h.gov.idle_tries(), 0);
}

// Other work that sleeps half of each 1/8 s (bench/hog.sh 0.0625 0.0625): every other reading
// finds its CPU idle, the last of each window among them. A window's idle CPUs are its readings'
// mean (0.5), short of what a try's thread needs: the tries wait for their time, where a
// governor that took the last reading would try at every window's end the gap allows.
TEST(ThreadGovernorTest, WorkThatComesAndGoesWithinAWindowStartsNoTry) {
  Feed f(Two());
  f.Steps(16, 0.37);
  ASSERT_EQ(f.gov.threads(), 1);
  const double down = f.now;
  for (int i = 0; i < 16 * 29; ++i) {
    f.now += 0.0625;
    f.gov.Observe(0.0625, 0.005 * 0.0625, f.now, i % 2 == 0 ? 0.0 : 1.0);
    ASSERT_EQ(f.gov.threads(), 1) << f.now - down;
  }
  EXPECT_DOUBLE_EQ(f.gov.window_idle(), 0.5);
  IdleSteps(f, 16 * 2, 0.005, 0.5);  // the timed try, 30 s after going down
  EXPECT_EQ(f.gov.threads(), 2);
  EXPECT_EQ(f.gov.idle_tries(), 0);
}

// Idle CPUs beside still-contended steps (work that comes and goes): a try that goes back down
// holds the next idle-started one off for idle_try_gap_seconds, doubled for each such try in a
// row that failed (up to max_probe_seconds), and the timed tries back off as before.
TEST(ThreadGovernorTest, IdleStartedTriesThatFailWaitTheirGap) {
  ThreadGovernorOptions o = Two();
  o.max_probe_seconds = 40;
  Feed f(o);
  f.Steps(16, 0.37);
  double last_down = f.now;
  std::vector<double> gaps;
  for (int i = 0; i < 16 * 200; ++i) {
    const bool one = f.gov.threads() == 1;
    f.now += 0.0625;
    const int c = f.gov.Observe(0.0625, (one ? 0.005 : 0.37) * 0.0625, f.now, one ? 1.5 : -1);
    if (one && c == 2) gaps.push_back(f.now - last_down);
    if (!one && c == 1) last_down = f.now;
  }
  ASSERT_GE(gaps.size(), 6u);
  EXPECT_LT(gaps[0], 1.01);  // the first: at the next window's end
  const double want[] = {0, 5, 10, 20, 40, 40};
  for (size_t i = 1; i < gaps.size(); ++i) {
    const double w = want[std::min<size_t>(i, 5)];
    EXPECT_GE(gaps[i], w) << i;
    EXPECT_LE(gaps[i], w + 1.0) << i;
  }
  EXPECT_EQ(f.gov.failed_tries(), static_cast<int64_t>(gaps.size()) - (f.gov.trying() ? 1 : 0));
  // A try that lasts first_probe_seconds starts the gaps over.
  while (f.gov.threads() == 1) IdleSteps(f, 1, 0.005, 1.5);
  f.For(31, 0.005);
  ASSERT_EQ(f.gov.threads(), 2);
  EXPECT_EQ(f.gov.idle_try_gap(), 5);
}

// A share that hovers about lower_share at the higher count (0.13-0.25 per window under the
// daemon's own streaming load on 2 cores, where one thread and two served the same): a try
// holds its window, and a later window goes back down. Such a try did not last, so it failed:
// the waits double, and the count changes a few times in ten minutes, not every few seconds.
TEST(ThreadGovernorTest, TriesThatDoNotLastBackOff) {
  Feed f(Two());
  int64_t window = 0;
  for (int i = 0; i < 16 * 600; ++i) {
    const bool one = f.gov.threads() == 1;
    f.now += 0.0625;
    if (i % 16 == 0) window += 1;
    // At two threads windows of 0.15 and 0.25 in turn; at one, quiet, 0.8 of a CPU idle.
    const double share = one ? 0.02 : (window % 2 == 0 ? 0.15 : 0.25);
    f.gov.Observe(0.0625, share * 0.0625, f.now, one ? 0.8 : -1);
  }
  // Down first (not a try), then each try back down: 5, 10, 20, 40, 80, 160 s idle gaps and
  // the timed ones (60, 120, ...) interleaved: at most a dozen changes of count.
  EXPECT_LE(f.gov.raised(), 12) << f.gov.lowered();
  EXPECT_GE(f.gov.raised(), 4);
  EXPECT_GE(f.gov.failed_tries(), f.gov.raised() - 1);
  EXPECT_GE(f.gov.idle_try_gap(), 80);
}

// Steps of 1/16 s whose calibrated time is `work` of the step at two threads: the share of
// run-queue wait and the slowness (step time over calibrated time) depend on the count.
struct Costed {
  double share_two, slow_two, share_one, slow_one;
};
int64_t RunCosted(Feed& f, int windows, const Costed& c, std::vector<int>* counts = nullptr) {
  int64_t changes = 0;
  for (int i = 0; i < 16 * windows; ++i) {
    const bool one = f.gov.threads() == 1;
    f.now += 0.0625;
    const double slow = one ? c.slow_one : c.slow_two;
    const int after = f.gov.Observe(0.0625, (one ? c.share_one : c.share_two) * 0.0625, f.now,
                                    one ? 0.1 : -1, 0.0625 / slow);
    changes += after != (one ? 1 : 2) ? 1 : 0;
    if (counts != nullptr && i % 16 == 15) counts->push_back(after);
  }
  return changes;
}

// Beside a busy loop one thread is faster for the same work (slowness 1.5 against 4 at two):
// the lowering pays, and the count stays down (the timed tries aside).
TEST(ThreadGovernorTest, ALoweringThatPaysStays) {
  Feed f(Two());
  std::vector<int> counts;
  RunCosted(f, 20, {0.37, 4.0, 0.005, 1.5}, &counts);
  EXPECT_EQ(counts, std::vector<int>(20, 1));
  EXPECT_EQ(f.gov.reverted(), 0);
  EXPECT_DOUBLE_EQ(f.gov.slowness_before(), 4.0);
  EXPECT_DOUBLE_EQ(f.gov.last_slowness(), 1.5);
}

// The daemon's own load on its cores (streaming previews, the load client beside it): the
// share crosses lower_share at two threads, but one thread is slower for the same work (1.4
// against 1.2). Each lowering goes back up after its first window, and the next waits 30, 60,
// 120, ... s: five lowerings in ten minutes, where without the check the count stays down
// (its tries failing while the share stays up).
TEST(ThreadGovernorTest, ALoweringThatDoesNotPayGoesBackUpAndWaits) {
  const Costed own_load{0.25, 1.2, 0.02, 1.4};
  Feed f(Two());
  std::vector<int> counts;
  RunCosted(f, 600, own_load, &counts);
  EXPECT_EQ(counts[0], 1);
  EXPECT_EQ(counts[1], 2);  // back up after one window
  EXPECT_EQ(f.gov.reverted(), f.gov.lowered());
  EXPECT_GE(f.gov.lowered(), 4);
  EXPECT_LE(f.gov.lowered(), 5);  // at 0, 31, 92, 213, 454 s (windows of 1 s)
  EXPECT_GE(std::count(counts.begin(), counts.end(), 2), 590);
  EXPECT_DOUBLE_EQ(f.gov.last_slowness(), 1.2);
  // Checked off: down it goes, and stays down but for its timed tries.
  ThreadGovernorOptions o = Two();
  o.verify_margin = -1;
  Feed g(o);
  std::vector<int> unchecked;
  RunCosted(g, 600, own_load, &unchecked);
  EXPECT_EQ(g.gov.reverted(), 0);
  EXPECT_GE(std::count(unchecked.begin(), unchecked.end(), 1), 590);
  // Within the margin (1.16 against 1.2: 3% less slow, the margin 5%): not enough, back up.
  Feed h(Two());
  RunCosted(h, 3, {0.25, 1.2, 0.02, 1.16});
  EXPECT_EQ(h.gov.reverted(), 1);
  EXPECT_EQ(h.gov.threads(), 2);
}

// One count: nothing to choose.
TEST(ThreadGovernorTest, OneCountNeverChanges) {
  ThreadGovernorOptions o;
  o.counts = {1};
  Feed f(o);
  for (int c : f.Steps(200, 0.9)) ASSERT_EQ(c, 1);
  EXPECT_EQ(f.gov.lowered(), 0);
}

}  // namespace
}  // namespace imagegen::testing
