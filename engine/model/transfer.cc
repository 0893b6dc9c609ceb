#include "engine/model/transfer.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstring>
#include <string_view>

namespace imagegen {
namespace {

thread_local TransferCounts t_counts;
thread_local int t_in_helper = 0;  // > 0 inside Upload / ReadBack: their moves are counted there

struct HelperScope {
  HelperScope() { ++t_in_helper; }
  ~HelperScope() { --t_in_helper; }
};

template <typename T>
at::Tensor UploadVector(const std::vector<T>& v, at::ScalarType type, at::Device device) {
  const auto n = static_cast<int64_t>(v.size());
  auto opts = at::TensorOptions().dtype(type);
  if (device.is_cuda()) opts = opts.pinned_memory(true);
  at::Tensor host = at::empty({n}, opts);
  if (n > 0) std::memcpy(host.data_ptr(), v.data(), v.size() * sizeof(T));
  return Upload(host, device);
}

}  // namespace

const TransferCounts& ThreadTransfers() { return t_counts; }

at::Tensor Upload(const at::Tensor& host, at::Device device) {
  t_counts.uploads += 1;
  t_counts.upload_bytes += static_cast<int64_t>(host.nbytes());
  if (device.is_cpu()) return host;
  HelperScope scope;
  at::Tensor staged = host;
  if (!host.is_pinned()) {
    staged = at::empty(host.sizes(), host.options().pinned_memory(true));
    staged.copy_(host);
  }
  return staged.to(device, /*non_blocking=*/true);
}

at::Tensor UploadLongs(const std::vector<int64_t>& v, at::Device device) {
  return UploadVector(v, at::kLong, device);
}
at::Tensor UploadDoubles(const std::vector<double>& v, at::Device device) {
  return UploadVector(v, at::kDouble, device);
}
at::Tensor UploadFloats(const std::vector<float>& v, at::Device device) {
  return UploadVector(v, at::kFloat, device);
}

at::Tensor ReadBack(const at::Tensor& t) {
  t_counts.readbacks += 1;
  t_counts.readback_bytes += static_cast<int64_t>(t.nbytes());
  HelperScope scope;
  return t.to(at::kCPU).contiguous();
}

void SynchronizeDevice(at::Device device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl(device.type()).synchronizeDevice(device.index());
}

void MakeDeviceCurrent(at::Device device) {
  if (!device.is_cuda() || !device.has_index()) return;
  c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
}

// SyncWatch: a thread-local RecordFunction callback (a plain function: its state is
// thread-local too).
struct SyncWatch::State {
  int64_t syncing = 0, stray = 0;
  int64_t depth = 0;  // ATen calls in progress (nesting)
  std::vector<std::string> seen;
  at::CallbackHandle handle = 0;
};

namespace {

thread_local SyncWatch::State* t_watch = nullptr;

bool IsSyncing(std::string_view name) {
  static constexpr std::string_view kSyncing[] = {
      "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal",         "aten::nonzero",
      "aten::masked_select",       "aten::_unique",    "aten::_unique2",      "aten::unique_dim",
      "aten::unique_consecutive",  "aten::allclose",   "aten::_assert_async", "aten::is_set_to"};
  for (std::string_view s : kSyncing) {
    if (name == s) return true;
  }
  return false;
}

// A device move: to(device), to(other tensor), to(options with a device), cpu(), or copy_
// between tensors on different devices. Called by the caller's code (not `nested` in another
// ATen call), any to() naming a device counts, even the one the tensor is on: on the CPU every
// device is, and the watch must catch there the moves that would cross to a GPU. Inside
// LibTorch's own ops (`nested`) only a to() that changes the device counts: their composites
// convert dtypes with type_as (at::rms_norm's CPU path does), which names the same device.
bool IsMove(const at::RecordFunction& fn, bool nested) {
  const std::string_view name = fn.name();
  const std::string_view overload = fn.overload_name();
  const auto in = fn.inputs();
  if (name == "aten::to") {
    // The argument naming a device: to(device), to(other tensor), to(dtype, layout, device, ...).
    const size_t arg = overload == "device" || overload == "other" ? 1
                       : overload == "dtype_layout"                ? 3
                                                                   : 0;
    if (arg == 0 || in.size() <= arg || in[arg].isNone()) return false;
    if (!nested || !in[0].isTensor()) return true;
    const c10::IValue& target = in[arg];
    if (target.isTensor()) return target.toTensor().device() != in[0].toTensor().device();
    return !target.isDevice() || target.toDevice() != in[0].toTensor().device();
  }
  if (name == "aten::cpu" || name == "aten::cuda") return true;
  if (name == "aten::copy_" && in.size() >= 2 && in[0].isTensor() && in[1].isTensor()) {
    return in[0].toTensor().device() != in[1].toTensor().device();
  }
  return false;
}

std::unique_ptr<at::ObserverContext> OnCall(const at::RecordFunction& fn) {
  SyncWatch::State* w = t_watch;
  if (w == nullptr) return nullptr;
  const bool nested = w->depth > 0;
  w->depth += 1;  // OnCallEnd takes it back
  if (t_in_helper > 0) return nullptr;
  const std::string_view name = fn.name();
  bool hit = false;
  if (IsSyncing(name)) {
    w->syncing += 1;
    hit = true;
  } else if (IsMove(fn, nested)) {
    w->stray += 1;
    hit = true;
  }
  if (hit && w->seen.size() < 16) w->seen.emplace_back(name);
  return nullptr;
}

void OnCallEnd(const at::RecordFunction&, at::ObserverContext*) {
  SyncWatch::State* w = t_watch;
  if (w != nullptr && w->depth > 0) w->depth -= 1;
}

}  // namespace

SyncWatch::SyncWatch() : state_(std::make_unique<State>()) {
  TORCH_CHECK(t_watch == nullptr, "SyncWatch: one at a time per thread");
  t_watch = state_.get();
  state_->handle = at::addThreadLocalCallback(at::RecordFunctionCallback(&OnCall, &OnCallEnd)
                                                  .needsInputs(true)
                                                  .scopes({at::RecordScope::FUNCTION}));
}

SyncWatch::~SyncWatch() {
  at::removeCallback(state_->handle);
  t_watch = nullptr;
}

struct OpTrace::State {
  std::vector<std::string> calls;
  at::CallbackHandle handle = 0;
};

namespace {

thread_local OpTrace::State* t_trace = nullptr;

std::unique_ptr<at::ObserverContext> OnTracedCall(const at::RecordFunction& fn) {
  OpTrace::State* tr = t_trace;
  if (tr == nullptr) return nullptr;
  std::string line(fn.name());
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      line += " [";
      if (t.defined()) {
        for (int64_t d = 0; d < t.dim(); ++d)
          line += (d > 0 ? "," : "") + std::to_string(t.size(d));
      }
      line += "]";
    } else if (v.isInt()) {
      line += " " + std::to_string(v.toInt());
    } else if (v.isDouble()) {
      line += " " + std::to_string(v.toDouble());
    } else if (v.isIntList()) {
      line += " (";
      for (int64_t x : v.toIntVector()) line += std::to_string(x) + ",";
      line += ")";
    }
  }
  tr->calls.push_back(std::move(line));
  return nullptr;
}

}  // namespace

