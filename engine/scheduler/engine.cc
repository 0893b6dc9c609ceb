#include "engine/scheduler/engine.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "engine/decoding/fused_kernels.h"
#include "engine/decoding/speculative.h"
#include "engine/model/amx_gemm.h"
#include "engine/model/cuda_stream.h"
#include "engine/model/device.h"
#include "engine/model/image_model.h"
#include "engine/model/mar_model.h"
#include "engine/model/small_gemm.h"
#include "engine/model/transfer.h"
#include "engine/scheduler/mar_scheduler.h"
#include "engine/scheduler/model_scheduler.h"
#include "engine/util/cpu_idle.h"
#include "engine/util/cpu_quota.h"
#include "engine/util/read_file.h"

namespace imagegen {
namespace {

int64_t CacheBytesPerSlot(const Gpt& g) {
  const GptConfig& c = g.config();
  return 2 * c.n_layer * c.seq_len() * c.dim *
         static_cast<int64_t>(c10::elementSize(g.options().dtype));
}

// The error of a waiting request that gave up its place in a full queue.
Status ShedStatus(ShedReason reason) {
  return ResourceExhausted(
      reason == ShedReason::kPriority
          ? "queue full: this request gave up its place to one of higher priority"
          : "queue full: this request gave up its place to another client's (fair share: its "
            "client or API key had the most requests waiting)");
}

// Forwards steps to the engine's listener, except the warm-up's, which it only counts.
// Called on the engine thread only.
class WarmupGate : public EngineListener {
 public:
  explicit WarmupGate(EngineListener* target) : target_(target) {}
  void OnStep(const StepSample& s) override {
    if (!warming) {
      if (served) served(s);
      if (target_ != nullptr) target_->OnStep(s);
      return;
    }
    steps += 1;
    captures += s.graph_captures;
    capture_failures += s.graph_capture_failures;
    if (target_ != nullptr) {
      try {
        target_->OnWarmupStep(s);
      } catch (...) {  // as NotifyListener: a listener cannot end the engine thread
      }
    }
  }
  bool warming = false;
  int64_t steps = 0, captures = 0, capture_failures = 0;
  // Sees each served step first (the thread governor); may be empty.
  std::function<void(const StepSample&)> served;

 private:
  EngineListener* target_;
};

// Waits for the warm-up's requests: how many ended, and the first error.
class WarmupObserver : public RequestObserver {
 public:
  void OnStep(const StepEvent&) override {}
  void OnComplete(RequestResult) override { End(OkStatus()); }
  void OnError(const Status& s) override { End(s); }
  // The first error once `n` requests ended; DeadlineExceeded past `limit`.
  Status Wait(int64_t n, std::chrono::seconds limit) {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, limit, [&] { return ended_ >= n; })) {
      return DeadlineExceeded("warm-up: " + std::to_string(n - ended_) + " of " +
                              std::to_string(n) + " requests did not end within " +
                              std::to_string(limit.count()) + " s");
    }
    return first_error_;
  }

 private:
  void End(const Status& s) {
    std::lock_guard<std::mutex> l(mu_);
    if (first_error_.ok() && !s.ok()) first_error_ = s;
    ended_ += 1;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t ended_ = 0;
  Status first_error_;
};

// LibTorch keeps one intra-op thread count per process: at::set_num_threads stores it for every
// thread, and each thread's first parallel op (ATen's own, and again the engine's kernels', whose
// parallel_for is compiled here) sets that thread to the stored count. Two live engines with
// different EngineOptions::cpu_threads would therefore change each other's threads, by the order
// their threads happen to run. The live engines' nonzero count (one at a time) is held here, and
// an engine that asks for another count is refused while they run.
class CpuThreadsClaim {
 public:
  static StatusOr<std::unique_ptr<CpuThreadsClaim>> Take(int64_t threads) {
    State& st = state();
    std::lock_guard<std::mutex> l(st.mu);
    if (st.engines > 0 && st.count != threads) {
      return InvalidArgument("cpu_threads: " + std::to_string(threads) +
                             ", but another engine in this process runs with " +
                             std::to_string(st.count) +
                             " (LibTorch keeps one intra-op thread count per process)");
    }
    st.count = threads;
    st.engines += 1;
    return std::unique_ptr<CpuThreadsClaim>(new CpuThreadsClaim);
  }
  ~CpuThreadsClaim() {
    std::lock_guard<std::mutex> l(state().mu);
    state().engines -= 1;
  }
  CpuThreadsClaim(const CpuThreadsClaim&) = delete;
  CpuThreadsClaim& operator=(const CpuThreadsClaim&) = delete;

 private:
  CpuThreadsClaim() = default;
  // The live engines' one count (meaningful while engines > 0) and how many hold it.
  struct State {
    std::mutex mu;
    int64_t count = 0;
    int64_t engines = 0;
  };
  static State& state() {
    static auto* s = new State;
    return *s;
  }
};

// What a GPT computes at the calling thread's intra-op count, on fixed inputs: its logits for
// batches of 1 to 256 new tokens in rows of up to a window each from empty slots, then for a
// few tokens more per row over those entries (the cached attention).
void ProbeGpt(const Gpt& g, bool batch_invariant, std::vector<at::Tensor>& out) {
  const GptConfig& c = g.config();
  std::mt19937_64 rng(20261207);
  const int64_t per_row = std::max<int64_t>(c.block_size - 3, 1);  // room for 3 more after
  for (const int64_t total : {1, 2, 5, 16, 37, 64, 131, 256}) {
    const int64_t rows = (total + per_row - 1) / per_row;
    KvCache cache = g.NewCache(rows);
    std::vector<BatchRow> batch;
    for (int64_t r = 0, left = total; r < rows; ++r) {
      BatchRow row;
      row.slot = r;
      row.prefix = 1;
      const int64_t n = std::min(left, per_row);
      left -= n;
      for (int64_t i = 0; i < n; ++i) {
        row.tokens.push_back(i == 0 ? 0 : static_cast<int64_t>(rng() % c.vocab_size));
        row.positions.push_back(i);
      }
      batch.push_back(std::move(row));
    }
    ForwardOptions f;
    f.batch_invariant = batch_invariant;
    StatusOr<at::Tensor> first = g.Forward(batch, cache, at::Tensor(), f);
    if (!first.ok()) continue;  // the same at every count
    out.push_back(first->clone());
    for (BatchRow& row : batch) {
      row.cache_len = static_cast<int64_t>(row.tokens.size());
      const int64_t more = 1 + row.slot % 3;
      row.tokens.clear();
      row.positions.clear();
      for (int64_t i = 0; i < more; ++i) {
        row.tokens.push_back(static_cast<int64_t>(rng() % c.vocab_size));
        row.positions.push_back(row.cache_len + i);
      }
    }
    StatusOr<at::Tensor> next = g.Forward(batch, cache, at::Tensor(), f);
    if (next.ok()) out.push_back(next->clone());
  }
}

// A model's outputs at the calling thread's intra-op count on fixed inputs (ProbeGpt; a MAR's
// encoder and decoder at 1 and 3 images, its diffusion head's network, the draft's, and the
// decoders' pixels), for SetUpThreadGovernor to compare bit for bit.
std::vector<at::Tensor> ThreadProbe(const ImageModel* gpt, const MarModel* mar,
                                    bool batch_invariant) {
  std::vector<at::Tensor> out;
  if (gpt != nullptr) {
    ProbeGpt(*gpt->gpt, batch_invariant, out);
    if (gpt->draft) ProbeGpt(*gpt->draft, batch_invariant, out);
    const GptConfig& c = gpt->gpt->config();
    std::mt19937_64 rng(7);
    std::vector<int32_t> grid(static_cast<size_t>(c.grid() * c.grid()));
    for (int32_t& t : grid) t = static_cast<int32_t>(rng() % c.vocab_size);
    StatusOr<at::Tensor> pixels = TokensToPixels(*gpt->vq, grid);
    if (pixels.ok()) out.push_back(pixels->clone());
  }
  if (mar != nullptr) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(20261207);
    for (const Mar* m : {mar->mar.get(), mar->draft.get()}) {
      if (m == nullptr) continue;
      const MarConfig& c = m->config();
      for (const int64_t b : {1, 3}) {
        at::Tensor tokens = at::randn({b, c.seq_len(), c.token_dim()}, gen).to(m->options());
        at::Tensor known = at::rand({b, c.seq_len()}, gen) < 0.5;
        at::Tensor labels = at::arange(b, at::kLong).remainder(c.class_num + 1);
        StatusOr<at::Tensor> z = m->Forward(tokens, known, labels);
        if (!z.ok()) continue;
        out.push_back(z->clone());
        const int64_t n = b * c.seq_len();
        at::Tensor x = at::randn({n, c.token_dim()}, gen).to(m->options());
        at::Tensor t = at::arange(n, at::kLong).remainder(std::max<int64_t>(m->head().steps(), 1));
        out.push_back(m->head().Net(x, t, z->reshape({n, -1})).clone());
      }
    }
    const MarConfig& c = mar->mar->config();
    at::Tensor tokens = at::randn({1, c.seq_len(), c.token_dim()}, gen).to(mar->mar->options());
    StatusOr<at::Tensor> pixels = LatentsToPixels(*mar, tokens);
    if (pixels.ok()) out.push_back(pixels->clone());
  }
  return out;
}

