#include <cuda_runtime.h>

#include "kernels/chain_verify.h"

namespace imagegen::kernels {
namespace {

// A GSD node's cluster ratio, as ChainGroupedRatioOnHost: every thread finds its chunk's nearest
// id, thread 0 the nearest of those and adds its masses. The ratio is thread 0's; the call is
// made by the whole block (uniform: it depends on the node only).
__device__ double GroupedRatio(const ChainVerifyArgs& a, int64_t n, const ChainNode& nd, int t) {
  __shared__ int64_t cand[kChainVerifyChunks];
  __shared__ int64_t s_at;
  double num = 0.0, den = 0.0;
  if (t == 0) ChainGroupAdd(a, n, nd, nd.x, &num, &den);
  for (int d = 0; d < 2; ++d) {
    const bool up = d == 1;
    __syncthreads();  // every thread has read s_at (the last walk's end)
    if (t == 0) s_at = nd.x;
    __syncthreads();
    for (int64_t s = 0; s < ChainGroupSteps(a, n, up); ++s) {
      const int64_t at = s_at;
      cand[t] = ChainChunkNeighbour(nd, t, at, up);
      __syncthreads();
      if (t == 0) {
        const int64_t j = ChainNearest(nd, at, cand, up);
        if (j >= 0) ChainGroupAdd(a, n, nd, j, &num, &den);
        s_at = j;
      }
      __syncthreads();
      if (s_at < 0) break;  // the row's end (uniform)
    }
  }
  return ChainGroupRatio(num, den);
}

// One block per node, one thread per chunk: every thread sums its chunk, thread 0 adds the
// chunk sums and draws (ChainVerifyNodeOnHost, with the chunk loop run by the block).
__global__ void __launch_bounds__(kChainVerifyChunks) ChainVerifyKernel(ChainVerifyArgs a) {
  __shared__ double sums[kChainVerifyChunks];
  __shared__ double s_qsum, s_total;
  const auto n = static_cast<int64_t>(blockIdx.x);
  const int t = static_cast<int>(threadIdx.x);
  const ChainNode nd = LoadChainNode(a, n);  // the same for every thread of the block
  const double grouped = ChainIsGrouped(a, n, nd) ? GroupedRatio(a, n, nd, t) : -1.0;
  double qsum = 0.0;
  if (nd.x >= 0) {
    sums[t] = ChainChunkSum(nd, ChainMass::kQ, 0, t);
    __syncthreads();
    if (t == 0) s_qsum = ChainTotal(sums);
    __syncthreads();
    qsum = s_qsum;
  }
  ChainMass m = nd.x >= 0 ? ChainMass::kResidual : ChainMass::kP;
  sums[t] = ChainChunkSum(nd, m, qsum, t);
  __syncthreads();
  if (t == 0) s_total = ChainTotal(sums);
  __syncthreads();
  if (m == ChainMass::kResidual && !(s_total > 0)) {  // uniform across the block
    m = ChainMass::kP;
    __syncthreads();  // every thread has read s_total
    sums[t] = ChainChunkSum(nd, m, qsum, t);
    __syncthreads();
    if (t == 0) s_total = ChainTotal(sums);
    __syncthreads();
  }
  if (t == 0) {
    ChainFinish(a, n, nd, qsum, ChainDraw(nd, m, qsum, sums, s_total, a.ures[n]), grouped);
  }
  if (a.ufresh != nullptr) {  // the next draft, from p (whose sums the block may have already)
    if (m != ChainMass::kP) {
      __syncthreads();  // thread 0 has drawn from the residual's sums
      sums[t] = ChainChunkSum(nd, ChainMass::kP, 0, t);
      __syncthreads();
      if (t == 0) s_total = ChainTotal(sums);
      __syncthreads();
    }
    if (t == 0) ChainFresh(a, n, ChainDraw(nd, ChainMass::kP, 0, sums, s_total, a.ufresh[n]));
  }
}

}  // namespace

int LaunchChainVerify(const ChainVerifyArgs& args, void* stream) {
  if (args.nodes <= 0) return 0;
  ChainVerifyKernel<<<static_cast<unsigned>(args.nodes), kChainVerifyChunks, 0,
                      static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace imagegen::kernels
