#include "engine/model/cuda_graphs.h"

#include <ATen/ATen.h>

#include <atomic>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "engine/model/transfer.h"

#ifdef IMAGEGEN_CUDA_GRAPHS
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace imagegen {

class ForwardGraphs {
 public:
#ifdef IMAGEGEN_CUDA_GRAPHS
  struct Entry {
    at::cuda::CUDAGraph graph;
    at::Tensor upload, tokens, out;  // static input buffers and the captured output
  };
  using Key = std::pair<StaticShape, bool>;  // the bucket, and whether tokens come on the device
  std::map<Key, std::unique_ptr<Entry>> entries;
  std::set<Key> eager;  // buckets whose capture failed: run eagerly from then on
  at::cuda::MempoolId_t pool{0, 0};
#endif
  ForwardGraphStats stats;
};

namespace {
std::atomic<int> g_failing_captures{0};  // TestingFailNextCaptures
std::atomic<bool> g_invalidate{true};
}  // namespace

void TestingFailNextCaptures(int n, CaptureFault how) {
  g_invalidate = how == CaptureFault::kInvalidate;
  g_failing_captures = n;
}

ForwardGraphStats GraphStats(const KvCache& cache) {
  if (!cache.graphs) return {};
  ForwardGraphStats s = cache.graphs->stats;
#ifdef IMAGEGEN_CUDA_GRAPHS
  s.graphs = static_cast<int64_t>(cache.graphs->entries.size());
#endif
  return s;
}

#ifdef IMAGEGEN_CUDA_GRAPHS

namespace {

// Captures run on a stream of their own, one per device, outside LibTorch's pool. The pool hands
// its 32 streams out in turn, so a pooled capture stream was sooner or later the decode thread's
// (OwnStream, decode_queue.h): that thread's next upload then failed ("Cannot copy between CPU
// and CUDA tensors during CUDA graph capture"), and its kernels would have been captured into
// the forward's graph. Seen on an H200 (the load bench with --cuda-graphs 1 at 4 clients: a
// request failed, then the process crashed). Created at the first capture, never destroyed (as
// LibTorch's own streams); captures on one device take turns (several engines, one per model).
struct CaptureStream {
  std::mutex mu;
  cudaStream_t stream = nullptr;
};

CaptureStream& CaptureStreamOf(c10::DeviceIndex index) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, std::unique_ptr<CaptureStream>> streams;
  std::lock_guard<std::mutex> l(mu);
  std::unique_ptr<CaptureStream>& s = streams[index];
  if (!s) s = std::make_unique<CaptureStream>();
  return *s;
}

std::atomic<int64_t> g_failure_seq{0};  // orders failed captures across caches

// What an exception says, without LibTorch's backtrace.
std::string ErrorText(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception of unknown type";
  }
}

// Ends a capture that failed, whichever way it failed, so that the capture stream (every later
// capture's on this device) is not left capturing and the allocators are not left recording
// into `pool`. capture_end ends the stream's capture even when it throws; but when the capture
// was invalidated (a syncing call inside it) it throws at cudaStreamEndCapture, before it ends
// the allocators' recording, and then every later capture_begin with the pool throws ("already
// recording to mempool_id") and the caching allocator stops releasing memory (it skips its
// events while a capture is underway). So end the recording too; each end throws if it was
// ended already (ignored). Where this ended it, capture_end did not get that far: the graph
// will not release its use of the pool when it dies, so release it here, or the pool's memory
// stays reserved for good.
void EndFailedCapture(at::cuda::CUDAGraph& graph, const at::Device& dev,
                      at::cuda::MempoolId_t pool) {
  try {
    graph.capture_end();
  } catch (...) {
  }
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(dev.index(), pool);
    c10::cuda::CUDACachingAllocator::releasePool(dev.index(), pool);
  } catch (...) {
  }
  try {
    at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool);
    at::getHostAllocator(at::kCUDA)->release_pool(pool);
  } catch (...) {
  }
  (void)cudaGetLastError();  // the failed launches' error, not for the next launch to find
}

}  // namespace

void* GraphCaptureStream(const at::Device& device) {
  if (!device.is_cuda()) return nullptr;
  CaptureStream& c = CaptureStreamOf(device.index());
  std::lock_guard<std::mutex> l(c.mu);
  return c.stream;
}

