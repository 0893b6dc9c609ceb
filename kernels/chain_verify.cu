#include <cuda_runtime.h>

#include "kernels/chain_verify.h"

namespace imagegen::kernels {
namespace {

// One block per node, one thread per chunk: every thread sums its chunk, thread 0 adds the
// chunk sums and draws (ChainVerifyNodeOnHost, with the chunk loop run by the block).
__global__ void __launch_bounds__(kChainVerifyChunks) ChainVerifyKernel(ChainVerifyArgs a) {
  __shared__ double sums[kChainVerifyChunks];
  __shared__ double s_qsum, s_total;
  const auto n = static_cast<int64_t>(blockIdx.x);
  const int t = static_cast<int>(threadIdx.x);
  const ChainNode nd = LoadChainNode(a, n);  // the same for every thread of the block
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
  if (t == 0) ChainFinish(a, n, nd, qsum, ChainDraw(nd, m, qsum, sums, s_total, a.ures[n]));
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
