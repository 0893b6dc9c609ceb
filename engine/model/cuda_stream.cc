#include "engine/model/cuda_stream.h"

#include <algorithm>
#include <fstream>

#ifdef IMAGEGEN_CUDA_GRAPHS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace imagegen {

#ifdef IMAGEGEN_CUDA_GRAPHS
struct OwnStream::Guard {
  explicit Guard(c10::cuda::CUDAStream s) : guard(s) {}
  c10::cuda::CUDAStreamGuard guard;  // sets the device and the stream, restores both
};

OwnStream::OwnStream(const c10::Device& device) {
  if (!device.is_cuda()) return;
  guard_ = std::make_unique<Guard>(c10::cuda::getStreamFromPool(false, device.index()));
}

void* CurrentCudaStream(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

int64_t DeviceFreeBytes(const c10::Device& device) {
  if (!device.is_cuda()) return -1;
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  c10::cuda::CUDAGuard on(index);
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  constexpr size_t kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t cached = stats.reserved_bytes[kAll].current - stats.allocated_bytes[kAll].current;
  return static_cast<int64_t>(free) + std::max<int64_t>(cached, 0);
}
#else
struct OwnStream::Guard {};

OwnStream::OwnStream(const c10::Device&) {}

void* CurrentCudaStream(const c10::Device&) { return nullptr; }

int64_t DeviceFreeBytes(const c10::Device&) { return -1; }
#endif

OwnStream::~OwnStream() = default;

std::string DeviceModelName(const c10::Device& device) {
  if (device.is_cuda()) {
#ifdef IMAGEGEN_CUDA_GRAPHS
    const c10::DeviceIndex index =
        device.has_index() ? device.index() : c10::cuda::current_device();
    return at::cuda::getDeviceProperties(index)->name;
#else
    return "";
#endif
  }
  if (!device.is_cpu()) return "";
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) return "";
    const size_t begin = line.find_first_not_of(" \t", colon + 1);
    return begin == std::string::npos ? "" : line.substr(begin);
  }
  return "";
}

}  // namespace imagegen
