#include "engine/model/cuda_stream.h"

#include <fstream>

#ifdef IMAGEGEN_CUDA_GRAPHS
#include <ATen/cuda/CUDAContext.h>
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
#else
struct OwnStream::Guard {};

OwnStream::OwnStream(const c10::Device&) {}

void* CurrentCudaStream(const c10::Device&) { return nullptr; }
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
