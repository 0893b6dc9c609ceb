// The engine thread's wait for a CPU (engine/util/run_queue_wait.h): the schedstat parser, the
// per-thread differences, and the real file on a thread that shares its only CPU with a spinning
// one.
#include "engine/util/run_queue_wait.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/temp_dir.h"

namespace imagegen::testing {
namespace {

TEST(RunQueueWaitTest, ParsesTheSecondOfThreeNumbers) {
  EXPECT_DOUBLE_EQ(*ParseRunQueueWaitSeconds("123 2500000000 7\n"), 2.5);
  EXPECT_DOUBLE_EQ(*ParseRunQueueWaitSeconds("0 0 0"), 0.0);
  for (const char* bad : {"", "1 2", "1 2 3 4", "1 x 3", "-1 2 3", "1 2 3 junk", "1,2,3",
                          "99999999999999999999999 1 1"}) {
    EXPECT_FALSE(ParseRunQueueWaitSeconds(bad).has_value()) << bad;
  }
}

// Runs `f` on a thread of its own (the reader is per thread) and returns what it returned.
template <class F>
auto OnAThread(F f) {
  decltype(f()) out;
  std::thread([&] { out = f(); }).join();
  return out;
}

TEST(RunQueueWaitTest, EachCallGivesTheWaitSinceTheThreadsPreviousCall) {
  const std::string path = TempDir("run_queue_wait") + "/schedstat";
  auto write = [&](const char* text) { std::ofstream(path, std::ios::trunc) << text; };
  write("10 1000000000 3\n");
  const std::vector<std::optional<double>> got = OnAThread([&] {
    std::vector<std::optional<double>> v;
    v.push_back(RunQueueWaitSinceLastCall(path.c_str()));  // the first: no earlier reading
    write("20 1250000000 4\n");
    v.push_back(RunQueueWaitSinceLastCall(path.c_str()));
    v.push_back(RunQueueWaitSinceLastCall(path.c_str()));  // nothing since
    write("30 2000000000 5\n");
    v.push_back(RunQueueWaitSinceLastCall());  // the file opened at the first call stays
    write("garbage");
    v.push_back(RunQueueWaitSinceLastCall());
    return v;
  });
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got[0], 0.0);
  EXPECT_NEAR(got[1].value_or(-1), 0.25, 1e-9);
  EXPECT_EQ(got[2], 0.0);
  EXPECT_NEAR(got[3].value_or(-1), 0.75, 1e-9);
  EXPECT_FALSE(got[4].has_value());
  EXPECT_FALSE(OnAThread([] { return RunQueueWaitSinceLastCall("/nonexistent/schedstat"); }));
}

// The real file: a thread that shares the one CPU it may run on with a spinning thread waits for
// it about half the time. On a loaded machine it waits more, never less.
TEST(RunQueueWaitTest, AThreadSharingItsCpuWithASpinningOneWaits) {
  cpu_set_t all;
  if (sched_getaffinity(0, sizeof all, &all) != 0) GTEST_SKIP() << "no affinity mask";
  int cpu = 0;
  while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &all)) ++cpu;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  auto pin = [&] { return sched_setaffinity(0, sizeof one, &one) == 0; };
  auto spin_for = [](std::chrono::milliseconds d) {
    const auto until = std::chrono::steady_clock::now() + d;
    while (std::chrono::steady_clock::now() < until) {
    }
  };
  struct Got {
    bool readable = false, pinned = false;
    double shared = 0;
  };
  std::atomic<bool> stop{false};
  std::atomic<bool> spinning{false};
  const Got got = OnAThread([&] {
    Got g;
    if (!RunQueueWaitSinceLastCall().has_value()) return g;
    g.readable = true;
    if (!pin()) return g;
    g.pinned = true;
    std::thread spinner([&] {  // on the same CPU: a thread inherits its creator's mask
      spinning = true;
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
    while (!spinning) std::this_thread::yield();
    RunQueueWaitSinceLastCall();
    spin_for(std::chrono::milliseconds(600));
    g.shared = RunQueueWaitSinceLastCall().value_or(-1);
    stop = true;
    spinner.join();
    return g;
  });
  if (!got.readable) GTEST_SKIP() << "no /proc/thread-self/schedstat here";
  if (!got.pinned) GTEST_SKIP() << "cannot pin a thread to one CPU here";
  // 600 ms of wall time on one CPU with another runnable thread: about 300 ms waiting; at
  // least a sixth of it even if the scheduler favours the waker.
  EXPECT_GT(got.shared, 0.1) << "seconds waited";
  std::printf("waited %.3f s of 0.6 s beside a spinning thread on one CPU\n", got.shared);
}

}  // namespace
}  // namespace imagegen::testing
