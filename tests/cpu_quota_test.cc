// The CPU quota from made-up cgroup trees (v2, v1, a container's view) and the thread cap.
#include "engine/util/cpu_quota.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/temp_dir.h"

namespace imagegen {
namespace {

namespace fs = std::filesystem;

class CpuQuotaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::TempDir(std::string("cpu_quota_") +
                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void Write(const std::string& rel, const std::string& text) {
    const fs::path p = fs::path(root_) / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text << "\n";
  }
  // ReadCpuQuota finds `cpus`, read in root_/`dir`.
  void ExpectQuota(double cpus, const std::string& dir) {
    const std::optional<CpuQuota> q = ReadCpuQuota(root_);
    ASSERT_TRUE(q.has_value()) << "expected " << cpus << " CPUs in " << dir;
    EXPECT_DOUBLE_EQ(q->cpus, cpus);
    EXPECT_EQ(q->file, root_ + "/" + dir);
  }
  std::string root_;
};

TEST_F(CpuQuotaTest, V2TakesTheSmallestQuotaAlongThePath) {
  Write("proc/self/cgroup", "0::/kubepods/pod1/ctr");
  Write("sys/fs/cgroup/cgroup.controllers", "cpu memory");
  Write("sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "150000 100000");
  Write("sys/fs/cgroup/kubepods/pod1/cpu.max", "max 100000");
  ExpectQuota(1.5, "sys/fs/cgroup/kubepods/pod1/ctr");
  // A parent's smaller quota binds (a pod's limit over its container's).
  Write("sys/fs/cgroup/kubepods/pod1/cpu.max", "50000 50000");
  ExpectQuota(1.0, "sys/fs/cgroup/kubepods/pod1");
}

TEST_F(CpuQuotaTest, NoQuotaIsNone) {
  Write("proc/self/cgroup", "0::/user.slice");
  Write("sys/fs/cgroup/cgroup.controllers", "cpu");
  Write("sys/fs/cgroup/user.slice/cpu.max", "max 100000");
  EXPECT_FALSE(ReadCpuQuota(root_).has_value());
  EXPECT_FALSE(ReadCpuQuota(root_ + "/nothing-here").has_value());
  // Malformed files are no quota, not a guess.
  for (const char* bad : {"abc 100000", "100000", "100000 0", "-5 100000", "1e400 1"}) {
    Write("sys/fs/cgroup/user.slice/cpu.max", bad);
    EXPECT_FALSE(ReadCpuQuota(root_).has_value()) << bad;
  }
}

TEST_F(CpuQuotaTest, AContainersOwnViewIsReadAtTheMountsRoot) {
  // The cgroup file names the host's path, which the container's mount does not have; the
  // runtime set the limit at the mount's root.
  Write("proc/self/cgroup", "0::/system.slice/docker-abc.scope");
  Write("sys/fs/cgroup/cgroup.controllers", "cpu");
  Write("sys/fs/cgroup/cpu.max", "200000 100000");
  ExpectQuota(2.0, "sys/fs/cgroup");
}

TEST_F(CpuQuotaTest, V1ReadsTheCpuControllersQuotaAndPeriod) {
  Write("proc/self/cgroup", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/");
  Write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000");
  Write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000");
  Write("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1");
  Write("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000");
  ExpectQuota(2.5, "sys/fs/cgroup/cpu,cpuacct/docker/abc");
  Write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1");
  EXPECT_FALSE(ReadCpuQuota(root_).has_value());
  // The controller alone, as this VM mounts it.
  Write("proc/self/cgroup", "1:cpu:/igtest");
  Write("sys/fs/cgroup/cpu/igtest/cpu.cfs_quota_us", "100000");
  Write("sys/fs/cgroup/cpu/igtest/cpu.cfs_period_us", "100000");
  ExpectQuota(1.0, "sys/fs/cgroup/cpu/igtest");
}

TEST(CpuQuotaThreadsTest, AtMostTheQuotaRoundedDownAtLeastOneNeverMore) {
  EXPECT_EQ(ThreadsUnderQuota(64, 2.0), 2);
  EXPECT_EQ(ThreadsUnderQuota(64, 2.9), 2);
  EXPECT_EQ(ThreadsUnderQuota(64, 0.5), 1);
  EXPECT_EQ(ThreadsUnderQuota(2, 8.0), 2);
  EXPECT_EQ(ThreadsUnderQuota(4, 0.0), 4);
}

}  // namespace
}  // namespace imagegen