bool SameBits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes() || a[i].scalar_type() != b[i].scalar_type()) return false;
    // Bit for bit: the raw bytes (equal() would take -0 for 0 and fail on NaN).
    const at::Tensor x = a[i].contiguous().cpu(), y = b[i].contiguous().cpu();
    if (std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) return false;
  }
  return true;
}

}  // namespace

uint64_t RandomSeed() {
  std::random_device rd;
  const uint64_t hi = rd(), lo = rd();
  return ((hi << 32) | lo) >> 1;
}

struct Engine::Impl {
  // Held until the engine's threads are gone (the last member destroyed): its cpu_threads.
  std::unique_ptr<CpuThreadsClaim> threads_claim;
  EngineOptions opts;
  EngineListener* listener = nullptr;
  // The schedulers' listener: `listener`, but not during the warm-up.
  std::unique_ptr<WarmupGate> gate;
  // The decode queue's counts after the warm-up (EngineStats leaves the warm-up out).
  int64_t warm_completed = 0, warm_decode_batches = 0, warm_batch_decoded = 0;
  // One per served model, in EngineOptions::models order: a discrete-token model (gpt) or a
  // continuous-token one (mar).
  struct Served {
    std::string name;
    std::unique_ptr<ImageModel> gpt;
    std::unique_ptr<MarModel> mar;
  };
  std::vector<Served> models;
  std::vector<ModelInfo> infos;
  // After the models: destroyed (its thread joined) before them.
  std::unique_ptr<DecodeQueue> decoder;
  std::vector<std::unique_ptr<FamilyScheduler>> schedulers;

  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<size_t, std::unique_ptr<Job>>> inbox;  // (model index, job)
  std::unordered_set<int64_t> cancels;
  std::vector<int64_t> inbox_per_model;
  // Per model, for a full queue's choice (wait_queue.h, Displace): the waiting requests by
  // class as of the last round, the arrivals since, and the waiting requests chosen to give
  // up their place that the engine thread has not ended yet (each counts as gone).
  std::vector<WaitCensus> census, inbox_census;
  std::vector<std::vector<Shed>> shed;
  int64_t Queued(size_t mi) const {
    return stats.models[mi].queued + inbox_per_model[mi] - static_cast<int64_t>(shed[mi].size());
  }
  EngineStats stats;  // counters, and loads as of the last round
  // Progress (Engine::Progress): the end of the engine thread's last round, or the moment it
  // was woken or handed work while asleep; and whether it sleeps now.
  Clock::time_point beat = Clock::now();
  bool sleeping = false;
  bool draining = false;
  Clock::time_point grace_end = Clock::time_point::max();
  int64_t next_id = 1;
  std::thread thread;
  std::once_flag joined;

