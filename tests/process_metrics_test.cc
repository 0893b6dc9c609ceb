// The process collector (server/process_metrics.h): /proc/<pid>/stat parsed with a command name
// that holds spaces and parentheses, the boot time, and this test process's own figures moving
// as it opens descriptors, burns CPU and touches memory.
#include "server/process_metrics.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <map>
#include <string>
#include <vector>

namespace imagegen::testing {
namespace {

using server::ParseBootTime;
using server::ParseProcStat;

// When this test binary was loaded (its process's start, to within its loading).
const std::time_t kLoaded = std::time(nullptr);

TEST(ProcessMetricsTest, ProcStatFieldsAreCountedFromTheCommandNamesLastParenthesis) {
  // Fields 3.. after the name: state, ppid, pgrp, session, tty, tpgid, flags, minflt, cminflt,
  // majflt, cmajflt, utime (14), stime (15), cutime, cstime, priority, nice, threads,
  // itrealvalue, starttime (22), vsize (23), rss (24), rsslim ...
  const std::string tail =
      " S 1 2 3 4 5 6 7 8 9 10 100 50 11 12 20 0 8 0 5000 123456789 2048 18446744073709551615 "
      "1 1 0\n";
  for (const std::string name : {"(imagegen-server)", "(a) (b c)", "(x)y) z)", "()"}) {
    const auto st = ParseProcStat("4321 " + name + tail);
    ASSERT_TRUE(st.has_value()) << name;
    EXPECT_EQ(st->utime_ticks, 100u) << name;
    EXPECT_EQ(st->stime_ticks, 50u) << name;
    EXPECT_EQ(st->start_ticks, 5000u) << name;
    EXPECT_EQ(st->vsize_bytes, 123456789u) << name;
    EXPECT_EQ(st->rss_pages, 2048) << name;
  }
  EXPECT_FALSE(ParseProcStat("4321 no parenthesis S 1 2 3").has_value());
  EXPECT_FALSE(ParseProcStat("4321 (short) S 1 2 3 4 5 6 7 8 9 10 100 50\n").has_value());
  std::string bad = tail;
  bad.replace(bad.find(" 100 50 "), 8, " 1x0 50 ");  // utime not a number
  EXPECT_FALSE(ParseProcStat("4321 (bad)" + bad).has_value());
  EXPECT_FALSE(ParseProcStat("4321 (neg) S 1 2 3 4 5 6 7 8 9 10 -100 50 11 12 20 0 8 0 5000 "
                             "123456789 2048\n")
                   .has_value());

  EXPECT_EQ(ParseBootTime("cpu  1 2 3\ncpu0 1 2 3\nintr 5\nctxt 9\nbtime 1764900000\n"),
            1764900000);
  EXPECT_FALSE(ParseBootTime("cpu  1 2 3\nctxt 9\n").has_value());
  EXPECT_FALSE(ParseBootTime("btime x\n").has_value());
}

std::map<std::string, double> Collected() {
  std::map<std::string, double> out;
  for (const auto& f : server::ProcessMetrics().Collect()) {
    EXPECT_EQ(f.metric.size(), 1u) << f.name;
    const auto& m = f.metric.at(0);
    out[f.name] = f.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
    EXPECT_FALSE(f.help.empty()) << f.name;
  }
  return out;
}

TEST(ProcessMetricsTest, ThisProcessFiguresMoveWithWhatItDoes) {
  auto before = Collected();
  for (const char* name : {"process_cpu_seconds_total", "process_resident_memory_bytes",
                           "process_virtual_memory_bytes", "process_open_fds", "process_max_fds",
                           "process_start_time_seconds"}) {
    EXPECT_EQ(before.count(name), 1u) << name;
  }
  EXPECT_LE(std::abs(before["process_start_time_seconds"] - static_cast<double>(kLoaded)), 5.0)
      << before["process_start_time_seconds"] << " against " << kLoaded;
  rlimit lim{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &lim), 0);
  EXPECT_EQ(before["process_max_fds"], static_cast<double>(lim.rlim_cur));

  // Ten pipes: twenty descriptors more, and back.
  std::vector<int> fds(20);
  for (int i = 0; i < 10; ++i) ASSERT_EQ(::pipe(&fds[2 * static_cast<size_t>(i)]), 0);
  EXPECT_EQ(Collected()["process_open_fds"], before["process_open_fds"] + 20);
  for (int fd : fds) ::close(fd);
  EXPECT_EQ(Collected()["process_open_fds"], before["process_open_fds"]);

  // 0.3 s of this thread's CPU (its own clock, whatever else the machine runs).
  timespec t0{}, t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
  volatile uint64_t x = 0;
  do {
    for (int i = 0; i < 100000; ++i) x = x + static_cast<uint64_t>(i);
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) * 1e-9 < 0.3);
  const double burnt =
      Collected()["process_cpu_seconds_total"] - before["process_cpu_seconds_total"];
  EXPECT_GE(burnt, 0.25);  // clock ticks of 10 ms: 0.3 s is at least 0.29 s of them

  // 64 MiB touched: resident and virtual memory grow by about that much.
  const size_t bytes = 64u << 20;
  auto* block = static_cast<char*>(std::malloc(bytes));
  ASSERT_NE(block, nullptr);
  std::memset(block, 1, bytes);
  auto after = Collected();
  EXPECT_GE(after["process_resident_memory_bytes"] - before["process_resident_memory_bytes"],
            0.9 * static_cast<double>(bytes));
  EXPECT_GE(after["process_virtual_memory_bytes"] - before["process_virtual_memory_bytes"],
            0.9 * static_cast<double>(bytes));
  std::free(block);
}

}  // namespace
}  // namespace imagegen::testing
