#include "engine/model/device.h"

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <cstring>

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