  StatusOr<std::unique_ptr<Job>> Resolve(GenerateParams p, size_t* model_index) const;
  StatusOr<std::unique_ptr<Job>> ResolveMar(GenerateParams p, const MarModel& m) const;
  Status Load();
  Status LoadMar(const std::string& name, const LoadOptions& lo);
  // EngineOptions::adaptive_cpu_threads, after the models are loaded: the counts whose outputs
  // match the engine's own count's bit for bit, and the governor over them (null: off).
  void SetUpThreadGovernor(const LoadOptions& lo);
  // Each served step, on the engine thread: the governor's count for the next one.
  void GovernThreads(const StepSample& s);
  std::unique_ptr<ThreadGovernor> governor;
  const Clock::time_point governor_epoch = Clock::now();
  // While the count is lowered: the idle CPUs beside the engine, read at most every
  // kIdleReadSeconds (a try starts early once they would hold its threads).
  std::unique_ptr<CpuIdleMeter> idle_meter;
  double idle_read_at = 0;
  int64_t idle_tries_said = 0, reverted_said = 0;
  static constexpr double kIdleReadSeconds = 0.25;
  // EngineOptions::warmup, after the models are loaded.
  Status WarmUp();
  // One warm-up load: a closed loop of n clients of `method` on model `mi`, for 2n images.
  // `next` numbers the warm-up's requests across loads.
  Status WarmUpLoad(size_t mi, const std::string& method, int64_t n, int64_t& next);
  void Run();
  // What Run does when an exception escapes model `mi`'s Tick: a notice, and the model's
  // requests, queued and active, end with INTERNAL; the engine goes on. Best effort: the
  // scheduler's state is whatever the exception left (a request already handed to the decode
  // queue may hear both its image and this error), which beats ending the process.
  void EndModelAfterEscape(size_t mi, const std::string& what, Outcomes& out);
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() { Shutdown(std::chrono::milliseconds(0)); }

StatusOr<std::unique_ptr<Engine>> Engine::Start(const EngineOptions& options,
                                                EngineListener* listener) {
  auto impl = std::make_unique<Impl>();
  impl->opts = options;
  impl->listener = listener;
  impl->gate = std::make_unique<WarmupGate>(listener);
  EngineOptions& o = impl->opts;
  if (o.models.empty()) o.models = {"fmnist-gpt"};
  // Every request waits in the queue before its first round, so 0 would refuse them all.
  if (o.max_queue < 1) return InvalidArgument("max_queue: must be >= 1");
  if (o.max_slots < 2) return InvalidArgument("max_slots: must be >= 2");
  if (o.kv_cache_bytes == 0 || o.kv_cache_bytes < -1) {
    return InvalidArgument("kv_cache_bytes: must be -1 (by device) or > 0");
  }
  if (o.lone_request_max_window < kLoneWindowFromCalibration) {
    return InvalidArgument(
        "lone_request_max_window: must be -2 (by the step-cost calibration), -1 (by device), 0 "
        "(none) or >= 1");
  }
  if (o.max_tokens_per_step != 0 && o.max_tokens_per_step != -1 && o.max_tokens_per_step < 2) {
    return InvalidArgument("max_tokens_per_step: must be -1 (by device), 0 (no budget) or >= 2");
  }
  if (o.admission != "fair" && o.admission != "fifo") {
    return InvalidArgument("admission: must be fair or fifo, got '" + o.admission.substr(0, 64) +
                           "'");
  }
  if (o.window_policy != "goodput" && o.window_policy != "budget" && o.window_policy != "full") {
    return InvalidArgument("window_policy: must be goodput, budget or full, got '" +
                           o.window_policy.substr(0, 64) + "'");
  }
  if (o.matmul_precision != "highest" && o.matmul_precision != "medium") {
    return InvalidArgument("matmul_precision: must be highest or medium, got '" +
                           o.matmul_precision.substr(0, 64) + "'");
  }
  if (!(o.max_slowdown >= 0 && o.max_slowdown <= 100)) {
    return InvalidArgument("max_slowdown: must be in [0, 100]");
  }
  if (o.commit_warmup_steps < 0) return InvalidArgument("commit_warmup_steps: must be >= 0");
  if (o.explore_every < 0) return InvalidArgument("explore_every: must be >= 0");
  if (!(o.explore_budget >= 0)) return InvalidArgument("explore_budget: must be >= 0");
  if (!(o.fail_steps_for_seconds >= 0)) {
    return InvalidArgument("fail_steps_for_seconds: must be >= 0 (0: off)");
  }
  if (!(o.window_stickiness >= 0 && o.window_stickiness <= 1)) {
    return InvalidArgument("window_stickiness: must be in [0, 1]");
  }
  if (!(o.min_speculation_gain >= 0 && o.min_speculation_gain <= 1)) {
    return InvalidArgument("min_speculation_gain: must be in [0, 1]");
  }
  if (!(o.simulated_step_noise >= 0 && o.simulated_step_noise <= 10)) {
    return InvalidArgument("simulated_step_noise: must be in [0, 10]");
  }
  if (!(o.simulated_capture_cost >= 0 && o.simulated_capture_cost <= 1000)) {
    return InvalidArgument("simulated_capture_cost: must be in [0, 1000]");
  }
  if (!(o.step_cost_max_ratio == 0 ||
        (o.step_cost_max_ratio >= 1 && o.step_cost_max_ratio <= 1000))) {
    return InvalidArgument("step_cost_max_ratio: must be 0 (unbounded) or in [1, 1000]");
  }
  if (!(o.step_cost_spot_check == 0 ||
        (o.step_cost_spot_check >= 1.5 && o.step_cost_spot_check <= 1000))) {
    return InvalidArgument("step_cost_spot_check: must be 0 (off) or in [1.5, 1000]");
  }
  if (!(o.simulated_tree_cost >= 0 && o.simulated_tree_cost <= 1)) {
    return InvalidArgument("simulated_tree_cost: must be in [0, 1] seconds");
  }
  if (!o.fixed_step_cost.empty() &&
      (o.fixed_step_cost.size() != 3 || !(o.fixed_step_cost[0] > 0) ||
       !(o.fixed_step_cost[1] >= 0) || !(o.fixed_step_cost[2] >= 0) ||
       !std::isfinite(o.fixed_step_cost[0] + o.fixed_step_cost[1] + o.fixed_step_cost[2]))) {
    return InvalidArgument(
        "fixed_step_cost: must be empty or {base > 0, per_token >= 0, per_request >= 0}");
  }
  if (o.cpu_threads < 0) return InvalidArgument("cpu_threads: must be >= 0");
  if (o.cpu_threads == 0) {
    // LibTorch's count follows the CPUs this process may run on, not its cgroup's CPU quota. A
    // count capped by the quota is claimed as a set one would be, unless another live engine
    // holds another count: an engine left at 0 is never refused.
    const int64_t threads = at::get_num_threads();
    const std::optional<CpuQuota> q = ReadCpuQuota();
    if (const int64_t capped = q ? ThreadsUnderQuota(threads, q->cpus) : threads;
        capped < threads) {
      std::ostringstream msg;
      msg << "cpu_threads: " << capped << ", by the CPU quota (" << q->cpus << " CPUs, " << q->file
          << "), not LibTorch's " << threads;
      StatusOr<std::unique_ptr<CpuThreadsClaim>> claim = CpuThreadsClaim::Take(capped);
      if (claim.ok()) {
        impl->threads_claim = std::move(*claim);
        o.cpu_threads = capped;
      } else {
        msg << ": not taken, " << claim.status().message();
      }
      Notice(o, msg.str());
    }
  } else {
    StatusOr<std::unique_ptr<CpuThreadsClaim>> claim = CpuThreadsClaim::Take(o.cpu_threads);
    if (!claim.ok()) return claim.status();
    impl->threads_claim = std::move(*claim);
  }
  if (o.adaptive_cpu_threads < -1 || o.adaptive_cpu_threads > 1) {
    return InvalidArgument("adaptive_cpu_threads: must be -1 (by device), 0 or 1");
  }
  {
    ThreadGovernorOptions g = o.cpu_thread_governor;
    if (g.counts.empty()) g.counts = {1};  // filled at start
    if (const std::string bad = ValidateThreadGovernorOptions(g); !bad.empty()) {
      return InvalidArgument("cpu_thread_governor: " + bad);
    }
  }
  if (!(o.preview_share >= 0 && o.preview_share <= 1)) {
    return InvalidArgument("preview_share: must be in [0, 1]");
  }
  if (o.decode_thread < -1 || o.decode_thread > 1) {
    return InvalidArgument("decode_thread: must be -1 (by device), 0 or 1");
  }
  if (o.decode_batch != -1 && (o.decode_batch < 1 || o.decode_batch > 256)) {
    return InvalidArgument("decode_batch: must be -1 (by forward) or in [1, 256]");
  }
  if (o.cpu_linear != "blas" && o.cpu_linear != "engine") {
    return InvalidArgument("cpu_linear: must be blas or engine, got '" +
                           o.cpu_linear.substr(0, 64) + "'");
  }
  if (o.small_rows_gemm_rows < -1) {
    return InvalidArgument(
        "small_rows_gemm_rows: must be -1 (fewer than 16 rows only), 0 (timed at load) or a "
        "row count");
  }
  if (o.cuda_graphs < -1 || o.cuda_graphs > 1) {
    return InvalidArgument("cuda_graphs: must be -1 (by device), 0 or 1");
  }
  if (o.warmup < -1 || o.warmup > 1) {
    return InvalidArgument("warmup: must be -1 (with CUDA graphs), 0 or 1");
  }
  for (const std::string& m : o.warmup_methods) {
    if (!PolicyFromPreset(m).ok()) {
      return InvalidArgument("warmup_methods: unknown method '" + m.substr(0, 64) + "'");
    }
  }
  for (int64_t c : o.warmup_concurrency) {
    if (c < 1 || c > 4096) {
      return InvalidArgument("warmup_concurrency: each must be in [1, 4096], got " +
                             std::to_string(c));
    }
  }
  // Every LibTorch call, loading included, happens on the engine thread (see EngineOptions).
  std::promise<Status> loaded;
  Impl* raw = impl.get();
  impl->thread = std::thread([raw, &loaded] {
    if (raw->opts.cpu_threads > 0) at::set_num_threads(static_cast<int>(raw->opts.cpu_threads));
    Status st;
    try {
      st = raw->Load();
    } catch (const std::exception& e) {
      st = Internal(std::string("loading failed: ") + e.what());
    }
    const bool ok = st.ok();
    loaded.set_value(std::move(st));
    if (ok) raw->Run();
    // Every finished request gets its OnComplete before Shutdown returns.
    if (raw->decoder) raw->decoder->Stop();
  });
  Status st = loaded.get_future().get();
  if (!st.ok()) {
    impl->thread.join();
    return st;
  }
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Status Engine::Impl::Load() {
  ASSIGN_OR_RETURN(LoadOptions lo, ParseDeviceAndDtype(opts.device, opts.dtype));
  lo.row_attention = opts.row_attention;
  lo.small_rows_gemm = opts.small_rows_gemm;
  lo.small_rows_gemm_rows = opts.small_rows_gemm_rows;
  lo.fused_norm_rope = opts.fused_norm_rope;
  if (opts.cpu_linear == "engine") {
    if (!lo.device.is_cpu() || lo.dtype != at::kFloat) {
      Notice(opts, "cpu_linear engine applies to the CPU in fp32; the products stay as " +
                       opts.dtype + " on " + opts.device + " computes them");
    } else if (!opts.small_rows_gemm || !SmallRowsLinear::Supported()) {
      Notice(opts, std::string("cpu_linear engine: ") +
                       (opts.small_rows_gemm ? "the kernel needs an x86-64 CPU with AVX2 and FMA"
                                             : "small_rows_gemm is off") +
                       "; the products stay the BLAS's");
    } else {
      lo.engine_linear = true;
    }
  }
  if (opts.matmul_precision == "medium") {
    if (!lo.device.is_cpu() || lo.dtype != at::kFloat) {
      Notice(opts, "matmul precision medium applies to the CPU in fp32; products stay as " +
                       opts.dtype + " on " + opts.device + " computes them");
    } else if (!AmxBf16Linear::Supported()) {
      Notice(opts, "matmul precision medium: " + AmxBf16Linear::Unsupported() +
                       "; the products stay fp32");
    } else {
      lo.bf16_matmul = true;
    }
  }
  // Every LibTorch call of this engine is on this thread: its current device is the engine's.
  MakeDeviceCurrent(lo.device);
  if (std::string why; lo.device.is_cuda() && KernelsBuilt() && !KernelsRunHere(&why)) {
    Notice(opts, "fused kernels off: " + why +
                     "; steps take the eager path (the same tokens, in "
                     "more launches)");
  }
  if (opts.max_tokens_per_step < 0) {
    opts.max_tokens_per_step = opts.window_policy == "goodput" ? 4096
                               : lo.device.is_cuda()           ? 2048
                                                               : 256;
  }
  if (opts.cuda_graphs < 0) opts.cuda_graphs = lo.device.is_cuda() ? 1 : 0;
  if (opts.lone_request_max_window == -1) {
    opts.lone_request_max_window = lo.device.is_cuda() ? 0 : kLoneWindowFromCalibration;
  }
  if (opts.warmup < 0) opts.warmup = opts.cuda_graphs;
  const EngineOptions& o = opts;
  const bool decode_thread = o.decode_thread < 0 ? lo.device.is_cuda() : o.decode_thread > 0;
  if (opts.decode_batch < 0) {
    opts.decode_batch = opts.cuda_graphs > 0 || !opts.batch_invariant ? 16 : 1;
  }
  decoder = std::make_unique<DecodeQueue>(decode_thread, lo.device, o.cpu_threads, o.decode_batch);
  // The few-row kernel's rows as an earlier start on this processor timed them, kept beside the
  // step-cost calibration: every start then gives the kernel the same rows, and the cached
  // calibration stays the one measured with them (the timing can choose anywhere from 32 to 256
  // rows between starts of a noisy machine where the kernel and the BLAS are close).
  std::string rows_path;
  std::vector<SmallRowsChoice> remembered;
  if (!o.cache_dir.empty() && lo.device.is_cpu() && lo.dtype == at::kFloat && o.small_rows_gemm &&
      o.small_rows_gemm_rows == 0 && !lo.engine_linear && !lo.bf16_matmul &&
      SmallRowsLinear::Supported()) {
    rows_path = o.cache_dir + "/few-row-kernel-" + FileSafe(DeviceModelName(lo.device)) + ".json";
    if (StatusOr<std::string> text = ReadFile(rows_path); text.ok()) {
      StatusOr<std::vector<SmallRowsChoice>> read = ParseSmallRowsChoices(*text, rows_path);
      if (read.ok()) {
        remembered = std::move(*read);
        SmallRowsLinear::RememberRows(remembered);
      } else {
        Notice(o, "the few-row kernel's rows are timed again: " + read.status().ToString());
      }
    }
  }
  for (const std::string& name : o.models) {
    for (const auto& m : models) {
      if (m.name == name) return InvalidArgument("models: '" + name + "' is listed twice");
    }
    ASSIGN_OR_RETURN(std::string type, ModelType(o.models_dir, name));
    if (type == "mar") {
      RETURN_IF_ERROR(LoadMar(name, lo));
      continue;
    }
    ASSIGN_OR_RETURN(ImageModel m, LoadImageModel(o.models_dir, name, lo, /*with_draft=*/true));
    auto model = std::make_unique<ImageModel>(std::move(m));
    const GptConfig& c = model->gpt->config();
    int64_t per_slot = CacheBytesPerSlot(*model->gpt);
    if (model->draft) per_slot += CacheBytesPerSlot(*model->draft);
    // The static-shape forward (cuda_graphs) writes its padding into one more slot, a scratch
    // slot no request holds: it comes out of the same memory.
    const int64_t scratch = o.cuda_graphs > 0 ? 1 : 0;
    const int64_t models_left =
        static_cast<int64_t>(o.models.size()) - static_cast<int64_t>(schedulers.size());
    const int64_t kv_bytes =
        o.kv_cache_bytes > 0
            ? o.kv_cache_bytes
            : AutoKvCacheBytes(lo.device.is_cuda(), DeviceFreeBytes(lo.device), models_left);
    const int64_t slots = std::min(o.max_slots, kv_bytes / per_slot - scratch);
    if (slots < 2) {
      return InvalidArgument("kv_cache_bytes: " + std::to_string(kv_bytes) +
                             " bytes hold fewer than the 2 slots of one CFG request of model '" +
                             name + "' (" + std::to_string(per_slot) + " bytes per slot" +
                             (scratch ? ", and one scratch slot with cuda_graphs)" : ")"));
    }
    std::unique_ptr<ModelScheduler> sched;
    try {
      sched = std::make_unique<ModelScheduler>(*model, slots, opts, *decoder, gate.get());
    } catch (const std::exception& e) {
      return ResourceExhausted("KV cache of model '" + name + "' (" + std::to_string(slots) +
                               " slots): " + e.what());
    }
    RETURN_IF_ERROR(sched->Calibrate(lo));
    schedulers.push_back(std::move(sched));
    ModelInfo info;
    info.name = name;
    info.grid = c.grid();
    info.vocab_size = c.vocab_size;
    info.num_classes = c.num_classes;
    info.class_names = c.class_names;
    const VqConfig& vc = model->vq->config();
    info.image_width = info.image_height = vc.image_size;
    info.channels = vc.out_channels;
    info.draft_model = model->draft ? c.draft_model : "";
    for (const std::string& preset : PresetNames()) {
      StatusOr<DecodingPolicy> p = PolicyFromPreset(preset);
      if (p.ok() && ValidatePolicy(*p, c.block_size, model->draft != nullptr).ok()) {
        info.methods.push_back(preset);
      }
    }
    info.sampling_defaults = {c.default_cfg_scale, c.default_temperature, c.default_top_k,
                              c.default_top_p};
    info.max_window = c.block_size;
    info.kv_slots = slots;
    if (c.prompted()) {
      info.prompted = true;
      info.max_prompt_len = c.max_prompt_len;
      info.text_vocab_size = c.text_vocab_size;
      info.prompt_template = c.prompt_template;
      if (!c.text_tokenizer.empty()) {
        info.text_tokenizer_path =
            (std::filesystem::path(o.models_dir) / name / c.text_tokenizer).string();
      }
    }
    infos.push_back(info);
    stats.models.push_back({name, 0, 0, 0, slots, 0, ""});
    models.push_back({name, std::move(model), nullptr});
  }
  if (!rows_path.empty()) {
    if (const std::vector<SmallRowsChoice> now = SmallRowsLinear::MeasuredRows();
        now != remembered) {
      std::error_code ec;
      std::filesystem::create_directories(o.cache_dir, ec);
      if (Status st = WriteFileAtomically(rows_path, SerializeSmallRowsChoices(now)); !st.ok()) {
        Notice(o, "the few-row kernel's rows are not kept: " + st.ToString());
      }
    }
  }
  inbox_per_model.assign(models.size(), 0);
  census.assign(models.size(), {});
  inbox_census.assign(models.size(), {});
  shed.assign(models.size(), {});
  SetUpThreadGovernor(lo);
  return opts.warmup > 0 ? WarmUp() : OkStatus();
}

void Engine::Impl::SetUpThreadGovernor(const LoadOptions& lo) {
  const int own = at::get_num_threads();
  stats.cpu_threads = stats.cpu_threads_max = lo.device.is_cpu() ? own : 0;
  const bool on =
      opts.adaptive_cpu_threads < 0 ? lo.device.is_cpu() : opts.adaptive_cpu_threads > 0;
  if (!on) return;
  if (!lo.device.is_cpu()) {
    Notice(opts, "adaptive cpu threads: off on " + opts.device + " (the CPU's threads only)");
    return;
  }
  ThreadGovernorOptions g = opts.cpu_thread_governor;
  std::vector<int> wanted = g.counts.empty() ? HalvingThreadCounts(own) : g.counts;
  if (wanted.empty() || wanted.front() != own) wanted.insert(wanted.begin(), own);
  if (wanted.size() < 2) return;  // one thread: nothing to lower
  // Each count's outputs against the engine's own count's, bit for bit: a count whose
  // products split their sums differently would draw other images under load.
  const auto t0 = Clock::now();
  auto probe = [&] {
    std::vector<at::Tensor> out;
    for (const Served& m : models) {
      std::vector<at::Tensor> o = ThreadProbe(m.gpt.get(), m.mar.get(), opts.batch_invariant);
      out.insert(out.end(), o.begin(), o.end());
    }
    return out;
  };
  const std::vector<at::Tensor> reference = probe();
  g.counts = {own};
  std::string differ;
  for (size_t i = 1; i < wanted.size(); ++i) {
    if (wanted[i] >= g.counts.back() || wanted[i] < 1) continue;
    at::set_num_threads(wanted[i]);
    if (SameBits(probe(), reference)) {
      g.counts.push_back(wanted[i]);
    } else {
      differ += (differ.empty() ? "" : ", ") + std::to_string(wanted[i]);
    }
  }
  at::set_num_threads(own);
  const double checked = std::chrono::duration<double>(Clock::now() - t0).count();
  std::ostringstream msg;
  msg.precision(2);
  if (g.counts.size() < 2) {
    msg << "adaptive cpu threads: off, the outputs at " << differ
        << " threads differ from those at " << own << " (checked in " << checked << " s)";
    Notice(opts, msg.str());
    return;
  }
  // Start validated the other fields; the counts here are descending and >= 1 by construction.
  msg << "cpu threads follow the CPU they get: ";
  for (size_t i = 0; i < g.counts.size(); ++i) msg << (i ? ", " : "") << g.counts[i];
  msg << " (the same outputs bit for bit at each, checked in " << checked << " s";
  if (!differ.empty()) msg << "; not " << differ << ", whose outputs differ";
  msg << "), lowered while the engine thread waits for a CPU " << g.lower_share
      << " of its step time";
  Notice(opts, msg.str());
  governor = std::make_unique<ThreadGovernor>(std::move(g));
  idle_meter = opts.proc_stat_path.empty() ? std::make_unique<CpuIdleMeter>()
                                           : std::make_unique<CpuIdleMeter>(opts.proc_stat_path);
  gate->served = [this](const StepSample& s) { GovernThreads(s); };
}

void Engine::Impl::GovernThreads(const StepSample& s) {
  const int before = governor->threads();
  const double now = std::chrono::duration<double>(Clock::now() - governor_epoch).count();
  double idle = -1;
  if (before < governor->max_threads() && now - idle_read_at >= kIdleReadSeconds) {
    idle = idle_meter->IdleCpusSinceLastCall(now).value_or(-1);
    idle_read_at = now;
  }
  const int after =
      governor->Observe(s.seconds, s.cpu_wait_seconds, now, idle, s.calibrated_seconds);
  if (after == before) return;
  at::set_num_threads(after);
  // The next reading starts here: idle time at the count before is not this count's.
  idle_meter->IdleCpusSinceLastCall(now);
  idle_read_at = now;
  std::ostringstream msg;
  msg.precision(2);
  msg << "cpu threads " << before << " -> " << after << ": ";
  if (governor->reverted() > reverted_said) {
    reverted_said = governor->reverted();
    msg << before << (before == 1 ? " thread" : " threads") << " did not pay: its steps took "
        << governor->last_slowness() << "x their calibrated time, against "
        << governor->slowness_before() << "x at " << after << "; no lowering for "
        << std::llround(governor->no_lowering_until() - now) << " s";
  } else if (governor->trying()) {
    msg << "trying " << after << " again";
    if (governor->idle_tries() > idle_tries_said) {
      msg << " (" << governor->window_idle() << " of its CPUs sat idle over its last window)";
    }
    idle_tries_said = governor->idle_tries();
  } else {
    msg << "the engine thread waited for a CPU " << governor->last_share()
        << " of its step time (other work on its cores)";
  }
  Notice(opts, msg.str());
}

Status Engine::Impl::WarmUp() {
  const auto t0 = Clock::now();
  gate->warming = true;
  int64_t images = 0, next = 0;
  Status failed;
  for (size_t mi = 0; mi < models.size() && failed.ok(); ++mi) {
    if (!models[mi].gpt) continue;  // continuous-token models capture no graphs
    const ModelInfo& info = infos[mi];
    std::vector<int64_t> counts;  // at most half the slots (a CFG request takes two), no repeats
    for (int64_t n : opts.warmup_concurrency) {
      n = std::max<int64_t>(1, std::min(n, info.kv_slots / 2));
      if (std::find(counts.begin(), counts.end(), n) == counts.end()) counts.push_back(n);
    }
    for (const std::string& method : opts.warmup_methods) {
      if (std::find(info.methods.begin(), info.methods.end(), method) == info.methods.end()) {
        continue;  // e.g. sd without a draft model
      }
      for (size_t k = 0; k < counts.size() && failed.ok(); ++k) {
        failed = WarmUpLoad(mi, method, counts[k], next);
        images += failed.ok() ? 2 * counts[k] : 0;
      }
      if (!failed.ok()) break;
    }
  }
  gate->warming = false;
  RETURN_IF_ERROR(failed);
  // The decode thread counts a completion after its OnComplete, which is what the warm-up
  // waited for: the counts are read once it has nothing left, or the last warm-up image could
  // be counted after the read, as a served one (Stats().completed above submitted).
  for (int i = 0; i < 60000 && decoder->pending() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  warm_completed = decoder->completed();
  warm_decode_batches = decoder->batch_calls();
  warm_batch_decoded = decoder->batch_images();
  std::ostringstream msg;
  msg.precision(3);
  msg << "warm-up: " << images << " images in "
      << std::chrono::duration<double>(Clock::now() - t0).count() << " s, " << gate->steps
      << " steps, " << gate->captures << " CUDA graphs captured";
  if (gate->capture_failures > 0) {
    msg << ", " << gate->capture_failures
        << " captures failed (their buckets run without a graph until the restart)";
  }
  Notice(opts, msg.str());
  return OkStatus();
}

// A closed loop of n clients for 2n images, the first n arriving one a step: requests at every
// age side by side, as a load has them (n started together would meet only the shapes of
// requests in lockstep).
Status Engine::Impl::WarmUpLoad(size_t mi, const std::string& method, int64_t n, int64_t& next) {
  const ModelInfo& info = infos[mi];
  const GptConfig& c = models[mi].gpt->gpt->config();
  const int64_t total = 2 * n;
  auto observer = std::make_shared<WarmupObserver>();
  FamilyScheduler& sched = *schedulers[mi];
  int64_t submitted = 0;
  Outcomes out;
  Status failed;
  while (submitted < total || !sched.idle()) {
    if (submitted < total && sched.queued() + sched.active() < n) {
      GenerateParams p;
      p.model = info.name;
      p.policy = *PolicyFromPreset(method);
      if (c.prompted()) {
        p.prompt_token_ids = {0};
      } else {
        p.class_id = submitted % std::max<int64_t>(c.num_classes, 1);
      }
      p.seed = static_cast<uint64_t>(submitted);
      size_t m = 0;
      StatusOr<std::unique_ptr<Job>> job = Resolve(std::move(p), &m);
      if (!job.ok()) {
        failed = job.status();
        break;
      }
      (*job)->id = (*job)->group = -(++next);  // never a client's id
      (*job)->submitted = Clock::now();
      (*job)->observer = observer;
      sched.Enqueue(std::move(*job));
      ++submitted;
    }
    sched.Tick({}, Clock::now(), out);
  }
  if (failed.ok()) failed = observer->Wait(submitted, std::chrono::seconds(600));
  if (failed.ok()) return OkStatus();
  failed = Status(failed.code(), "warm-up of model '" + info.name + "' with " + method + " at " +
                                     std::to_string(n) + " at a time: " + failed.message());
  sched.EndAll(failed, out);
  return failed;
}

// A continuous-token model: no KV cache, so a slot is a forward row (max_slots of them).
Status Engine::Impl::LoadMar(const std::string& name, const LoadOptions& lo) {
  ASSIGN_OR_RETURN(MarModel m, LoadMarModel(opts.models_dir, name, lo, /*with_draft=*/true));
  auto model = std::make_unique<MarModel>(std::move(m));
  const MarConfig& c = model->mar->config();
  if (model->draft && model->draft->head().steps() != model->mar->head().steps()) {
    return FailedPrecondition("model '" + name +
                              "': the draft's num_sampling_steps differ from "
                              "the target's (trajectory alignment needs the same steps)");
  }
  const int64_t slots = opts.max_slots;
  schedulers.push_back(std::make_unique<MarScheduler>(*model, slots, opts, *decoder, gate.get()));
  ModelInfo info;
  info.name = name;
  info.grid = c.grid();
  info.num_classes = c.class_num;
  info.class_names = c.class_names;
  const KlConfig& kc = model->vae->config();
  info.image_width = info.image_height = kc.resolution;
  info.channels = kc.out_ch;
  info.draft_model = model->draft ? c.draft_model : "";
  info.methods.push_back("mar");
  if (model->draft) info.methods.push_back("cspd");
  info.sampling_defaults = {c.default_cfg_scale, c.default_temperature, 0, 1.0};
  info.max_window = c.seq_len();
  info.kv_slots = slots;
  info.continuous = true;
  info.token_dim = c.token_dim();
  info.default_num_iter = c.default_num_iter;
  infos.push_back(info);
  stats.models.push_back({name, 0, 0, 0, slots, 0, ""});
  models.push_back({name, nullptr, std::move(model)});
  return OkStatus();
}

StatusOr<std::unique_ptr<Job>> Engine::Impl::ResolveMar(GenerateParams p, const MarModel& m) const {
  const MarConfig& c = m.mar->config();
  auto job = std::make_unique<Job>();
  if (!p.prompt_token_ids.empty()) {
    return FieldError("prompt", "this model is class-conditional; set class_id or class_name");
  }
  if (!p.negative_prompt_token_ids.empty()) {
    return FieldError("negative_prompt", "this model is class-conditional; it takes no prompt");
  }
  if (p.class_id.has_value() && !p.class_name.empty()) {
    return FieldError("class_name", "set class_id or class_name, not both");
  }
  if (p.class_id.has_value()) {
    RETURN_IF_ERROR(CheckMarClassId(c, *p.class_id));
    job->request.class_id = *p.class_id;
  } else if (!p.class_name.empty()) {
    ASSIGN_OR_RETURN(job->request.class_id, MarClassIdByName(c, p.class_name));
  } else {
    return FieldError("class_id", "required: set class_id or class_name");
  }
  if (p.top_k.has_value() && *p.top_k != 0) {
    return FieldError("top_k", "applies to discrete-token models only");
  }
  if (p.top_p.has_value() && *p.top_p != 1.0) {
    return FieldError("top_p", "applies to discrete-token models only");
  }
  if (p.cfg_interval.has_value() && *p.cfg_interval != -1) {
    return FieldError("cfg_interval", "applies to discrete-token models only (MAR: cfg_schedule)");
  }
  job->request.seed = p.seed.has_value() ? *p.seed : RandomSeed();
  SamplingParams& s = job->request.sampling;
  s.cfg_scale = p.cfg_scale.value_or(c.default_cfg_scale);
  s.temperature = p.temperature.value_or(c.default_temperature);
  if (!(s.cfg_scale >= 1.0 && s.cfg_scale <= 100)) {
    return FieldError("cfg_scale", "must be in [1, 100] for continuous-token models");
  }
  if (!(s.temperature > 0 && s.temperature <= 100)) {
    return FieldError("temperature", "must be in (0, 100] for continuous-token models");
  }
  job->request.policy = p.policy;
  RETURN_IF_ERROR(ValidateContinuousPolicy(p.policy, c.seq_len(), m.draft != nullptr));
  if (p.policy.draft != DraftSource::kNone && s.temperature < kCspdMinTemperature) {
    std::ostringstream m;
    m << "must be at least " << kCspdMinTemperature << " for cspd (got " << s.temperature
      << (p.temperature.has_value() ? "" : ", the model's default")
      << "): below it float32 rounding refuses the drafts";
    return FieldError("temperature", m.str());
  }
  // More rows per step than the server has would wait in the queue only to be refused at
  // admission: refused here.
  if (const int64_t rows = MarStepRows(job->request.policy, s.cfg_scale); rows > opts.max_slots) {
    return FieldError("window", "needs " + std::to_string(rows) +
                                    " forward rows per step, the server has " +
                                    std::to_string(opts.max_slots) + " (--max-slots)");
  }
  if (p.preview_every < 0) return FieldError("preview_every", "must be >= 0");
  if (p.previews < 0 || p.previews > 64) return FieldError("previews", "must be in [0, 64]");
  job->params = std::move(p);
  return job;
}

StatusOr<std::unique_ptr<Job>> Engine::Impl::Resolve(GenerateParams p, size_t* model_index) const {
  size_t mi = 0;
  if (!p.model.empty()) {
    mi = models.size();
    for (size_t i = 0; i < models.size(); ++i) {
      if (models[i].name == p.model) mi = i;
    }
    if (mi == models.size()) {
      std::string names;
      for (const auto& m : models) names += (names.empty() ? "" : ", ") + m.name;
      return NotFound("model " + Quoted(p.model) + " is not loaded (loaded: " + names + ")");
    }
  }
  *model_index = mi;
  if (models[mi].mar) return ResolveMar(std::move(p), *models[mi].mar);
  const ImageModel& m = *models[mi].gpt;
  const GptConfig& c = m.gpt->config();
  auto job = std::make_unique<Job>();
  if (c.prompted()) {
    if (p.class_id.has_value() || !p.class_name.empty()) {
      return FieldError(p.class_id.has_value() ? "class_id" : "class_name",
                        "model " + Quoted(m.name) + " draws from a prompt, not a class");
    }
    if (p.prompt_token_ids.empty()) {
      return FieldError("prompt", "model " + Quoted(m.name) + " needs a prompt");
    }
    job->request.prompt = p.prompt_token_ids;
  } else if (!p.prompt_token_ids.empty()) {
    return FieldError(
        "prompt", "model " + Quoted(m.name) + " is class-conditional; set class_id or class_name");
  } else if (p.class_id.has_value() && !p.class_name.empty()) {
    return FieldError("class_name", "set class_id or class_name, not both");
  } else if (p.class_id.has_value()) {
    RETURN_IF_ERROR(CheckClassId(c, *p.class_id));
    job->request.class_id = *p.class_id;
  } else if (!p.class_name.empty()) {
    ASSIGN_OR_RETURN(job->request.class_id, ClassIdByName(c, p.class_name));
  } else {
    return FieldError("class_id", "required: set class_id or class_name");
  }
  job->request.negative_prompt = p.negative_prompt_token_ids;
  job->request.seed = p.seed.has_value() ? *p.seed : RandomSeed();
  SamplingParams& s = job->request.sampling;
  s.cfg_scale = p.cfg_scale.value_or(c.default_cfg_scale);
  s.temperature = p.temperature.value_or(c.default_temperature);
  s.top_k = p.top_k.value_or(c.default_top_k);
  s.top_p = p.top_p.value_or(c.default_top_p);
  s.cfg_interval = p.cfg_interval.value_or(-1);
  job->request.policy = p.policy;
  if (p.preview_every < 0) return FieldError("preview_every", "must be >= 0");
  if (p.previews < 0 || p.previews > 64) return FieldError("previews", "must be in [0, 64]");
  RETURN_IF_ERROR(ValidateImageRequest(job->request, *m.gpt, m.draft.get()));
  job->params = std::move(p);
  *model_index = mi;
  return job;
}

StatusOr<int64_t> Engine::Submit(GenerateParams params, std::shared_ptr<RequestObserver> observer) {
  std::vector<GenerateParams> one;
  one.push_back(std::move(params));
  ASSIGN_OR_RETURN(std::vector<int64_t> ids, SubmitGroup(std::move(one), {std::move(observer)}));
  return ids[0];
}

StatusOr<std::vector<int64_t>> Engine::SubmitGroup(
    std::vector<GenerateParams> params, std::vector<std::shared_ptr<RequestObserver>> observers) {
  if (params.empty() || observers.size() != params.size()) {
    return InvalidArgument("observer: one per request is required");
  }
  for (const auto& o : observers) {
    if (!o) return InvalidArgument("observer: required");
  }
  std::vector<std::unique_ptr<Job>> jobs;
  size_t mi = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    size_t m = 0;
    ASSIGN_OR_RETURN(std::unique_ptr<Job> job, impl_->Resolve(std::move(params[i]), &m));
    if (i > 0 && m != mi) return InvalidArgument("model: a group draws from one model");
    if (i > 0 && ClassOf(job->params) != ClassOf(jobs[0]->params)) {
      return InvalidArgument("priority: a group has one priority, client and tenant");
    }
    mi = m;
    job->observer = std::move(observers[i]);
    jobs.push_back(std::move(job));
  }
  const auto n = static_cast<int64_t>(jobs.size());
  std::lock_guard<std::mutex> lock(impl_->mu);
  EngineStats& st = impl_->stats;
  if (impl_->draining) {
    st.rejected += n;
    return Unavailable("the engine is shutting down");
  }
  if (n > 1 && n > impl_->opts.max_queue) {
    st.rejected += n;
    return FieldError("n", std::to_string(n) + " images can never wait in a queue of " +
                               std::to_string(impl_->opts.max_queue));
  }
  const WaitClass cls = ClassOf(jobs[0]->params);
  const int64_t queued = impl_->Queued(mi);
  std::vector<Shed> displaced;
  if (queued + n > impl_->opts.max_queue) {
    // Full: the arrivals take the places of waiting requests that rank after them, if enough
    // do (wait_queue.h).
    WaitCensus c = impl_->census[mi];
    for (const auto& [k, v] : impl_->inbox_census[mi]) c[k] += v;
    for (const Shed& x : impl_->shed[mi]) c[x.victim] -= 1;
    std::optional<std::vector<Shed>> d = Displace(
        std::move(c), cls, n, impl_->opts.max_queue - queued, impl_->opts.admission == "fair");
    if (!d.has_value()) {
      st.rejected += n;
      return ResourceExhausted("queue full: " + std::to_string(queued) +
                               " requests are waiting for model '" + st.models[mi].model + "'" +
                               (n > 1 ? " (room for " + std::to_string(n) + " is needed)" : ""));
    }
    displaced = std::move(*d);
  }
  // One arrival: the group is admitted in order, so that later members copy the first's
  // prefill.
  const auto now = Clock::now();
  std::vector<int64_t> ids;
  const int64_t group = impl_->next_id;
  for (auto& job : jobs) {
    job->id = impl_->next_id++;
    job->group = group;
    job->submitted = now;
    ids.push_back(job->id);
    impl_->inbox.emplace_back(mi, std::move(job));
  }
  st.submitted += n;
  impl_->inbox_per_model[mi] += n;
  impl_->inbox_census[mi][cls] += n;
  for (Shed& x : displaced) impl_->shed[mi].push_back(std::move(x));
  // Work for an idle engine thread: its wait for it starts now, not at its last round's end.
  if (impl_->sleeping) impl_->beat = now;
  impl_->cv.notify_one();
  return ids;
}

void Engine::Cancel(int64_t id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cancels.insert(id);
  impl_->cv.notify_one();
}

bool Engine::decode_thread() const { return impl_->decoder && impl_->decoder->async(); }
int64_t Engine::decode_batch() const { return impl_->decoder ? impl_->decoder->max_batch() : 1; }

EngineStats Engine::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  EngineStats s = impl_->stats;
  if (impl_->decoder) {  // finished requests count when their decoding returns
    s.completed += impl_->decoder->completed() - impl_->warm_completed;
    s.failed += impl_->decoder->failed();
    s.decode_batches = impl_->decoder->batch_calls() - impl_->warm_decode_batches;
    s.batch_decoded = impl_->decoder->batch_images() - impl_->warm_batch_decoded;
  }
  for (size_t i = 0; i < s.models.size(); ++i) s.models[i].queued = impl_->Queued(i);
  return s;
}

EngineProgress Engine::Progress() const {
  EngineProgress p;
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    bool busy = !impl_->inbox.empty();
    for (size_t i = 0; i < impl_->stats.models.size() && !busy; ++i) {
      busy = impl_->Queued(i) > 0 || impl_->stats.models[i].active > 0;
    }
    if (busy) {
      p.engine_seconds = std::max(0.0, std::chrono::duration<double>(now - impl_->beat).count());
    }
    for (const ModelLoad& l : impl_->stats.models) {
      if (l.failed_steps_in_a_row > p.failed_steps) {
        p.failed_steps = l.failed_steps_in_a_row;
        p.failed_model = l.model;
        p.last_error = l.last_step_error;
      }
    }
  }
  if (impl_->decoder) p.decoder_seconds = impl_->decoder->StalledSeconds(now);
  return p;
}

