// Idle CPUs of the process's affinity mask from /proc/stat (engine/util/cpu_idle.h): the parser,
// the meter over a made-up file, and the real file.
#include "engine/util/cpu_idle.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tests/temp_dir.h"

namespace imagegen::testing {
namespace {

const char* kStat =
    "cpu  1000 10 500 9000 40 0 5 0 0 0\n"
    "cpu0 500 5 250 4000 20 0 3 0 0 0\n"
    "cpu1 400 4 200 3000 10 0 1 0 0 0\n"
    "cpu3 100 1 50 2000 10 0 1 0 0 0\n"
    "intr 12345 0 0\n"
    "ctxt 999\n";

TEST(CpuIdleTest, SumsIdleAndIowaitOfTheListedCpus) {
  EXPECT_EQ(*ParseIdleTicks(kStat, {0}), 4020u);
  EXPECT_EQ(*ParseIdleTicks(kStat, {0, 1}), 7030u);
  EXPECT_EQ(*ParseIdleTicks(kStat, {3, 1}), 5020u);         // the aggregate "cpu" line is not a CPU
  EXPECT_FALSE(ParseIdleTicks(kStat, {2}).has_value());     // not in the file
  EXPECT_FALSE(ParseIdleTicks(kStat, {0, 2}).has_value());  // one of them missing
  EXPECT_FALSE(ParseIdleTicks(kStat, {}).has_value());
  EXPECT_FALSE(ParseIdleTicks("cpu0 1 2 3\n", {0}).has_value());  // too few numbers
  EXPECT_FALSE(ParseIdleTicks("cpu0 1 2 x 4 5\n", {0}).has_value());
  EXPECT_FALSE(ParseIdleTicks("", {0}).has_value());
}

void WriteFile(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

TEST(CpuIdleTest, TheMeterGivesIdleCpusPerSecondBetweenCalls) {
  const std::string path = TempDir("imagegen-cpu-idle") + "/stat";
  const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
  auto stat = [&](uint64_t idle0, uint64_t idle1) {
    return "cpu  0 0 0 0 0\ncpu0 1 1 1 " + std::to_string(idle0) + " 0 0\ncpu1 1 1 1 " +
           std::to_string(idle1) + " 7 0\n";
  };
  CpuIdleMeter m(path, {0, 1});
  EXPECT_FALSE(m.IdleCpusSinceLastCall(10).has_value());  // no file
  WriteFile(path, stat(1000, 1000));
  EXPECT_FALSE(m.IdleCpusSinceLastCall(10).has_value());  // the first reading
  // Over 2 s: CPU 0 idle throughout (2 s of ticks), CPU 1 for a quarter of it.
  WriteFile(path, stat(1000 + static_cast<uint64_t>(2 * hz), 1000 + static_cast<uint64_t>(hz / 2)));
  EXPECT_NEAR(*m.IdleCpusSinceLastCall(12), 1.25, 1e-9);
  // The clock has not moved: nothing to say.
  EXPECT_FALSE(m.IdleCpusSinceLastCall(12).has_value());
  // Only CPU 1 counted: half a CPU over the next second.
  CpuIdleMeter one(path, {1});
  one.IdleCpusSinceLastCall(0);
  WriteFile(path, stat(0, 1000 + static_cast<uint64_t>(hz / 2) + static_cast<uint64_t>(hz / 2)));
  EXPECT_NEAR(*one.IdleCpusSinceLastCall(1), 0.5, 1e-9);
}

// The real file, over this process's CPUs: between none and all of them idle (a little more for
// the ticks' granularity), whatever else runs.
TEST(CpuIdleTest, TheRealFileGivesAShareOfTheAllowedCpus) {
  const std::vector<int> cpus = AllowedCpus();
  ASSERT_FALSE(cpus.empty());
  CpuIdleMeter m;
  auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  ASSERT_FALSE(m.IdleCpusSinceLastCall(seconds()).has_value());
  while (seconds() < 0.3) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const std::optional<double> idle = m.IdleCpusSinceLastCall(seconds());
  ASSERT_TRUE(idle.has_value());
  EXPECT_GE(*idle, 0.0);
  EXPECT_LE(*idle, static_cast<double>(cpus.size()) * 1.2 + 0.1);
}

}  // namespace
}  // namespace imagegen::testing
