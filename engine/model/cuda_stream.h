// A thread's own CUDA stream, for work that should overlap the engine thread's forwards (the
// decode thread's VQ decoding, decode_queue.h). No-op on the CPU and in builds without
// LibTorch's CUDA libraries.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>

namespace imagegen {

// While alive, the calling thread's current stream on `device` is one of LibTorch's pooled
// streams instead of the default one. Tensors it makes must not be read on another stream
// without a sync (hand results to other threads as host data).
class OwnStream {
 public:
  explicit OwnStream(const c10::Device& device);
  ~OwnStream();
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;

 private:
  struct Guard;
  std::unique_ptr<Guard> guard_;
};

// The calling thread's current CUDA stream on `device` as a cudaStream_t, for launching
// imagegen's own kernels (kernels/) where LibTorch's work goes; null on the CPU and in builds
// without LibTorch's CUDA libraries.
void* CurrentCudaStream(const c10::Device& device);

// What model of processor `device` is, for keys of measurements that do not carry over to
// another one (the step-cost calibration): a CUDA device's name ("NVIDIA H200"), or the host
// CPU's model name from /proc/cpuinfo for the CPU; empty when unknown (a CUDA device in a build
// without LibTorch's CUDA libraries, a host without /proc).
std::string DeviceModelName(const c10::Device& device);

// The bytes a CUDA device can still give this process: the driver's free memory, and what
// LibTorch's caching allocator holds without using it. -1 on the CPU, in builds without
// LibTorch's CUDA libraries, and when the driver does not say.
int64_t DeviceFreeBytes(const c10::Device& device);

}  // namespace imagegen