const std::vector<ModelInfo>& Engine::Models() const { return impl_->infos; }

int64_t Engine::max_tokens_per_step() const { return impl_->opts.max_tokens_per_step; }
int64_t Engine::lone_request_max_window() const { return impl_->opts.lone_request_max_window; }

void Engine::Shutdown(std::chrono::milliseconds grace) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (!impl_->draining) {
      impl_->draining = true;
      impl_->grace_end = Clock::now() + grace;
    } else {
      impl_->grace_end = std::min(impl_->grace_end, Clock::now() + grace);
    }
    impl_->stats.draining = true;
    impl_->cv.notify_one();
  }
  std::call_once(impl_->joined, [this] {
    if (impl_->thread.joinable()) impl_->thread.join();
  });
}

void Engine::Impl::EndModelAfterEscape(size_t mi, const std::string& what, Outcomes& out) {
  Notice(opts, "model '" + models[mi].name + "': " + what +
                   " escaped a scheduling round; its requests end with INTERNAL");
  try {
    schedulers[mi]->EndAll(Internal("the engine failed while scheduling: " + what), out);
  } catch (...) {
  }
}

void Engine::Impl::Run() {
  for (auto& s : schedulers) s->ArmFailureDrill(opts.fail_steps_for_seconds);
  std::vector<std::pair<size_t, std::unique_ptr<Job>>> arrived;
  std::unordered_set<int64_t> cancelled;
  std::vector<std::vector<Shed>> to_shed(schedulers.size());
  while (true) {
    bool draining_now = false, out_of_time = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      arrived.swap(inbox);
      cancelled.swap(cancels);
      // Until this round's figures replace them, the arrivals count as queued and the
      // requests to shed as gone (Submit's bound).
      for (size_t i = 0; i < inbox_per_model.size(); ++i) {
        stats.models[i].queued = Queued(i);
        inbox_per_model[i] = 0;
        for (const auto& [k, v] : inbox_census[i]) census[i][k] += v;
        inbox_census[i].clear();
        for (const Shed& x : shed[i]) census[i][x.victim] -= 1;
        to_shed[i].swap(shed[i]);
      }
      draining_now = draining;
      out_of_time = draining && Clock::now() >= grace_end;
    }
    for (auto& [mi, job] : arrived) schedulers[mi]->Enqueue(std::move(job));
    arrived.clear();
    // A round: each model ends the requests that gave up their places in its full queue, its
    // cancelled and expired requests, admits, and steps.
    Outcomes out;
    for (size_t i = 0; i < to_shed.size(); ++i) {
      for (const Shed& x : to_shed[i]) {
        // Submit counted the queue as of the last round's end: requests admitted since may
        // have made the room, and then nobody gives way. None left of the class: one was
        // admitted or ended meanwhile (the queue is over its bound until the next admission).
        if (schedulers[i]->queued() <= opts.max_queue) break;
        out.shed += schedulers[i]->Shed(x.victim, ShedStatus(x.reason)) ? 1 : 0;
      }
      to_shed[i].clear();
    }
    bool stepped = false;
    const auto now = Clock::now();
    for (size_t i = 0; i < schedulers.size(); ++i) {
      // A step's own failures are handled inside Tick (its requests end with the error, the
      // engine goes on). Anything else that escapes (LibTorch outside the step's try, an
      // allocation) ends that model's requests instead of the engine thread, every model's
      // requests and the process with it.
      try {
        stepped |= schedulers[i]->Tick(cancelled, now, out);
      } catch (const std::exception& e) {
        EndModelAfterEscape(i, e.what(), out);
        stepped = true;
      } catch (...) {
        EndModelAfterEscape(i, "an exception that is not a std::exception", out);
        stepped = true;
      }
    }
    cancelled.clear();  // ids not found had already finished
    if (out_of_time) {
      for (auto& r : schedulers)
        r->EndAll(Unavailable("the server shut down before the request "
                              "finished"),
                  out);
    }
    bool idle = true;
    Clock::time_point wake = Clock::time_point::max();
    {
      std::lock_guard<std::mutex> lock(mu);
      beat = Clock::now();
      stats.steps += stepped ? 1 : 0;
      stats.cancelled += out.cancelled;
      stats.expired += out.expired;
      stats.failed += out.failed;
      stats.shed += out.shed;
      stats.preempted += out.preempted;
      if (governor) {
        // The engine thread's own count, as LibTorch has it (not the governor's wish).
        stats.cpu_threads = at::get_num_threads();
        stats.cpu_threads_lowered = governor->lowered();
        stats.cpu_threads_raised = governor->raised();
      }
      for (size_t i = 0; i < schedulers.size(); ++i) {
        ModelLoad& l = stats.models[i];
        l.queued = schedulers[i]->queued();
        census[i] = schedulers[i]->census();
        l.active = schedulers[i]->active();
        l.slots_used = schedulers[i]->slots_used();
        l.failed_steps_in_a_row = schedulers[i]->failed_steps_in_a_row();
        if (l.failed_steps_in_a_row > 0) l.last_step_error = schedulers[i]->last_step_error();
        idle &= schedulers[i]->idle();
        wake = std::min(wake, schedulers[i]->next_deadline());
      }
    }
    if (draining_now && idle) break;
    if (stepped) continue;
    // Nothing to step: sleep until a request, a cancellation, a deadline or the end of the
    // grace period.
    std::unique_lock<std::mutex> lock(mu);
    if (draining) wake = std::min(wake, grace_end);
    auto ready = [&] { return !inbox.empty() || !cancels.empty() || (draining && !draining_now); };
    sleeping = true;
    if (wake == Clock::time_point::max()) {
      cv.wait(lock, ready);
    } else {
      cv.wait_until(lock, wake, ready);
    }
    sleeping = false;
    beat = Clock::now();
  }
}

}  // namespace imagegen
