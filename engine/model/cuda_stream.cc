#include "engine/model/cuda_stream.h"

#ifdef IMAGEGEN_CUDA_GRAPHS
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

}  // namespace imagegen
