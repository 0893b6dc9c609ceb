// CUDA graphs of the static-shape forward (ForwardOptions::cuda_graphs): each bucket's forward
// is captured once per cache and replayed for every later batch of that bucket, so that a
// step costs one graph launch instead of a few hundred kernel launches from the host (the GPU
// run found the forward launch-bound: about 0.55 ms of host time per layer, docs/results-gpu.md).
//
// A bucket's first forward runs eagerly (warming up cuBLAS and the allocator, and giving this
// step's logits), then is captured on a side stream into a memory pool shared by the cache's
// graphs (safe: they replay one at a time on one stream). A replay copies the step's upload
// and device tokens into the graph's static input buffers, replays, and returns a copy of the
// static output, which the next replay overwrites. The graphs hold the cache's tensors by
// address: they live in the cache (KvCache::graphs) and die with it.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/gpt.h"
#include "engine/util/status.h"

namespace imagegen {

// Counts of one cache's graphs (all zero without CUDA graphs). A bucket whose capture failed
// runs its forward eagerly from then on (capture_failures counts them; the step that failed
// still gets its logits, from the eager run that precedes every capture).
struct ForwardGraphStats {
  int64_t graphs = 0, captures = 0, replays = 0, capture_failures = 0;
  std::string last_failure;      // the last failed capture's error
  int64_t last_failure_seq = 0;  // when, in the process's order of failed captures (0: none)
  std::pair<uint64_t, uint64_t> last_failed_pool{0, 0};  // its memory pool (LibTorch's id)
};
ForwardGraphStats GraphStats(const KvCache& cache);

// The stream that graphs on `device` are captured on: outside LibTorch's stream pool, so that no
// other thread's current stream (OwnStream's are pooled) is ever the capturing one. Null before
// the first capture on that device, on the CPU, and in builds without LibTorch's CUDA libraries.
void* GraphCaptureStream(const at::Device& device);

// For tests (StaticForwardTest.AFailedCapture*): the next `n` captures in this process fail.
// kInvalidate: a stream sync inside the capture, which invalidates it as a syncing call in the
// forward would (cudaStreamEndCapture then fails); kThrow: an exception inside it that leaves
// the capture valid (as LibTorch's own checks throw, e.g. a copy from pageable memory). No-op in
// builds without LibTorch's CUDA libraries.
enum class CaptureFault { kInvalidate, kThrow };
void TestingFailNextCaptures(int n, CaptureFault how);

// The static forward of `gpt` over `cache` for a batch laid out as `host` (Gpt::StaticUpload)
// with device tokens padded to shape.tokens (undefined: none), through the bucket's graph.
// Logits [shape.tokens, vocab]. FailedPrecondition in builds without LibTorch's CUDA libraries.
StatusOr<at::Tensor> RunForwardGraph(const Gpt& gpt, KvCache& cache, const StaticShape& shape,
                                     const std::vector<int64_t>& host,
                                     const at::Tensor& device_tokens);

}  // namespace imagegen