OpTrace::OpTrace() : state_(std::make_unique<State>()) {
  TORCH_CHECK(t_trace == nullptr, "OpTrace: one at a time per thread");
  t_trace = state_.get();
  state_->handle = at::addThreadLocalCallback(at::RecordFunctionCallback(&OnTracedCall)
                                                  .needsInputs(true)
                                                  .scopes({at::RecordScope::FUNCTION}));
}

OpTrace::~OpTrace() {
  at::removeCallback(state_->handle);
  t_trace = nullptr;
}

const std::vector<std::string>& OpTrace::calls() const { return state_->calls; }

struct LaunchCount::State {
  int64_t launches = 0;
  std::vector<char> inside;  // per open call: whether it or a caller was counted
  at::CallbackHandle handle = 0;
};

namespace {

thread_local LaunchCount::State* t_launches = nullptr;

// Calls that only make a tensor's metadata or allocate: no device work of their own.
bool IsMetadataOnly(std::string_view name) {
  // clang-format off
  static constexpr std::string_view kNoKernel[] = {
      "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::view_as",
      "aten::narrow", "aten::slice", "aten::select", "aten::as_strided", "aten::transpose",
      "aten::t", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::expand",
      "aten::expand_as", "aten::alias", "aten::detach", "aten::empty", "aten::empty_strided",
      "aten::empty_like", "aten::resize_", "aten::set_", "aten::contiguous", "aten::to",
      "aten::lift_fresh", "aten::flatten", "aten::unflatten", "aten::movedim", "aten::diagonal",
      "aten::split", "aten::unbind", "aten::chunk", "aten::split_with_sizes", "aten::result_type",
      "aten::size", "aten::stride", "aten::is_same_size", "aten::broadcast_tensors",
      "aten::unfold", "aten::_has_compatible_shallow_copy_type", "aten::type_as", "aten::numpy_T",
      "aten::mT", "aten::view_as_complex", "aten::view_as_real",
  };
  // clang-format on
  for (std::string_view s : kNoKernel) {
    if (name == s) return true;
  }
  return false;
}

std::unique_ptr<at::ObserverContext> OnLaunchStart(const at::RecordFunction& fn) {
  LaunchCount::State* c = t_launches;
  if (c == nullptr) return nullptr;
  const bool inside = !c->inside.empty() && c->inside.back() != 0;
  const bool counts = !inside && !IsMetadataOnly(fn.name());
  if (counts) c->launches += 1;
  c->inside.push_back(inside || counts ? 1 : 0);
  return nullptr;
}

void OnLaunchEnd(const at::RecordFunction&, at::ObserverContext*) {
  LaunchCount::State* c = t_launches;
  if (c != nullptr && !c->inside.empty()) c->inside.pop_back();
}

}  // namespace

LaunchCount::LaunchCount() : state_(std::make_unique<State>()) {
  TORCH_CHECK(t_launches == nullptr, "LaunchCount: one at a time per thread");
  t_launches = state_.get();
  state_->handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&OnLaunchStart, &OnLaunchEnd).scopes({at::RecordScope::FUNCTION}));
}

LaunchCount::~LaunchCount() {
  at::removeCallback(state_->handle);
  t_launches = nullptr;
}

int64_t LaunchCount::launches() const { return state_->launches; }

int64_t ThreadLaunches() { return t_launches != nullptr ? t_launches->launches : 0; }

int64_t SyncWatch::syncing_calls() const { return state_->syncing; }
int64_t SyncWatch::stray_moves() const { return state_->stray; }
std::vector<std::string> SyncWatch::seen() const { return state_->seen; }

}  // namespace imagegen
