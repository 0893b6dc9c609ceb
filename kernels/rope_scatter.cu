#include <cuda_runtime.h>

#include "kernels/rope_scatter.h"

namespace imagegen::kernels {
namespace {

constexpr int kThreads = 256;

// One thread per unit (token, head, pair): RopeScatterOnHost's loop, spread over the grid.
__global__ void __launch_bounds__(kThreads) RopeScatterKernel(RopeScatterArgs a, int64_t units) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (u < units) RopeScatterUnit(a, u);
}

}  // namespace

int LaunchRopeScatter(const RopeScatterArgs& args, void* stream) {
  const int64_t units = RopeScatterUnits(args);
  if (units <= 0) return 0;
  const auto blocks = static_cast<unsigned>((units + kThreads - 1) / kThreads);
  RopeScatterKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args, units);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace imagegen::kernels
