// Where a stretch of device work spends its time, kernel by kernel, from LibTorch's own
// profiler (Kineto; on CUDA its kernel records come from CUPTI, which also reports the kernels
// a CUDA graph replays). A diagnostic for the GPU sessions (docs/gpu.md): the graphed forward
// of a GPT-B-shaped model runs about 250 kernels in 1.15 ms on an H200, 28x its weight-read
// limit, and what to fuse next (GEMMs, attention, or the small kernels between them) depends on
// how that time divides. On the CPU the same summary is of the outermost ATen ops (there is no
// device activity), which is what CI exercises.
//
//   KernelProfile p(device);   // starts the profiler
//   ... the work, n times ...
//   KernelSummary s = p.Stop(n);  // per repetition
#pragma once

#include <ATen/ATen.h>
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace imagegen {

// The class of a kernel (or, on the CPU, an ATen op) by its name: "gemm", "attention", "norm",
// "memory" (copies, gathers, scatters, fills) or "other" (elementwise and reductions).
inline std::string KernelClass(const std::string& raw) {
  if (raw.rfind("aten::", 0) == 0) {  // a CPU op: by its exact name
    static const std::map<std::string, std::string> kOps = {
        {"aten::linear", "gemm"},         {"aten::addmm", "gemm"},
        {"aten::addmm_", "gemm"},         {"aten::mm", "gemm"},
        {"aten::matmul", "gemm"},         {"aten::bmm", "gemm"},
        {"aten::baddbmm", "gemm"},        {"aten::scaled_dot_product_attention", "attention"},
        {"aten::rms_norm", "norm"},       {"aten::layer_norm", "norm"},
        {"aten::index_select", "memory"}, {"aten::index_copy_", "memory"},
        {"aten::index_copy", "memory"},   {"aten::index_put_", "memory"},
        {"aten::index", "memory"},        {"aten::copy_", "memory"},
        {"aten::to", "memory"},           {"aten::_to_copy", "memory"},
        {"aten::clone", "memory"},        {"aten::contiguous", "memory"},
        {"aten::cat", "memory"},          {"aten::zeros", "memory"},
        {"aten::fill_", "memory"},        {"aten::zero_", "memory"},
        {"aten::embedding", "memory"},
    };
    auto it = kOps.find(raw);
    return it == kOps.end() ? "other" : it->second;
  }
  std::string n = raw;  // a device kernel: by what its name contains
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  auto has = [&](std::initializer_list<const char*> keys) {
    for (const char* k : keys) {
      if (n.find(k) != std::string::npos) return true;
    }
    return false;
  };
  if (has({"attention", "fmha", "flash", "sdpa", "attn"})) return "attention";
  if (has({"gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk"})) return "gemm";
  if (has({"norm"})) return "norm";
  if (has({"memcpy", "memset", "copy", "index", "gather", "scatter", "fill", "catarray"})) {
    return "memory";
  }
  return "other";
}

struct KernelStat {
  std::string name;
  std::string cls;
  double count = 0;  // per repetition
  double us = 0;     // per repetition
};

struct KernelSummary {
  bool device = false;   // kernels on a device (CUDA), or the CPU's outermost ATen ops
  double kernels = 0;    // per repetition
  double kernel_us = 0;  // their summed durations, per repetition
  double busy_us = 0;    // the union of their intervals, per repetition
  double span_us = 0;    // first start to last end over all repetitions, per repetition
  std::map<std::string, double> class_us;  // per repetition
  std::map<std::string, double> class_count;
  std::vector<KernelStat> by_name;  // most time first

  // One line: kernels, their time and its classes, and how busy the device was over the span.
  std::string Line() const {
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  "%s: %.1f a rep, %.1f us (busy %.1f of a %.1f us span, %.0f%%); gemm %.1f us "
                  "(%.0f), attention %.1f (%.0f), norm %.1f (%.0f), memory %.1f (%.0f), other "
                  "%.1f (%.0f)",
                  device ? "kernels" : "CPU ops (outermost)", kernels, kernel_us, busy_us, span_us,
                  span_us > 0 ? 100 * busy_us / span_us : 0.0, Us("gemm"), Count("gemm"),
                  Us("attention"), Count("attention"), Us("norm"), Count("norm"), Us("memory"),
                  Count("memory"), Us("other"), Count("other"));
    return buf;
  }
  // CSV columns, the same in every bench that writes them: header, then a row's fields.
  static const char* CsvHeader() {
    return "kernels,kernel_us,busy_us,span_us,gemm_us,attention_us,norm_us,memory_us,other_us";
  }
  std::string CsvFields() const {
    std::ostringstream o;
    o << kernels << "," << kernel_us << "," << busy_us << "," << span_us << "," << Us("gemm") << ","
      << Us("attention") << "," << Us("norm") << "," << Us("memory") << "," << Us("other");
    return o.str();
  }
  double Us(const std::string& c) const {
    auto it = class_us.find(c);
    return it == class_us.end() ? 0 : it->second;
  }
  double Count(const std::string& c) const {
    auto it = class_count.find(c);
    return it == class_count.end() ? 0 : it->second;
  }
};

// An interval of work: on a device every kernel, memcpy and memset; on the CPU every ATen op
// not nested in another one on the same thread.
struct KernelInterval {
  std::string name;
  uint64_t thread = 0;
  uint64_t start_ns = 0, end_ns = 0;
};

