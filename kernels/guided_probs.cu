#include <cuda_runtime.h>

#include "kernels/guided_probs.h"

namespace imagegen::kernels {
namespace {

constexpr int kWarps = kChainVerifyChunks / 32;

// One block per output row, one thread per chunk: every thread takes its chunk's max, its
// counts for the radix select, its sum, then writes it; the block combines the chunks' maxima,
// counts and sums (GuidedProbsRowOnHost, with the chunk loops run by the block). Counts are
// integers, added in any order; the sums are added by thread 0 in the host's order.
__global__ void __launch_bounds__(kChainVerifyChunks) GuidedProbsKernel(GuidedProbsArgs a) {
  __shared__ float maxima[kChainVerifyChunks];
  __shared__ double sums[kChainVerifyChunks];
  __shared__ long long counts[kWarps];
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
  float kth = -INFINITY;
  const int64_t k = GuidedTopK(a, r);
  if (k < a.vocab) {  // uniform across the block
    uint32_t prefix = 0;
    for (int bit = 31; bit >= 0; --bit) {
      long long n = GuidedChunkCount(a, r, t, prefix | (1U << bit));
      for (int off = 16; off > 0; off /= 2) n += __shfl_down_sync(0xFFFFFFFFU, n, off);
      if (t % 32 == 0) counts[t / 32] = n;
      __syncthreads();
      long long total = 0;
      for (int w = 0; w < kWarps; ++w) total += counts[w];
      prefix = GuidedSelectStep(prefix, bit, total, k);
      __syncthreads();  // every thread has read the counts before the next round writes them
    }
    kth = GuidedFromKey(prefix);
  }
  sums[t] = GuidedChunkSum(a, r, t, m, kth);
  __syncthreads();
  if (t == 0) s_total = ChainTotal(sums);
  __syncthreads();
  GuidedChunkWrite(a, r, t, m, kth, s_total);
}

}  // namespace

int LaunchGuidedProbs(const GuidedProbsArgs& args, void* stream) {
  if (args.rows <= 0) return 0;
  GuidedProbsKernel<<<static_cast<unsigned>(args.rows), kChainVerifyChunks, 0,
                      static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace imagegen::kernels
