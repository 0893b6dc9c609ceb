// Host <-> device traffic of the engine, in one place and counted.
//
// A decoding step builds small host arrays (indices, positions, Philox uniforms, sampling
// parameters) and reads its verdicts back once. On CUDA a copy from pageable host memory makes
// the host wait for the device's queue, so Upload stages through pinned memory and copies
// without blocking (LibTorch's caching host allocator keeps the staging block alive until the
// copy has run); ReadBack is the one blocking copy a step is allowed. Both count what they do
// per thread (ThreadTransfers), and SyncWatch catches the rest: ATen calls that make the host
// wait (item(), nonzero, masked_select, unique) and device moves that bypass these helpers.
// On the CPU the copies are no-ops, but the counts and the watch are the same, so that the
// host-sync budget is tested without a GPU (tests/host_sync_test.cc); on CUDA the test adds
// LibTorch's own sync debug mode.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace imagegen {

struct TransferCounts {
  int64_t uploads = 0, upload_bytes = 0;
  int64_t readbacks = 0, readback_bytes = 0;
};

// This thread's running totals (never reset; take differences).
const TransferCounts& ThreadTransfers();

// `host` (a CPU tensor) on `device`: the tensor itself on the CPU, else a non-blocking copy
// staged through pinned memory.
at::Tensor Upload(const at::Tensor& host, at::Device device);
at::Tensor UploadLongs(const std::vector<int64_t>& v, at::Device device);
at::Tensor UploadDoubles(const std::vector<double>& v, at::Device device);
at::Tensor UploadFloats(const std::vector<float>& v, at::Device device);

// `t` on the host, contiguous (a blocking copy when `t` is on a device).
at::Tensor ReadBack(const at::Tensor& t);

// Waits until the device has finished its queued work (no-op on the CPU). Profiling only.
void SynchronizeDevice(at::Device device);

// Makes `device` the calling thread's current device (for a CUDA device with an index; no-op
// otherwise). A kernel launched on a device's default stream (a null cudaStream_t, which is
// what CurrentCudaStream gives for it) runs on the thread's current device, whatever the
// tensors': the engine thread sets its device once (--device cuda:1), and imagegen's launch
// sites hold a c10::DeviceGuard besides, for callers that did not.
void MakeDeviceCurrent(at::Device device);

// Counts, on the constructing thread and while it lives, the ATen calls that would make the
// host wait for a CUDA device: reads of a scalar (item, is_nonzero, equal), ops whose output
// size depends on the data (nonzero, masked_select, unique), and .to(device) / .cpu() calls made
// outside Upload and ReadBack. One at a time per thread; tests and benchmarks only (it
// installs a RecordFunction callback, which slows every ATen call a little).
class SyncWatch {
 public:
  SyncWatch();
  ~SyncWatch();
  SyncWatch(const SyncWatch&) = delete;
  SyncWatch& operator=(const SyncWatch&) = delete;

  int64_t syncing_calls() const;          // item, nonzero, ...
  int64_t stray_moves() const;            // device moves outside the helpers
  std::vector<std::string> seen() const;  // the first few offending ATen names

  struct State;  // the callback's view of it (transfer.cc)

 private:
  std::unique_ptr<State> state_;
};

// Counts, on the constructing thread and while it lives, the ATen calls that would launch device
// work: each outermost call that is not a view, an allocation or another metadata-only call
// (view, narrow, select, transpose, empty, a to() that converts nothing, ...), and none of the
// calls it makes (linear counts once, not as its matmul and add). An estimate of a CUDA step's
// kernel launches taken on any device: a CUDA op may launch more than one kernel, and a
// composite op may split differently there. The host cost of launching a step's work eagerly is
// about this count times a few microseconds, whatever the tensors' sizes. One at a time per
// thread; benchmarks and tests only (it installs a RecordFunction callback).
class LaunchCount {
 public:
  LaunchCount();
  ~LaunchCount();
  LaunchCount(const LaunchCount&) = delete;
  LaunchCount& operator=(const LaunchCount&) = delete;

  int64_t launches() const;
  struct State;

 private:
  std::unique_ptr<State> state_;
};

// The running count of this thread's LaunchCount, 0 without one (take differences).
int64_t ThreadLaunches();

// Records, on the constructing thread and while it lives, every ATen call (nested ones too) as
// its name, the shapes of its tensor inputs and its integer and floating-point arguments, e.g.
// "aten::narrow [64] 0 16 16". A CUDA graph replays the calls it captured with the shapes and
// scalars they had, so a forward whose trace differs between two inputs cannot be captured
// once for both (tests/static_forward_test.cc). One at a time per thread; tests only.
class OpTrace {
 public:
  OpTrace();
  ~OpTrace();
  OpTrace(const OpTrace&) = delete;
  OpTrace& operator=(const OpTrace&) = delete;

  const std::vector<std::string>& calls() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace imagegen