// The summary of intervals recorded over `reps` repetitions (pure: unit-tested on its own).
inline KernelSummary SummarizeKernels(std::vector<KernelInterval> iv, bool device, int64_t reps) {
  KernelSummary s;
  s.device = device;
  const double per = 1.0 / static_cast<double>(std::max<int64_t>(reps, 1));
  if (!device) {  // keep the outermost op of each nest, per thread
    std::sort(iv.begin(), iv.end(), [](const KernelInterval& a, const KernelInterval& b) {
      if (a.thread != b.thread) return a.thread < b.thread;
      if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
      return a.end_ns > b.end_ns;
    });
    std::vector<KernelInterval> top;
    for (const KernelInterval& k : iv) {
      if (!top.empty() && top.back().thread == k.thread && k.start_ns < top.back().end_ns) continue;
      top.push_back(k);
    }
    iv.swap(top);
  }
  std::sort(iv.begin(), iv.end(), [](const KernelInterval& a, const KernelInterval& b) {
    return a.start_ns < b.start_ns;
  });
  std::map<std::string, KernelStat> names;
  uint64_t busy = 0, cur_start = 0, cur_end = 0, first = 0, last = 0;
  bool open = false;
  for (const KernelInterval& k : iv) {
    const double us = static_cast<double>(k.end_ns - k.start_ns) / 1e3;
    KernelStat& st = names[k.name];
    st.name = k.name;
    st.cls = KernelClass(k.name);
    st.count += per;
    st.us += us * per;
    s.kernels += per;
    s.kernel_us += us * per;
    s.class_us[st.cls] += us * per;
    s.class_count[st.cls] += per;
    if (!open) {
      first = k.start_ns;
      cur_start = k.start_ns;
      cur_end = k.end_ns;
      open = true;
    } else if (k.start_ns > cur_end) {
      busy += cur_end - cur_start;
      cur_start = k.start_ns;
      cur_end = k.end_ns;
    } else {
      cur_end = std::max(cur_end, k.end_ns);
    }
    last = std::max(last, k.end_ns);
  }
  if (open) busy += cur_end - cur_start;
  s.busy_us = static_cast<double>(busy) / 1e3 * per;
  s.span_us = open ? static_cast<double>(last - first) / 1e3 * per : 0;
  for (auto& [name, st] : names) s.by_name.push_back(st);
  std::sort(s.by_name.begin(), s.by_name.end(),
            [](const KernelStat& a, const KernelStat& b) { return a.us > b.us; });
  return s;
}

class KernelProfile {
 public:
  explicit KernelProfile(const c10::Device& device) : device_(device.is_cuda()) {
    namespace tp = torch::profiler::impl;
    const tp::ProfilerConfig cfg(tp::ProfilerState::KINETO);
    // On a device its activity alone: recording every ATen op on the host too would slow the
    // host, and widen the gaps between kernels that the summary measures.
    const std::set<tp::ActivityType> acts{device_ ? tp::ActivityType::CUDA : tp::ActivityType::CPU};
    torch::autograd::profiler::prepareProfiler(cfg, acts);
    torch::autograd::profiler::enableProfiler(cfg, acts);
  }
  KernelProfile(const KernelProfile&) = delete;
  KernelProfile& operator=(const KernelProfile&) = delete;
  ~KernelProfile() {
    if (!stopped_) torch::autograd::profiler::disableProfiler();
  }

  // Stops the profiler (synchronise the device first) and summarises `reps` repetitions.
  KernelSummary Stop(int64_t reps) {
    stopped_ = true;
    std::unique_ptr<torch::autograd::profiler::ProfilerResult> r =
        torch::autograd::profiler::disableProfiler();
    std::vector<KernelInterval> iv;
    using libkineto::ActivityType;
    for (const auto& e : r->events()) {
      const bool on_device = e.deviceType() != c10::DeviceType::CPU;
      if (on_device != device_ || e.endNs() <= e.startNs()) continue;
      // On a device: kernels, copies and fills only (not annotations, syncs or events).
      const auto type = static_cast<ActivityType>(e.activityType());
      if (device_ && type != ActivityType::CONCURRENT_KERNEL && type != ActivityType::GPU_MEMCPY &&
          type != ActivityType::GPU_MEMSET) {
        continue;
      }
      // On the CPU: ATen ops only (not the profiler's own or user scopes).
      if (!device_ && e.name().rfind("aten::", 0) != 0) continue;
      iv.push_back({e.name(), e.startThreadId(), e.startNs(), e.endNs()});
    }
    return SummarizeKernels(std::move(iv), device_, reps);
  }

 private:
  bool device_;
  bool stopped_ = false;
};

// The summary and its `top` longest kernels, one a line, prefixed.
inline void PrintKernelSummary(const KernelSummary& s, size_t top, const char* prefix) {
  std::printf("%s%s\n", prefix, s.Line().c_str());
  for (size_t i = 0; i < std::min(top, s.by_name.size()); ++i) {
    const KernelStat& k = s.by_name[i];
    std::string name = k.name.size() > 110 ? k.name.substr(0, 107) + "..." : k.name;
    std::printf("%s  %8.1f us %6.1f x  %-9s %s\n", prefix, k.us, k.count, k.cls.c_str(),
                name.c_str());
  }
}

}  // namespace imagegen
