// The serving engine: loaded models, and one engine thread that runs iteration-level
// continuous batching over them (DESIGN.md, "Scheduler"). Each step packs every active
// request's window (AR token, Jacobi window, proactive tree, draft-model chain), whatever its
// method, into one ragged target forward per model, verifies each request, and reports
// committed tokens to the request's observer.
//
// Thread-safe: Submit, Cancel, Stats, Models and Shutdown may be called from any thread.
// Observers and the listener are called on the engine thread, except a finished request's
// OnComplete (or OnError when its image fails to decode), which comes from the decode thread
// when there is one (EngineOptions::decode_thread), after the request's last OnStep. No
// LibTorch in this header.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/scheduler/request.h"
#include "engine/scheduler/thread_governor.h"
#include "engine/util/status.h"

namespace imagegen {

// EngineOptions::lone_request_max_window: the ceiling the step-cost calibration makes fastest
// for the request's method (LoneRequestCeiling, engine/scheduler/goodput.h); the CPU's default.
inline constexpr int64_t kLoneWindowFromCalibration = -2;

struct EngineOptions {
  std::string models_dir;           // holds one directory per model
  std::vector<std::string> models;  // GPT models to serve; empty: {"fmnist-gpt"}
  std::string device = "cpu";       // "cpu", "cuda" or "cuda:N"
  std::string dtype = "auto";  // "auto" (bf16 on CUDA, fp32 on the CPU), "fp32", "bf16", "fp16"
  // KV-cache memory per model (target and draft caches together); it sets the slot count,
  // capped by max_slots. A request takes one slot, two with CFG. -1: by device
  // (AutoKvCacheBytes, engine/model/device.h): 256 MiB on the CPU; on a GPU half the memory the
  // device still has after the model's weights, shared by the models still to load.
  int64_t kv_cache_bytes = -1;
  int64_t max_slots = 64;
  int64_t max_queue = 256;  // waiting requests per model; beyond: RESOURCE_EXHAUSTED
  // The order the waiting requests are admitted in (wait_queue.h): "fair" (priority, then the
  // tenant and the client with the fewest requests running, then the oldest; a full queue
  // gives up the newest request of the tenant and client with the most waiting to another's
  // arrival) or
  // "fifo" (priority, then the oldest; a full queue gives up only lower priorities).
  std::string admission = "fair";
  // Preemption for priority (discrete-token models): when the request admission takes next
  // finds no free KV slots (or no room in the token budget) and running requests have a
  // higher priority value, the least urgent of them (the newest first) give up their slots
  // and wait again, keeping their committed tokens; when admitted again they recompute their
  // KV entries and go on (SpecBatch::Suspend). Lossless methods stay lossless. Off: nothing
  // running is preempted (with window_policy "full" a seed then draws the same image whatever
  // arrives later).
  bool preemption = true;
  // Target-forward tokens per step and model (a CFG request's token counts twice). Windows
  // shrink toward one token when the active requests want more; requests are admitted only
  // while every active one can still feed one token. 0: no budget. -1: by device: 256 on the
  // CPU (measured best on the bundled model, docs/results-serving.md), 2048 on CUDA (not
  // measured: a GPU forward costs about the same up to thousands of tokens).
  int64_t max_tokens_per_step = -1;
  // How each step's windows are chosen (docs/serving.md, "Window control"):
  // - "goodput" (the default): the controller (goodput.h) gives each request the window that
  //   maximises the tokens the step is expected to commit per second, from a step-cost model
  //   calibrated at start-up (cached in cache_dir) and refined by every step, and acceptance
  //   per draft depth learned online. Fairness bound: no request's expected time per token
  //   exceeds (1 + max_slowdown) times what it would be if every request fed one token. A
  //   request alone gets its whole window (lone_request_full_window). max_tokens_per_step is
  //   then a ceiling on a step's forward rows (memory): -1 means 4096, 0 none.
  // - "budget": the fixed token budget max_tokens_per_step (window_budget.h).
  // - "full": every request feeds its whole window (budget 0).
  std::string window_policy = "goodput";
  // Prompt tokens (prompted models) and the entries a resumed request recomputes (preemption)
  // prefilled per step and model, over all prefilling requests
  // (a CFG request's token counts twice), oldest first, beside the decoding requests' windows
  // (which the window policy chooses as if the prefill were not there); the oldest prefilling
  // request gets at least one token a step. A long prompt is thus spread over steps instead
  // of stalling everyone's next token.
  int64_t prefill_tokens_per_step = 64;
  double max_slowdown = 0.25;
  // Goodput hysteresis (GoodputOptions::stickiness): the previous step's windows are kept while
  // the cost and commit models put their goodput within this fraction of the best plan's. In
  // [0, 1]; 0 (the default): every step re-plans from scratch.
  double window_stickiness = 0;
  // Goodput: a plan that speculates must be predicted this fraction faster than plain AR for
  // all (GoodputOptions::min_gain). In [0, 1]. 0.03: at 16 clients on the 2-core CPU scd-mc
  // went from 0.90x to 0.94x AR's images/s with it (paired, 8 rounds), at 4 clients it stayed
  // 1.06x (docs/results-serving.md, "A margin over plain AR").
  double min_speculation_gain = 0.03;
  // Goodput: a request alone gets its whole window (GoodputOptions::lone_request_full_window),
  // up to lone_request_max_window, so that what a seed draws alone does not depend on the
  // learned commits or the online refinement of the step cost. false: it is planned as any
  // other, at the window the cost model makes fastest.
  bool lone_request_full_window = true;
  // With lone_request_full_window: a request alone gets its whole window but at most this many
  // nodes (GoodputOptions::lone_request_max_window). A number fixed while the engine runs, so
  // that a seed's image alone depends on the options and, with -2, the step-cost calibration
  // (kept in cache_dir, so the same on every restart of one machine). -2
  // (kLoneWindowFromCalibration): the window that calibration's one-request steps and the
  // method's prior commits make fastest (LoneRequestCeiling; the engine says them at start):
  // on the 2-core CPU 2-4 nodes, 1.04-1.10x AR's images/s at one client in the median and
  // 1.16-1.37x the fixed 12 it replaces, in every round (paired; docs/results-serving.md, "A
  // lone request's ceiling from the calibration"). -1: by device: -2 on the CPU, none on CUDA,
  // where a step costs about the same up to hundreds of rows (the H200's calibration of 2026-11-28
  // gives every preset its whole window by -2 too). 0: none; >= 1: at most that many.
  int64_t lone_request_max_window = -1;
  // Goodput exploration (GoodputPlan::wider): one planned step in this many (with two or
  // more requests, or one that is planned alone: lone_request_full_window off, or a
  // window-invariant method) takes a plan with at least twice the forward rows, so that the
  // step-cost model measures the wider steps it would otherwise only extrapolate to (and sees a
  // device that became faster for them). 0: never.
  int64_t explore_every = 16;
  // What exploring may cost: an exploring step is taken only while the predicted extra time of
  // all of them stays within this fraction of the planned steps' predicted time (a credit, of
  // at most the fraction of about 256 steps). On the 2-core CPU at 4 clients the steps of
  // windows twice as wide cost 1.75x a plain one, and one in 16 of them cost 5% of scd-mc's
  // step time over plain steps for no commits (with this budget 3%: docs/results-serving.md,
  // "What exploring costs"). 0: never explore; 1 or more: every explore_every-th planned
  // step, whatever it costs.
  double explore_budget = 0.02;
  // The first steps of a request that its own commit factor does not learn from
  // (RequestCommits: a Jacobi request's first steps commit about one token whatever its
  // window). 0 (default): every step counts.
  int64_t commit_warmup_steps = 0;
  // Whether the commit table (CommitModel) and each request's commit factor learn from a step
  // whose window is wider than the request's previous step's (its first step among them). A
  // Jacobi window's drafts beyond its previous width have not been refined yet, so such a step
  // commits about what the previous width would (load bench traces: 1.002 tokens a step for
  // windows grown from 1 to 2-4 at 64 clients, against 1.27-1.30 for the same windows held),
  // while the planner values a window at what it commits held. Counted, those steps (the
  // exploring step's above all) teach the table that wide windows commit nothing.
  // false (default): only steps that hold or narrow the window are learned from.
  bool commit_learn_growth = false;
  // Where the step-cost calibration is kept (one JSON file per model, device, dtype and CPU thread
  // count, reused at the next start), and on the CPU the few-row kernel's rows as its timing
  // chose them at load (one file per processor model, so that every start takes the same rows);
  // empty: not kept (calibrated and timed at every start).
  std::string cache_dir;
  // Tests and failure drills: while the counter is positive, each step of every model fails as
  // a forward that throws would (its requests end INTERNAL), and the counter goes down by one.
  // Null (the default): never.
  std::shared_ptr<std::atomic<int64_t>> fail_steps;
  // Failure drills (the daemon's --inject-step-failures-seconds): every step of a model fails
  // as above for this many seconds from its first step after the warm-up, as after a
  // transient device error; then its steps run again. 0: never.
  double fail_steps_for_seconds = 0;
  // Instead of the calibration, t = base + per_token * T + per_request * (R - 1) seconds,
  // fixed (tests). Empty: calibrate.
  std::vector<double> fixed_step_cost;
  // Benchmarks of the controller on a host that is not the device it models: with
  // fixed_step_cost and refine_step_cost, > 0 makes the cost model a calibrated one, fitted to
  // the formula, and refines it from the formula's time of each step times exp(sigma * z), z
  // standard normal (seeded), instead of the measured time: a cost model that jitters as one
  // refined from a GPU's sub-millisecond steps does (docs/results-gpu.md). 0: fixed.
  double simulated_step_noise = 0;
  // With simulated_step_noise: seconds the replayed time adds per request whose window holds
  // its whole proactive tree (1 + K + ... + K^(D-1) nodes: 21 for sjd-pac), the tree's own
  // cost beside the rows it feeds (on an H200, sjd-pac's steps cost 1.5-1.9x sjd chains'
  // calibration at the same rows, about 0.055 ms more per request; docs/results-serving.md).
  double simulated_tree_cost = 0;
  // With simulated_step_noise: a step whose shape bucket (approximately the static forward's:
  // powers of two of its rows, its batch rows and its widest window, and of its requests that
  // hold a tree) is new to the engine replays as a CUDA graph capture, its time times this
  // factor, and reports one capture (StepSample::graph_captures). 0: none.
  double simulated_capture_cost = 0;
  // Steps that captured a CUDA graph go into the step-cost refinement like the others (false:
  // left out), and each online sample counts as at most step_cost_max_ratio times the
  // prediction (StepCostModel::max_ratio; 0: unbounded, as before 2026-11-28). Measured in
  // replays (docs/results-serving.md, "Graph captures in the refinement").
  bool refine_on_captures = true;
  double step_cost_max_ratio = 2;
  // A cached calibration is spot-checked at start (ModelScheduler::SpotCheckCalibration): when
  // one request's steps run more than this factor faster than it predicts, it is measured
  // again (more than this factor slower: kept, with a notice). 0: off (used as it is).
  double step_cost_spot_check = 3;
  // The calibrated step cost refined online from every step's measured time (false: the
  // calibration alone, e.g. to see what the refinement does on a device whose step times
  // jitter).
  bool refine_step_cost = true;
  // A request's image does not depend on what else runs (ForwardOptions::batch_invariant).
  bool batch_invariant = true;
  // With batch_invariant on the CPU in fp32: every row attends through one RowAttention call a
  // layer instead of one SDPA call per request (LoadOptions::row_attention; 1.4-1.5x faster
  // forwards at 16 one-token requests on the 2-core dev VM, and faster with rows of 16-192
  // tokens too: row_attention.h). Images stay independent of their neighbours; their bits
  // differ from those drawn with it off (rounding). False: the SDPA calls, for A/B comparisons.
  bool row_attention = true;
  // With batch_invariant on the CPU in fp32: linear layers of fewer than 16 rows run
  // SmallRowsLinear's kernel instead of the BLAS on the rows padded to 16, and of more rows up
  // to where the kernel was timed faster than the BLAS at load (LoadOptions::small_rows_gemm;
  // the same logits bit for bit, where the kernel reproduces this machine's BLAS; about 0.6x
  // the forward's time at one request's two rows on the dev VM). False: the padded products,
  // for A/B comparisons.
  bool small_rows_gemm = true;
  // The most rows the kernel takes (LoadOptions::small_rows_gemm_rows): 0, measured at load;
  // -1, fewer than 16 only.
  int64_t small_rows_gemm_rows = 0;
  // The CPU's fp32 linear products (LoadOptions::engine_linear): "blas", the BLAS, with the
  // few-row kernel above where it reproduces the BLAS's bits; "engine", the engine's kernel on
  // every row count and any model size, never the BLAS (batch-invariant by construction, no
  // padding; other images for a seed than "blas" gives, by fp32 rounding).
  std::string cpu_linear = "blas";
  // On the CPU in fp32: the forward's RMSNorm and rotary embedding as one kernel each instead of
  // about six and ten ATen ops (LoadOptions::fused_norm_rope; the same logits bit for bit, where
  // the load-time check passes). False: the ops, for A/B comparisons.
  bool fused_norm_rope = true;
  // PyTorch's name for the fp32 products' precision (torch.set_float32_matmul_precision):
  // "highest" (fp32) or "medium": on the CPU in fp32, the GPT models' linear layers in bf16 on
  // the AMX tiles (LoadOptions::bf16_matmul: x and the weights rounded to bf16, sums in fp32;
  // other images than fp32's, batch-invariant, faster steps). Where the CPU has no AMX, or on
  // CUDA, the engine says so at start and keeps fp32.
  std::string matmul_precision = "highest";
  // The target and draft forwards at static shapes, each bucket captured once as a CUDA graph
  // and replayed (ForwardOptions::cuda_graphs; on the CPU the static forward runs eagerly).
  // Overrides batch_invariant: a request's logits then equal the eager forward's within
  // rounding rather than bit for bit. -1: by device, on for CUDA (5-9x the eager forward's
  // served throughput on an H200, docs/results-gpu.md), off on the CPU; 0 off; 1 on. Start
  // resolves -1, so that the options the schedulers see hold 0 or 1.
  int cuda_graphs = -1;
  // Chain steps verified in one fused pass (SpecOptions::fused_verify; one kernel on CUDA).
  bool fused_verify = true;
  // A Jacobi window the controller cuts keeps its cut drafts for a later, longer window
  // (SpecOptions::keep_cut_drafts); false draws the regrown tail at random again.
  bool keep_cut_drafts = true;
  // Intra-op threads of the engine thread (at::set_num_threads); 0 keeps the process's count
  // (LibTorch's default unless something set one), capped by the cgroup's CPU quota
  // (engine/util/cpu_quota.h: Docker's --cpus, a Kubernetes CPU limit). LibTorch keeps one count
  // per process, taken by every thread at its first parallel op: an engine is refused while another
  // live engine in the process runs with a different nonzero count. All LibTorch work, model
  // loading included, runs on the engine thread: with GNU OpenMP a second thread that also runs
  // parallel LibTorch ops made every step about twice as slow on 2 cores (both thread pools stop
  // spinning and sleep between the many small ops of a step).
  int64_t cpu_threads = 0;
  // On the CPU: the engine thread's intra-op count follows the CPU it gets
  // (engine/scheduler/thread_governor.h): halved while the engine thread waits for a CPU
  // lower_share (a fifth) of its step time or more, other work being busy on its cores, and
  // tried again above after a while. Only counts whose forwards and decoders give the same bits
  // as the engine's own count (checked at start, Engine::Impl::SetUpThreadGovernor) are used, so
  // a seed draws the same image at any load. -1: by device (on for the CPU with 2 threads or
  // more, off on CUDA); 0 off; 1 on.
  int adaptive_cpu_threads = -1;
  // Its windows, bound and waits (counts: filled at start; a list there is kept, each count
  // still checked).
  ThreadGovernorOptions cpu_thread_governor;
  // Tests: where the engine thread reads its run-queue wait (a file in schedstat's form that
  // the test writes) in place of /proc/thread-self/schedstat, and the CPUs' idle time in place
  // of /proc/stat (engine/util/cpu_idle.h). Empty: the real ones.
  std::string schedstat_path, proc_stat_path;
  // Previews (GenerateParams::preview_every) are decoded on the engine thread, which every
  // request waits for: they may take this share of the engine's time, no more. Requests whose
  // preview is due wait their turn (longest-waiting first) and then get the grid as it is then.
  // 0: every due preview, every step (the previews' cost falls on everyone).
  double preview_share = 0.05;
  // Where finished images are decoded and their requests completed (decode_queue.h): 1 on a
  // decode thread with its own CUDA stream, so that the VQ decoder's kernels overlap the next
  // step's forward instead of stalling every request in the batch; 0 on the engine thread,
  // inside the step; -1 (default) by device: 1 on CUDA, 0 on the CPU, where both threads'
  // parallel LibTorch ops would share the same cores (see cpu_threads).
  int decode_thread = -1;
  // The most finished images decoded in one decoder call (DecodeQueue::CompleteBatch): the
  // images that finish in one step, and on the decode thread those queued one behind the
  // other. A batch's pixels equal one-at-a-time decoding's within rounding, not bit for bit,
  // so -1 (default) is 16 where the forward is not batch-invariant either (CUDA graphs,
  // batch_invariant off) and 1 otherwise; 1 decodes one image a call; at most 256.
  int64_t decode_batch = -1;
  // A warm-up before Start returns, and so before the daemon reports ready: for each
  // discrete-token model, each of warmup_methods it serves runs at each n of
  // warmup_concurrency (at most half its KV slots): a closed loop of n clients, arriving one a
  // step, for 2n images, through the ordinary scheduler with the model's default sampling. It
  // captures the CUDA graphs of the shape buckets such loads meet (a capture costs tens of times a
  // replay) and warms the VQ decoder's batch sizes, so that clients' requests meet replays, and the
  // step-cost refinement and the acceptance statistics have seen the device before the first
  // client. Warm-up requests are not counted in EngineStats, their steps do not reach the listener,
  // and one that fails fails Start. -1 (default): by device, on with CUDA graphs, off
  // otherwise; 0 off; 1 on.
  int warmup = -1;
  std::vector<std::string> warmup_methods = {"ar", "sjd", "scd-mc", "sjd-pac"};  // presets
  std::vector<int64_t> warmup_concurrency = {1, 2, 4, 8, 16};                    // each >= 1
  // Fills StepSample::trace (each decoding request's windows, expectations and commits) for
  // the listener: diagnostics of the goodput controller; off, nothing is collected.
  bool trace_steps = false;
  // Where the engine's notices go (a step-cost calibration that is not reused or not cached),
  // one line each, without a trailing newline; unset: stderr, prefixed "imagegen: ". The
  // daemon routes them through its --log-format.
  std::function<void(const std::string&)> log;
};

// One step of one model, for metrics.
struct StepSample {
  std::string model;
  double seconds = 0;           // the whole step: drafting, forward, verification, events
  int64_t requests = 0;         // requests in the step
  int64_t tokens = 0;           // target-forward tokens (CFG rows included)
  int64_t committed = 0;        // image tokens committed by the step
  bool budget_limited = false;  // some window was shrunk (by the budget or the controller)
  // What the step-cost model predicts: planning, the SpecBatch step, events and observers
  // (not previews, nor decoding finished images).
  double step_seconds = 0;
  double predicted_seconds = 0;  // the step-cost model's prediction (0: no model)
  // The calibration's time for the step's shape, without the online refinement: what the step
  // took on the machine the calibration timed, at the start's thread count (0: no calibration).
  double calibrated_seconds = 0;
  double expected_committed = 0;  // the controller's expectation of `committed` (goodput)
  double plan_seconds = 0;        // choosing the windows (the controller's own cost)
  // How long the engine thread waited, runnable, for a CPU since its previous step (Linux's
  // schedstat, engine/util/run_queue_wait.h): other work on the daemon's cores. -1: unknown.
  double cpu_wait_seconds = -1;
  // CUDA graphs captured in this step (a bucket's first forward: an eager forward, the capture
  // and its instantiation, tens of times a replay). A one-off cost: the step-cost model's
  // refinement counts such a step as at most step_cost_max_ratio times its prediction.
  int64_t graph_captures = 0;
  // CUDA graph captures that failed in this step: the step went on with its eager forward's
  // logits, and the bucket runs eagerly from then on (slower, never wrong). 0 normally.
  int64_t graph_capture_failures = 0;
  // EngineOptions::trace_steps (goodput window control): what the controller saw for each
  // request that decoded in this step, and the plan it did not choose, every request at its
  // wanted window (for diagnosing its choices offline; the load bench's --trace-dir).
  struct RequestTrace {
    int64_t id = 0;
    std::string method;          // the preset
    int64_t wanted = 0;          // the window its method wanted (nodes)
    int64_t window = 0;          // granted
    int64_t rows = 0;            // forward rows per node (2 with CFG)
    double expected = 0;         // commits expected at the granted window (its factor included)
    double expected_wanted = 0;  // ... at the wanted window
    double factor = 0;           // RequestCommits::Factor
    int64_t committed = 0;       // tokens the step committed for it
  };
  std::vector<RequestTrace> trace;
  bool explore = false;                 // the controller's exploring step (one in 16)
  double explore_extra_seconds = 0;     // ... its predicted time over the plan it replaced
  double wanted_predicted_seconds = 0;  // the step-cost model's time for the wanted windows
};

class EngineListener {
 public:
  virtual ~EngineListener() = default;
  virtual void OnStep(const StepSample& sample) = 0;
  // A step of the start-up warm-up (EngineOptions::warmup): not a served step, so it is not
  // passed to OnStep; a listener that counts what outlives the warm-up (a failed CUDA graph
  // capture leaves its bucket without a graph until the restart) reads it here.
  virtual void OnWarmupStep(const StepSample& /*sample*/) {}
};

struct ModelLoad {
  std::string model;
  int64_t queued = 0;  // waiting for a slot
  int64_t active = 0;  // holding slots
  int64_t slots_used = 0, slots_total = 0;
  // Steps that failed (their requests ended INTERNAL) since the model's last step that did not,
  // and the last failure's message.
  int64_t failed_steps_in_a_row = 0;
  std::string last_step_error;
};

struct EngineStats {
  std::vector<ModelLoad> models;
  int64_t steps = 0;
  int64_t submitted = 0, completed = 0, cancelled = 0, expired = 0, failed = 0, rejected = 0;
  int64_t shed = 0;       // queued, then gave up their place in a full queue to a later arrival
  int64_t preempted = 0;  // times a running request gave up its slots to a more urgent one
  // Batched decoding (EngineOptions::decode_batch > 1): decoder calls, and the finished images
  // they made (their ratio is the mean batch).
  int64_t decode_batches = 0, batch_decoded = 0;
  // On the CPU: the engine thread's intra-op threads now and at start, and how often the
  // thread governor (EngineOptions::adaptive_cpu_threads) lowered and raised them. 0 on CUDA.
  int64_t cpu_threads = 0, cpu_threads_max = 0;
  int64_t cpu_threads_lowered = 0, cpu_threads_raised = 0;
  bool draining = false;
};

// Whether the engine is getting on with its work, for a liveness check that means more than
// "the process answers" (a wedged GPU, a deadlock or an observer that never returns leaves the
// process up and every request hung): how long the work each of its threads has has waited
// without that thread getting anywhere.
struct EngineProgress {
  // Requests arrived, waiting or running, and the engine thread has not finished a round
  // since this many seconds (counted from its last round's end, or from the arrival that woke
  // it from idle); 0 while it has no work.
  double engine_seconds = 0;
  // Finished images waiting for the decode thread (or being decoded), which has not returned
  // one since this many seconds (or since the first of them arrived at an idle thread); 0
  // while it has none, and always with inline decoding (the engine thread's then).
  double decoder_seconds = 0;
  double seconds() const {
    return engine_seconds > decoder_seconds ? engine_seconds : decoder_seconds;
  }
  const char* thread() const { return engine_seconds >= decoder_seconds ? "engine" : "decoder"; }
  // An engine that moves but gets nothing done (a sticky device error fails every step): the
  // most steps of one model that failed in a row, as of the last round, its model and the
  // last failure's message.
  int64_t failed_steps = 0;
  std::string failed_model, last_error;
};

class Engine {
 public:
  // Starts the engine thread, which loads the models (each GPT, its VQ tokenizer, and the
  // draft GPT its config.json names under "draft_model"); returns once they are loaded.
  // `listener` may be null; it must outlive the engine.
  static StatusOr<std::unique_ptr<Engine>> Start(const EngineOptions& options,
                                                 EngineListener* listener = nullptr);
  ~Engine();  // Shutdown(0) if still running
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates the request (INVALID_ARGUMENT naming the field; NOT_FOUND for an unknown model),
  // queues it and returns its id at once. RESOURCE_EXHAUSTED when the model's queue is full
  // and nothing waiting ranks after the request (wait_queue.h, Displace; otherwise the
  // request that ranks last gives up its place and ends with RESOURCE_EXHAUSTED),
  // UNAVAILABLE once Shutdown has begun. On success the observer will get exactly one
  // OnComplete or OnError; on failure it gets nothing.
  StatusOr<int64_t> Submit(GenerateParams params, std::shared_ptr<RequestObserver> observer);
  // Several requests of one model (a client's `n` images), each with its observer, queued
  // together or not at all: every one is validated first, and the queue must have room for
  // all, or requests ranked after them to give up (RESOURCE_EXHAUSTED otherwise; INVALID_ARGUMENT
  // naming "n" when the group is larger than the queue could ever hold). Queued back to back, they
  // are admitted in order, so that requests with the same prompt copy the first one's prefill.
  StatusOr<std::vector<int64_t>> SubmitGroup(
      std::vector<GenerateParams> params, std::vector<std::shared_ptr<RequestObserver>> observers);

