#include "engine/model/device.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "engine/model/cuda_stream.h"

namespace imagegen {
namespace {

TEST(DeviceTest, ParsesCpuAndEveryDtype) {
  auto o = ParseDeviceAndDtype("cpu", "fp32");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->device.is_cpu());
  EXPECT_EQ(o->dtype, at::kFloat);
  EXPECT_EQ(ParseDeviceAndDtype("cpu", "bf16")->dtype, at::kBFloat16);
  EXPECT_EQ(ParseDeviceAndDtype("cpu", "fp16")->dtype, at::kHalf);
  EXPECT_EQ(ParseDeviceAndDtype("cpu", "auto")->dtype, at::kFloat);  // auto: fp32 on the CPU
}

// The engine's kernels split a step over every intra-op thread where the build compiles them
// with OpenMP (engine/CMakeLists.txt): until 2026-12-06 the flag was missing and each of their
// at::parallel_for calls ran on one thread while LibTorch's own ops used two.
TEST(DeviceTest, TheEnginesKernelsRunOnTheIntraOpThreads) {
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  EXPECT_EQ(EngineKernelThreads(), 1);
  at::set_num_threads(2);
#ifdef IMAGEGEN_EXPECT_PARALLEL_ENGINE_KERNELS
  EXPECT_EQ(EngineKernelThreads(), 2);
#else
  EXPECT_GE(EngineKernelThreads(), 1);
  std::printf("engine kernels built without OpenMP: %d thread(s) of 2\n", EngineKernelThreads());
#endif
  at::set_num_threads(before);
}

TEST(DeviceTest, MalformedValuesNameTheField) {
  for (const char* bad : {"gpu", "", "CPU", "cuda:", "cuda0", "cuda:x", "cuda:-1", "cuda:1234",
                          "cuda:0:1", "cudax"}) {
    auto o = ParseDeviceAndDtype(bad, "fp32");
    ASSERT_FALSE(o.ok()) << bad;
    EXPECT_EQ(o.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(o.status().field(), "device") << bad;
    EXPECT_EQ(o.status().message(),
              std::string("device: expected cpu, cuda or cuda:N, got '") + bad + "'");
  }
  for (const char* bad : {"fp64", "float32", "", "BF16"}) {
    auto o = ParseDeviceAndDtype("cpu", bad);
    ASSERT_FALSE(o.ok()) << bad;
    EXPECT_EQ(o.status().field(), "dtype") << bad;
    EXPECT_EQ(o.status().message(),
              std::string("dtype: expected auto, fp32, bf16 or fp16, got '") + bad + "'");
  }
}

TEST(DeviceTest, CudaNamesADevice) {
  const int n = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  for (const std::string dev : {"cuda", "cuda:0", "cuda:1", "cuda:999"}) {
    const int index = dev == "cuda" ? 0 : std::stoi(dev.substr(5));
    auto o = ParseDeviceAndDtype(dev, "bf16");
    if (index < n) {
      ASSERT_TRUE(o.ok()) << dev << ": " << o.status().ToString();
      EXPECT_TRUE(o->device.is_cuda());
      EXPECT_EQ(o->device.index(), index);
      EXPECT_EQ(o->dtype, at::kBFloat16);
      EXPECT_EQ(ParseDeviceAndDtype(dev, "auto")->dtype, at::kBFloat16);  // auto: bf16 on CUDA
    } else {
      ASSERT_FALSE(o.ok()) << dev;
      EXPECT_EQ(o.status().field(), "device");
      EXPECT_EQ(o.status().message(), n == 0 ? "device: no CUDA device available"
                                             : "device: " + dev + " does not exist (" +
                                                   std::to_string(n) + " CUDA devices)");
    }
  }
}

// The KV-cache memory a model gets by default: 256 MiB on the CPU (whatever the host has), and
// on a GPU half of what the device still has, shared by the models still to load (the first of
// two models gets a quarter, the second half of what is then left); 256 MiB when the device
// does not say. On a GPU the device's own figure too: positive, and no more than it has.
TEST(DeviceTest, KvCacheByDevice) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  EXPECT_EQ(AutoKvCacheBytes(false, int64_t{100} << 30, 1), 256 * kMiB);
  EXPECT_EQ(AutoKvCacheBytes(false, -1, 1), 256 * kMiB);
  EXPECT_EQ(AutoKvCacheBytes(true, -1, 1), 256 * kMiB);
  EXPECT_EQ(AutoKvCacheBytes(true, 80 * kMiB * 1024, 1), 40 * kMiB * 1024);
  EXPECT_EQ(AutoKvCacheBytes(true, 80 * kMiB * 1024, 2), 20 * kMiB * 1024);
  EXPECT_EQ(AutoKvCacheBytes(true, 60 * kMiB * 1024, 1), 30 * kMiB * 1024);
  EXPECT_EQ(AutoKvCacheBytes(true, 1000, 0), 500);  // no models left: as one
  EXPECT_EQ(DeviceFreeBytes(c10::Device(c10::kCPU)), -1);
  if (torch::cuda::is_available()) {
    const int64_t free = DeviceFreeBytes(c10::Device(c10::kCUDA, 0));
    std::printf("cuda:0 can still give %.1f GiB\n", static_cast<double>(free) / (kMiB * 1024));
    EXPECT_GT(free, 0);
  }
}

// Models on CUDA turn cuDNN's attention off (its per-shape plans cost 1-1.8 ms of host time a
// call on an H200); on the CPU nothing changes.
TEST(DeviceTest, CudaModelsTurnCudnnAttentionOff) {
  const bool before = at::globalContext().userEnabledCuDNNSDP();
  PrepareAttention(c10::Device(c10::kCPU));
  EXPECT_EQ(at::globalContext().userEnabledCuDNNSDP(), before);
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  PrepareAttention(c10::Device(c10::kCUDA, 0));
  const char* keep = std::getenv("IMAGEGEN_CUDNN_SDPA");
  EXPECT_EQ(at::globalContext().userEnabledCuDNNSDP(), keep != nullptr && !std::strcmp(keep, "1"));
}

}  // namespace
}  // namespace imagegen
