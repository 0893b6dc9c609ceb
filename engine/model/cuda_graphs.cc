#include "engine/model/cuda_graphs.h"

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "engine/model/transfer.h"

#ifdef IMAGEGEN_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
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
  at::cuda::MempoolId_t pool{0, 0};
#endif
  ForwardGraphStats stats;
};

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
  c10::cuda::device_synchronize();
  {
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromExternal(cs.stream, dev.index());
    c10::cuda::CUDAStreamGuard guard(side);
    logits = gpt.StaticForward(e->upload, e->tokens, shape, cache);
    side.synchronize();
    if (g.pool.first == 0 && g.pool.second == 0) g.pool = at::cuda::graph_pool_handle();
    e->graph.capture_begin(g.pool, cudaStreamCaptureModeThreadLocal);
    try {
      e->out = gpt.StaticForward(e->upload, e->tokens, shape, cache);
    } catch (...) {
      // The capture stream serves every later capture on this device: end this capture before
      // the error goes up (Gpt::Forward reports it), so that it does not stay capturing.
      try {
        e->graph.capture_end();
      } catch (...) {  // an invalidated capture: ended all the same
      }
      throw;
    }
    e->graph.capture_end();
  }
  c10::cuda::device_synchronize();
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
