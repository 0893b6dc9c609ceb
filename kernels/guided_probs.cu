#include <cuda_runtime.h>

#include "kernels/guided_probs.h"

namespace imagegen::kernels {
namespace {

// One block per output row, one thread per chunk: every thread takes its chunk's max, then its
// sum, then writes it; thread 0 combines the chunks' maxima and sums (GuidedProbsRowOnHost,
// with the chunk loops run by the block).
__global__ void __launch_bounds__(kChainVerifyChunks) GuidedProbsKernel(GuidedProbsArgs a) {
  __shared__ float maxima[kChainVerifyChunks];
  __shared__ double sums[kChainVerifyChunks];
  __shared__ float s_max;
  __shared__ double s_total;
  const auto r = static_cast<int64_t>(blockIdx.x);
  const int t = static_cast<int>(threadIdx.x);
  maxima[t] = GuidedChunkMax(a, r, t);
  __syncthreads();
  if (t == 0) {
    float m = -INFINITY;
    for (int c = 0; c < kChainVerifyChunks; ++c) {
      if (maxima[c] > m) m = maxima[c];
    }
    s_max = m;
  }
  __syncthreads();
  const float m = s_max;
  sums[t] = GuidedChunkSum(a, r, t, m);
  __syncthreads();
  if (t == 0) s_total = ChainTotal(sums);
  __syncthreads();
  GuidedChunkWrite(a, r, t, m, s_total);
}

}  // namespace

int LaunchGuidedProbs(const GuidedProbsArgs& args, void* stream) {
  if (args.rows <= 0) return 0;
  GuidedProbsKernel<<<static_cast<unsigned>(args.rows), kChainVerifyChunks, 0,
                      static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace imagegen::kernels
