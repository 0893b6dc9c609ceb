#include "engine/model/device.h"

#include <ATen/Context.h>
#include <torch/cuda.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace imagegen {

void PrepareAttention(const c10::Device& device) {
  if (!device.is_cuda()) return;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* keep = std::getenv("IMAGEGEN_CUDNN_SDPA");
    if (keep == nullptr || std::strcmp(keep, "1") != 0) {
      at::globalContext().setSDPUseCuDNN(false);
    }
  });
}

StatusOr<LoadOptions> ParseDeviceAndDtype(const std::string& device, const std::string& dtype) {
  LoadOptions lo;
  if (device == "cpu") {
    lo.device = c10::Device(c10::kCPU);
  } else if (device.rfind("cuda", 0) == 0) {
    // The form first, so that a typo is reported as one on hosts without a GPU too.
    const std::string rest = device.substr(4);
    if (!rest.empty() && (rest.size() < 2 || rest.size() > 4 || rest[0] != ':' ||
                          rest.find_first_not_of("0123456789", 1) != std::string::npos)) {
      return FieldError("device", "expected cpu, cuda or cuda:N, got '" + device + "'");
    }
    const int index = rest.empty() ? 0 : std::stoi(rest.substr(1));
    if (!torch::cuda::is_available()) return FieldError("device", "no CUDA device available");
    if (index >= static_cast<int>(torch::cuda::device_count())) {
      return FieldError("device", device + " does not exist (" +
                                      std::to_string(torch::cuda::device_count()) +
                                      " CUDA devices)");
    }
    lo.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  } else {
    return FieldError("device", "expected cpu, cuda or cuda:N, got '" + device + "'");
  }
  if (dtype == "auto") {  // bf16 where the device computes it natively, else fp32
    lo.dtype = lo.device.is_cuda() ? at::kBFloat16 : at::kFloat;
  } else if (dtype == "fp32") {
    lo.dtype = at::kFloat;
  } else if (dtype == "bf16") {
    lo.dtype = at::kBFloat16;
  } else if (dtype == "fp16") {
    lo.dtype = at::kHalf;
  } else {
    return FieldError("dtype", "expected auto, fp32, bf16 or fp16, got '" + dtype + "'");
  }
  return lo;
}

int64_t AutoKvCacheBytes(bool cuda, int64_t free_bytes, int64_t models_left) {
  constexpr int64_t kDefault = int64_t{256} << 20;
  if (!cuda || free_bytes < 0) return kDefault;
  return free_bytes / 2 / std::max<int64_t>(models_left, 1);
}

int EngineKernelThreads() {
  std::atomic<uint64_t> seen{0};
  // More parts than threads, each its own grain: every thread of the team takes one part.
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << std::min(at::get_thread_num(), 63), std::memory_order_relaxed);
  });
  return std::popcount(seen.load());
}

}  // namespace imagegen