StatusOr<at::Tensor> RunForwardGraph(const Gpt& gpt, KvCache& cache, const StaticShape& shape,
                                     const std::vector<int64_t>& host,
                                     const at::Tensor& device_tokens) {
  if (!cache.graphs) cache.graphs = std::make_shared<ForwardGraphs>();
  ForwardGraphs& g = *cache.graphs;
  const at::Device dev = cache.k.at(0).device();
  const bool with_tokens = device_tokens.defined();
  const ForwardGraphs::Key key{shape, with_tokens};
  if (g.eager.count(key) != 0) {  // its capture failed once: the same forward, uncaptured
    return gpt.StaticForward(UploadLongs(host, dev), with_tokens ? device_tokens : at::Tensor(),
                             shape, cache);
  }
  auto it = g.entries.find(key);
  if (it != g.entries.end()) {
    ForwardGraphs::Entry& e = *it->second;
    e.upload.copy_(UploadLongs(host, dev));
    if (with_tokens) e.tokens.copy_(device_tokens);
    e.graph.replay();
    g.stats.replays += 1;
    return e.out.clone();
  }

  // First forward of this bucket: eagerly (this step's logits), then captured. Both on a side
  // stream, as LibTorch asks of captures (the eager run there also warms up what the capture
  // needs on that stream: cuBLAS's workspace, the allocator's blocks), with the device idle
  // before and after, so that nothing crosses between the streams. Capturing runs nothing:
  // the captured forward writes the cache only when replayed.
  auto e = std::make_unique<ForwardGraphs::Entry>();
  const auto lopt = at::TensorOptions().dtype(at::kLong).device(dev);
  e->upload = at::empty({shape.upload_size()}, lopt);
  e->upload.copy_(UploadLongs(host, dev));
  if (with_tokens) e->tokens = device_tokens.clone();
  at::Tensor logits;
  CaptureStream& cs = CaptureStreamOf(dev.index());
  std::lock_guard<std::mutex> turn(cs.mu);
  if (cs.stream == nullptr) {
    c10::cuda::CUDAGuard on(dev.index());
    const cudaError_t err = cudaStreamCreateWithFlags(&cs.stream, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      cs.stream = nullptr;
      return Internal(std::string("CUDA graphs: cannot create the capture stream: ") +
                      cudaGetErrorString(err));
    }
  }
  // The device's own index: c10::cuda::device_synchronize() would wait on the thread's current
  // device, which is not this one for --device cuda:1 unless something set it.
  SynchronizeDevice(dev);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(dev.index());
  bool captured = false;
  {
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromExternal(cs.stream, dev.index());
    c10::cuda::CUDAStreamGuard guard(side);
    logits = gpt.StaticForward(e->upload, e->tokens, shape, cache);
    // The logits' memory is the capture stream's and the caller reads it on its own stream: not
    // to be handed out again before that stream is past this step.
    logits.record_stream(caller);
    side.synchronize();
    if (g.pool.first == 0 && g.pool.second == 0) g.pool = at::cuda::graph_pool_handle();
    try {
      e->graph.capture_begin(g.pool, cudaStreamCaptureModeThreadLocal);
      if (g_failing_captures.load() > 0) {
        g_failing_captures -= 1;
        if (g_invalidate) C10_CUDA_CHECK(cudaStreamSynchronize(side.stream()));
        TORCH_CHECK(false, "a capture failed on purpose (TestingFailNextCaptures)");
      }
      e->out = gpt.StaticForward(e->upload, e->tokens, shape, cache);
      e->graph.capture_end();
      captured = true;
    } catch (...) {
      g.stats.last_failure = ErrorText(std::current_exception());
      g.stats.last_failure_seq = ++g_failure_seq;
      g.stats.last_failed_pool = g.pool;
      EndFailedCapture(e->graph, dev, g.pool);
      // Later captures take a new pool: after a failure its use count may be 0 already (a
      // cache's first capture: its graph releases the pool), and LibTorch asserts against
      // taking such a pool again.
      g.pool = {0, 0};
    }
  }
  SynchronizeDevice(dev);
  if (!captured) {
    // This step's logits came from the eager run before the capture (capturing runs nothing),
    // so the step goes on; the bucket runs eagerly from now on, counted in the stats.
    e.reset();
    g.eager.insert(key);
    g.stats.capture_failures += 1;
    return logits;
  }
  g.stats.captures += 1;
  g.entries.emplace(key, std::move(e));
  return logits;
}

#else

void* GraphCaptureStream(const at::Device&) { return nullptr; }

StatusOr<at::Tensor> RunForwardGraph(const Gpt&, KvCache&, const StaticShape&,
                                     const std::vector<int64_t>&, const at::Tensor&) {
  return FailedPrecondition(
      "CUDA graphs: this build does not link LibTorch's CUDA libraries "
      "(IMAGEGEN_TORCH_CPU_ONLY)");
}

#endif

}  // namespace imagegen
