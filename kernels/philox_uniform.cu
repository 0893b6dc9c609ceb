#include "kernels/philox_uniform.h"

#include <cuda_runtime.h>

#include "kernels/philox_rounds.h"

namespace imagegen::kernels {
namespace {

__global__ void PhiloxUniformKernel(const uint64_t* seeds, const uint32_t* positions,
                                    const uint32_t* indices, uint32_t iteration, uint32_t purpose,
                                    double* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    out[i] = PhiloxUniform(seeds[i], positions[i], iteration, purpose, indices[i]);
  }
}

}  // namespace

int LaunchPhiloxUniform(const uint64_t* seeds, const uint32_t* positions, const uint32_t* indices,
                        uint32_t iteration, uint32_t purpose, double* out, int64_t n,
                        void* stream) {
  if (n <= 0) return 0;
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  PhiloxUniformKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      seeds, positions, indices, iteration, purpose, out, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace imagegen::kernels
