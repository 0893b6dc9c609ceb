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
  if (t == 0) ChainGroupAdd(a, n, nd, nd.x[0], &num, &den);
  for (int d = 0; d < 2; ++d) {
    const bool up = d == 1;
    __syncthreads();  // every thread has read s_at (the last walk's end)
    if (t == 0) s_at = nd.x[0];
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

// ChainVerifyNodeWith's Block on the device: one thread per chunk, thread 0 adds the chunk sums
// (left to right, as the host), draws and writes.
struct DeviceBlock {
  double* sums;  // shared, one per thread
  double* total;
  int64_t* token;
  double* ckeys;  // shared, kChainMaxKids per thread
  int64_t* cids;
  int t;
  __device__ int ChunkBegin() const { return t; }
  __device__ int ChunkStep() const { return kChainVerifyChunks; }
  __device__ void Barrier() const { __syncthreads(); }
  __device__ double Sum(const ChainNode& nd, const ChainMassSpec& m) {
    __syncthreads();  // the last pass's sums and total have been read
    sums[t] = ChainChunkSum(nd, m, t);
    __syncthreads();
    if (t == 0) *total = ChainTotal(sums);
    __syncthreads();
    return *total;
  }
  __device__ bool Leader() const { return t == 0; }
  __device__ int64_t Share(int64_t v) {
    if (t == 0) *token = v;
    __syncthreads();
    const int64_t r = *token;
    __syncthreads();
    return r;
  }
};

// One block per node, one thread per chunk (ChainVerifyNodeOnHost, with the chunk loop run by
// the block).
__global__ void __launch_bounds__(kChainVerifyChunks) ChainVerifyKernel(ChainVerifyArgs a) {
  __shared__ double sums[kChainVerifyChunks];
  __shared__ double s_total;
  __shared__ int64_t s_token;
  __shared__ double ckeys[kChainVerifyChunks * kChainMaxKids];
  __shared__ int64_t cids[kChainVerifyChunks * kChainMaxKids];
  const auto n = static_cast<int64_t>(blockIdx.x);
  const int t = static_cast<int>(threadIdx.x);
  ChainNode nd = LoadChainNode(a, n);  // the same for every thread of the block
  const double grouped = ChainIsGrouped(a, n, nd) ? GroupedRatio(a, n, nd, t) : -1.0;
  DeviceBlock b{sums, &s_total, &s_token, ckeys, cids, t};
  ChainVerifyNodeWith(a, n, nd, grouped, b);
}

}  // namespace

int LaunchChainVerify(const ChainVerifyArgs& args, void* stream) {
  if (args.nodes <= 0) return 0;
  ChainVerifyKernel<<<static_cast<unsigned>(args.nodes), kChainVerifyChunks, 0,
                      static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace imagegen::kernels