  // The request ends with CANCELLED at the next step boundary and frees its slots. Unknown
  // or finished ids are ignored.
  void Cancel(int64_t id);

  // A snapshot taken at the end of the engine's last round, after that round's observers ran
  // (an observer that has just been called may not see its request counted yet); `completed`
  // and `failed` count a finished request once its image is decoded.
  EngineStats Stats() const;
  EngineProgress Progress() const;  // now, not as of the last round
  const std::vector<ModelInfo>& Models() const;
  int64_t max_tokens_per_step() const;  // the budget in force (after -1 is resolved)
  // EngineOptions::lone_request_max_window in force (after -1 is resolved; 0: none; -2: from
  // the step-cost calibration, per method).
  int64_t lone_request_max_window() const;
  bool decode_thread() const;    // EngineOptions::decode_thread, -1 resolved
  int64_t decode_batch() const;  // EngineOptions::decode_batch, -1 resolved

  // Refuses new requests, lets queued and running ones finish for up to `grace`, then ends
  // what is left with UNAVAILABLE and stops the engine thread. Idempotent; returns when the
  // thread has stopped.
  void Shutdown(std::chrono::milliseconds grace);

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The seed an engine draws for a request without one: 63 random bits.
uint64_t RandomSeed();

}  // namespace imagegen
