#include "engine/scheduler/model_scheduler.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <limits>
#include <sstream>

#include "engine/model/cuda_stream.h"
#include "engine/model/device.h"
#include "engine/model/small_gemm.h"
#include "engine/util/read_file.h"
#include "engine/util/run_queue_wait.h"

namespace imagegen {
namespace {

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

SpecOptions BatchOptions(const EngineOptions& o) {
  SpecOptions s;
  s.batch_invariant = o.batch_invariant;
  s.cuda_graphs = o.cuda_graphs > 0;
  s.fused_verify = o.fused_verify;
  s.keep_cut_drafts = o.keep_cut_drafts;
  return s;
}

void AddDeltas(const std::vector<int64_t>& now, std::vector<int64_t>& seen,
               std::vector<int64_t>& delta) {
  delta.assign(now.size(), 0);
  seen.resize(now.size(), 0);
  for (size_t i = 0; i < now.size(); ++i) {
    delta[i] = now[i] - seen[i];
    seen[i] = now[i];
  }
}

// The few-row kernel's row range in the step-cost key (LoadOptions::small_rows_gemm_rows). Timed
// at load, the range is said as such and not as the rows chosen: those can differ by a step of
// the timing between two starts of a noisy machine (64 or 128 rows where the two are close),
// which changes steps of those rows by a few percent, for the online refinement to correct,
// not the 20 s of a new calibration.
std::string SmallRowsKeyPart(int64_t rows) {
  if (rows < 0) return "";
  if (rows == 0) return ", on the rows timed faster than the BLAS at load";
  return ", on up to " + std::to_string(rows) + " rows";
}

}  // namespace

ModelScheduler::ModelScheduler(const ImageModel& model, int64_t slots, const EngineOptions& opts,
                               DecodeQueue& decoder, EngineListener* listener)
    : FamilyScheduler(opts),
      model_(model),
      opts_(opts),
      decoder_(decoder),
      listener_(listener),
      slots_(slots),
      batch_(*model.gpt, model.draft.get(), slots, BatchOptions(opts)) {}

Status ModelScheduler::Calibrate(const LoadOptions& load) {
  if (opts_.window_policy != "goodput") return OkStatus();
  RETURN_IF_ERROR(LoadOrMeasureCost(load));
  lone_cost_ = cost_.OneRequest();  // before any online refinement
  if (opts_.fixed_step_cost.empty()) calibrated_cost_ = cost_;
  if (opts_.lone_request_max_window == kLoneWindowFromCalibration) {
    // Said at start, per drafting preset at its own window: what a request alone runs at.
    const ImageRequest probe = CalibrationRequest();
    const int64_t rows = probe.sampling.uses_cfg() ? 2 : 1;
    std::string list;
    for (const std::string& name : PresetNames()) {
      StatusOr<DecodingPolicy> p = PolicyFromPreset(name);
      if (!p.ok() || p->draft == DraftSource::kNone || p->window_invariant()) continue;
      list += (list.empty() ? "" : ", ") + name + " " +
              std::to_string(LoneCeiling(*p, CommitModel::Key(*p), rows)) + " of " +
              std::to_string(p->window);
    }
    Notice(opts_, model_.name + ": a request alone runs at most (nodes, by the step-cost " +
                      "calibration): " + list);
  }
  return OkStatus();
}

int64_t ModelScheduler::LoneCeiling(const DecodingPolicy& policy, const std::string& key,
                                    int64_t rows) {
  if (opts_.lone_request_max_window != kLoneWindowFromCalibration) return 0;
  const auto at = std::make_tuple(key, rows, policy.window);
  auto it = lone_ceilings_.find(at);
  if (it == lone_ceilings_.end()) {
    it = lone_ceilings_
             .emplace(at, LoneRequestCeiling(lone_cost_, key, rows, policy.window,
                                             opts_.min_speculation_gain))
             .first;
  }
  return it->second;
}

Status ModelScheduler::LoadOrMeasureCost(const LoadOptions& load) {
  if (!opts_.fixed_step_cost.empty()) {
    cost_ = StepCostModel::Linear(opts_.fixed_step_cost[0], opts_.fixed_step_cost[1],
                                  opts_.fixed_step_cost[2]);
    if (opts_.simulated_step_noise > 0 && opts_.refine_step_cost) {
      // The formula at the shapes a calibration measures, as a calibration refined online.
      const StepCostModel formula = cost_;
      std::vector<StepCostSample> samples;
      for (int64_t r = 1; r <= std::max<int64_t>(slots_ / 2, 1); r *= 2) {
        for (int64_t t = 2 * r; t <= 4096; t *= 2) samples.push_back({t, r, formula.Predict(t, r)});
      }
      cost_ = StepCostModel();
      RETURN_IF_ERROR(cost_.Calibrate(samples));
    }
    return OkStatus();
  }
  // What the step time depends on besides the step's shape: the model, where and how it runs.
  const GptConfig& c = model_.gpt->config();
  const std::string device = load.device.str();
  const std::string dtype = c10::toString(load.dtype);
  // The processor's model too: a cache directory shared by unlike nodes (a volume, an image
  // built on one machine) must not hand one device's costs to another.
  const std::string processor = DeviceModelName(load.device);
  std::ostringstream key;
  key << model_.name << " (dim " << c.dim << ", layers " << c.n_layer << ", vocab " << c.vocab_size
      << ", tokens " << c.block_size << ", weights " << model_.gpt->weight_bytes() << " B"
      << (model_.draft ? ", draft " + c.draft_model : std::string()) << ") on " << device
      << (processor.empty() ? std::string() : " (" + processor + ")") << " " << dtype
      << (load.device.is_cpu() ? ", " + std::to_string(at::get_num_threads()) + " threads" +
                                     (EngineKernelThreads() > 1 ? " (engine kernels too)" : "")
                               : std::string())
      << (opts_.cuda_graphs > 0         ? ", CUDA graphs"
          : !opts_.batch_invariant      ? ""
          : model_.gpt->row_attention() ? ", batch-invariant, row attention on every row"
                                        : ", batch-invariant")
      << (model_.gpt->engine_linear() && opts_.cuda_graphs <= 0
              ? ", the engine's kernel on every linear product"
          : model_.gpt->small_rows_tried() > 0 && opts_.cuda_graphs <= 0 && opts_.batch_invariant
              ? ", few-row kernel on " + std::to_string(model_.gpt->small_rows_linears()) + " of " +
                    std::to_string(model_.gpt->small_rows_tried()) + " linear layers" +
                    SmallRowsKeyPart(model_.gpt->options().small_rows_gemm_rows)
              : std::string())
      << (model_.gpt->bf16_matmul_tried() > 0
              ? ", bf16 products (AMX) on " + std::to_string(model_.gpt->bf16_matmul_linears()) +
                    " of " + std::to_string(model_.gpt->bf16_matmul_tried()) + " linear layers"
              : std::string())
      << (model_.gpt->norm_kernel() ? ", norm kernel" : "")
      << (model_.gpt->rope_kernel() ? ", rope kernel" : "");
  if (opts_.batch_invariant && opts_.cuda_graphs <= 0 && model_.gpt->small_rows_over_size()) {
    // The few-row kernel keeps a second copy of the weights, so it is not tried on large
    // models unless asked for: their one-request steps pay for 16 rows.
    Notice(opts_, model_.name + ": " + std::to_string(model_.gpt->linear_weight_bytes() >> 20) +
                      " MB of linear weights, over the few-row kernel's " +
                      std::to_string(kSmallGemmMaxWeightBytes >> 20) +
                      " MB: products of fewer than 16 rows are padded to 16 (--cpu_linear=engine "
                      "runs the engine's kernel on every row count, with a second copy of the "
                      "weights)");
  }
  if (model_.gpt->small_rows_linears() < model_.gpt->small_rows_tried()) {
    // Said only where the few-row kernel does not reproduce this machine's BLAS for every layer
    // (the key above, kept in the step-cost cache, says it either way).
    Notice(opts_, model_.name + ": the few-row kernel reproduces the BLAS for " +
                      std::to_string(model_.gpt->small_rows_linears()) + " of " +
                      std::to_string(model_.gpt->small_rows_tried()) +
                      " linear layers; the others pad their few-row products to 16 rows");
  }
  const Gpt& gpt = *model_.gpt;
  if (load.device.is_cpu() && load.dtype == at::kFloat &&
      gpt.options().fused_norm_rope.value_or(true) && (!gpt.norm_kernel() || !gpt.rope_kernel())) {
    // Said only where a kernel's load-time check failed (another ATen or CPU than measured).
    const char* which = !gpt.norm_kernel() && !gpt.rope_kernel()
                            ? "the RMSNorm and rotary kernels do"
                        : !gpt.norm_kernel() ? "the RMSNorm kernel does"
                                             : "the rotary kernel does";
    Notice(opts_,
           model_.name + ": " + which + " not reproduce ATen's ops here; the ops run instead");
  }
  // A calibration measured with fewer requests at a time than this engine's slots allow (an
  // engine with a small pool wrote it) would leave the cost of many requests to extrapolation.
  const ImageRequest probe = CalibrationRequest();
  const std::vector<int64_t> sizes = CalibrationSizes(probe);
  const int64_t can_measure = sizes.empty() ? 0 : sizes.back();
  std::string path;
  if (!opts_.cache_dir.empty()) {
    // CUDA graphs cost differently from the eager forward, bf16 products from fp32 ones, the
    // engine's kernel on every row (--cpu_linear=engine) from the BLAS's products, and
    // on the CPU each intra-op thread count from the others: files of their own, so that the
    // modes do not replace each other's calibration (a daemon restarted with another CPU quota,
    // hence another count, and back would otherwise measure again at every start).
    path = opts_.cache_dir + "/step-cost-" + FileSafe(model_.name) + "-" + FileSafe(device) + "-" +
           FileSafe(dtype) +
           (load.device.is_cpu() ? "-" + std::to_string(at::get_num_threads()) + "threads"
                                 : std::string()) +
           (opts_.cuda_graphs > 0 ? "-graphs" : "") +
           (model_.gpt->bf16_matmul_linears() > 0 ? "-bf16mm" : "") +
           (model_.gpt->engine_linear() ? "-enginelinear" : "") + ".json";
    StatusOr<std::string> text = ReadFile(path);
    if (text.ok()) {
      Status st = cost_.Deserialize(*text, key.str(), path);
      if (st.ok() && cost_.CalibratedRequests() < can_measure) {
        st = FailedPrecondition(
            path + ": calibrated for at most " + std::to_string(cost_.CalibratedRequests()) +
            " concurrent request(s); this engine can measure " + std::to_string(can_measure));
      }
      if (st.ok() && opts_.step_cost_spot_check > 0) st = SpotCheckCalibration(probe, path);
      if (st.ok()) {
        Notice(opts_, "step cost of " + model_.name + ": read from " + path +
                          (opts_.step_cost_spot_check > 0 ? " (spot-checked)" : ""));
        return OkStatus();
      }
      Notice(opts_, "recalibrating the step cost: " + st.ToString());
    }
  }
  // Start-up's longest part on a CPU (up to 20 s a model): said, so that the wait for "ready"
  // is not silent.
  const auto start = Clock::now();
  const std::vector<StepCostSample> samples = MeasureStepCost(probe);
  RETURN_IF_ERROR(cost_.Calibrate(samples));
  cost_.planned_requests = can_measure;  // also when the 20 s limit cut the measurement short
  std::ostringstream msg;
  msg.precision(3);
  msg << "step cost of " << model_.name << ": calibrated on " << samples.size()
      << " step shapes (up to " << cost_.CalibratedRequests() << " requests at a time) in "
      << Seconds(start, Clock::now()) << " s";
  if (!path.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(opts_.cache_dir, ec);
    if (Status st = WriteFileAtomically(path, cost_.Serialize(key.str())); !st.ok()) {
      Notice(opts_, "the step-cost calibration is not cached: " + st.ToString());
    } else {
      msg << ", cached in " << path;
    }
  }
  Notice(opts_, msg.str());
  return OkStatus();
}

ImageRequest ModelScheduler::CalibrationRequest() const {
  const GptConfig& c = model_.gpt->config();
  ImageRequest req;
  req.sampling.cfg_scale = c.default_cfg_scale;
  req.sampling.temperature = c.default_temperature;
  req.sampling.top_k = c.default_top_k;
  req.sampling.top_p = c.default_top_p;
  if (c.prompted()) req.prompt = {0};  // one token: no prefill, the steps are decoding steps
  req.policy = *PolicyFromPreset("sjd", std::max<int64_t>(std::min<int64_t>(64, c.block_size), 2));
  if (!ValidateImageRequest(req, *model_.gpt, nullptr).ok()) req.policy = *PolicyFromPreset("ar");
  return req;
}

std::vector<int64_t> ModelScheduler::CalibrationSizes(const ImageRequest& req) const {
  const int64_t rows = req.sampling.uses_cfg() ? 2 : 1;
  std::vector<int64_t> sizes;
  for (int64_t R : {1, 4, 16, 32}) {
    if (R * rows <= batch_.free_slots()) sizes.push_back(R);
  }
  return sizes;
}

// One shape timed: each request granted min(w, the nodes it still wants), at least one; one
// untimed step, then up to `timed` timed ones (fewer when a request finishes or a step fails).
std::vector<ModelScheduler::TimedStep> ModelScheduler::TimeShape(
    const std::vector<int64_t>& handles, int64_t w, int64_t timed) {
  std::vector<TimedStep> out;
  for (int64_t rep = 0; rep <= timed; ++rep) {
    std::vector<WindowGrant> grants;
    int64_t rows = 0;
    for (int64_t h : handles) {
      if (batch_.done(h)) return out;
      const int64_t g = std::max<int64_t>(1, std::min(w, batch_.WantedNodes(h)));
      grants.push_back({h, g});
      rows += g * batch_.RowsPerNode(h);
    }
    const auto t0 = Clock::now();
    if (!batch_.Step(grants).ok()) return out;
    if (rep > 0) out.push_back({rows, Seconds(t0, Clock::now())});
  }
  return out;
}

// Real steps of Jacobi requests (sjd) with windows of 1, 4, 16 and 64 nodes, for 1, 4, 16 and
// 32 requests at a time (as the KV slots allow; at most 4,096 forward rows), and for one request
// also 2, 8 and 32 nodes: up to 19 shapes, each the median of three timed steps (a noisy
// machine's outliers would otherwise pull the fit), and for one request the fastest of nine,
// timed in rounds (MeasureLoneRequest). Past 20 seconds (a slow or loaded device, which then leans
// on the online refinement) only each request count's narrowest shape is timed, so that the
// calibration still covers every request count (a cache that does not is measured again at the next
// start); and the lone rounds stop past 10 seconds once they have three timed steps of every width.
// (Before, everything stopped at 20 s: three engine tests starting at once on the 2-core VM each
// spent them on the lone rounds, and one failed to start, "no samples".) One request's shapes are
// every knot of the model up to 64 nodes because a request alone is planned on them
// (lone_request_full_window off, or a window-invariant method): between knots 4x apart the fit had
// to guess, and on a 2-core CPU it put 29 nodes (58 rows) at 8.2 ms where they took 6.2, so the
// planner chose 10 nodes, which were slower (docs/results-serving.md, "The match rule alone").
std::vector<StepCostSample> ModelScheduler::MeasureStepCost(ImageRequest req) {
  const int64_t wmax = req.policy.window;
  const int64_t rows = req.sampling.uses_cfg() ? 2 : 1;
  std::vector<StepCostSample> samples;
  const auto start = Clock::now();
  for (int64_t R : CalibrationSizes(req)) {
    std::vector<int64_t> handles;
    for (int64_t i = 0; i < R; ++i) {
      req.seed = static_cast<uint64_t>(i);
      StatusOr<int64_t> h = batch_.Add(req);
      if (h.ok()) handles.push_back(*h);
    }
    if (R == 1) {
      if (!handles.empty()) MeasureLoneRequest(req, handles, start, &samples);
      for (int64_t h : handles) batch_.Remove(h);
      continue;
    }
    const std::vector<int64_t> widths = {1, 4, 16, 64};
    const int64_t timed = 3;
    for (int64_t w : widths) {
      if ((w > wmax && w != 1) || R * w * rows > 4096) break;
      std::vector<TimedStep> steps = TimeShape(handles, w, timed);
      if (static_cast<int64_t>(steps.size()) == timed) {
        std::sort(steps.begin(), steps.end(),
                  [](const TimedStep& a, const TimedStep& b) { return a.seconds < b.seconds; });
        const TimedStep& median = steps[static_cast<size_t>(timed / 2)];
        samples.push_back({median.rows, static_cast<int64_t>(handles.size()), median.seconds});
      }
      if (Seconds(start, Clock::now()) > 20) break;  // the narrowest shape only
    }
    for (int64_t h : handles) batch_.Remove(h);
  }
  return samples;
}

// One request's shapes, every knot up to 64 nodes (see MeasureStepCost). They also decide a
// lone request's ceiling (LoneRequestCeiling), where a few percent between one node and two or
// four decide, so they are timed in rounds: kLoneRounds rounds of every width in ascending
// order, each an untimed step and a timed one, a fresh request each round (after a round that
// warms the shapes). A machine whose speed drifts over the calibration then weighs on every
// width alike. Timed one width after another instead (five steps each), eight calibrations on
// the 2-core CPU gave a lone scd-mc request 1, 4, 2, 2, 2, 1, 2 and 2 nodes, the step of two
// nodes 1.03-1.49x the step of one (docs/results-serving.md, "A lone request's ceiling, timed in
// rounds"). Fresh requests, because a step after a wider one costs more for a few steps: one
// node straight after 64 took 1.3 ms, falling to 0.75-0.9 over five steps.
//
// Each shape's sample is its fastest step of the rounds: other work on the cores only makes
// steps slower, and weighs least on the fastest. With a busy loop on one of the 2-core VM's
// cores, the rounds' medians gave a lone scd-mc request 1 node (speculation off, and cached so)
// in 4 of 9 calibrations, the fastest steps in none of 5 (quiet, both gave 2-4 nodes:
// docs/results-serving.md, "Cores shared with other work"). The batched shapes keep their
// medians of three: the calibrations' own spread between starts (the lone step of 2 rows took
// 0.65-1.3 ms on the quiet VM) is far wider than what lies between a fastest and a median step.
void ModelScheduler::MeasureLoneRequest(ImageRequest req, std::vector<int64_t>& handles,
                                        Clock::time_point start,
                                        std::vector<StepCostSample>* samples) {
  constexpr int64_t kLoneRounds = 9;
  const int64_t rows = req.sampling.uses_cfg() ? 2 : 1;
  std::vector<int64_t> widths;
  for (int64_t w : {1, 2, 4, 8, 16, 32, 64}) {
    if ((w > req.policy.window && w != 1) || w * rows > 4096) break;
    widths.push_back(w);
  }
  std::map<int64_t, std::vector<double>> seconds;  // by forward rows
  TimeShape(handles, 1, 1);                        // two steps that warm the device
  for (int64_t round = 0; round <= kLoneRounds && !handles.empty(); ++round) {
    for (int64_t w : widths) {
      if (w == 1 || batch_.done(handles[0]) || batch_.WantedNodes(handles[0]) < w) {
        batch_.Remove(handles[0]);
        req.seed += 1;
        StatusOr<int64_t> h = batch_.Add(req);
        if (!h.ok()) {
          handles.clear();
          break;
        }
        handles[0] = *h;
        TimeShape(handles, 1, 0);  // its first step, untimed
      }
      for (const TimedStep& t : TimeShape(handles, w, round > 0 ? 1 : 0)) {
        seconds[t.rows].push_back(t.seconds);
      }
    }
    if (round >= 3 && Seconds(start, Clock::now()) > 10) break;  // three timed steps a width
  }
  for (auto& [r, s] : seconds) {
    if (s.size() < 3) continue;  // a request's last steps, narrower than asked
    samples->push_back({r, 1, *std::min_element(s.begin(), s.end())});
  }
}

// One request's steps at windows of 1 and 16 nodes, the first of each untimed and then the
// fastest of three (load and stalls only make a step slower), against what the cached
// calibration predicts for them. A calibration that predicts every shape more than
// step_cost_spot_check (3) times too slow is replaced: it was timed during a stall of the
// machine, or on a slower device, and would keep the controller off the wide steps that could
// correct it. One that predicts every shape that much too fast is kept, with a notice: a
// machine loaded right now looks the same (another device's file has another key), and the
// refinement corrects a model that predicts too fast, since the controller then plans the
// steps it is wrong about.
Status ModelScheduler::SpotCheckCalibration(ImageRequest req, const std::string& path) {
  std::vector<int64_t> widths = {1};
  if (req.policy.window >= 16) widths.push_back(16);
  req.seed = 0;
  StatusOr<int64_t> h = batch_.Add(req);
  if (!h.ok()) return OkStatus();  // nothing to check with: keep the cache
  std::vector<double> ratios;
  std::ostringstream detail;
  detail.precision(3);
  for (int64_t w : widths) {
    const std::vector<TimedStep> steps = TimeShape({*h}, w);
    if (steps.empty()) continue;
    const TimedStep best = *std::min_element(
        steps.begin(), steps.end(),
        [](const TimedStep& a, const TimedStep& b) { return a.seconds < b.seconds; });
    const double predicted = cost_.Predict(best.rows, 1);
    ratios.push_back(best.seconds / predicted);
    detail << (ratios.size() > 1 ? "; " : "") << best.rows << " rows: measured "
           << best.seconds * 1e3 << " ms, cached " << predicted * 1e3 << " ms";
  }
  batch_.Remove(*h);
  const double factor = opts_.step_cost_spot_check;
  std::ostringstream times;
  times << factor;
  switch (JudgeSpotCheck(ratios, factor)) {
    case SpotCheck::kFaster:
      return FailedPrecondition(path + ": one request's steps ran more than " + times.str() +
                                "x faster than the cached calibration predicts (" + detail.str() +
                                ")");
    case SpotCheck::kSlower:
      Notice(opts_, "the step-cost calibration " + path + " is kept, though one request's steps " +
                        "ran more than " + times.str() + "x slower than it predicts (" +
                        detail.str() + "): a loaded machine, or a slowed device; " +
                        "the online refinement corrects it");
      return OkStatus();
    case SpotCheck::kConsistent:
      break;
  }
  return OkStatus();
}

std::vector<int64_t> ModelScheduler::PrefillChunks(const std::vector<size_t>& idx) const {
  int64_t left = opts_.prefill_tokens_per_step;
  bool progress = false;
  std::vector<int64_t> out;
  for (size_t i : idx) {
    const int64_t h = active_[i]->handle;
    const int64_t want = batch_.WantedNodes(h), rows = batch_.RowsPerNode(h);
    int64_t chunk = left > 0 ? std::min(want, left / rows) : 0;
    if (!progress && want > 0) chunk = std::max<int64_t>(chunk, 1);  // the oldest progresses
    progress |= chunk > 0;
    left -= chunk * rows;
    out.push_back(chunk);
  }
  return out;
}

std::vector<int64_t> ModelScheduler::ChooseWindows(const std::vector<size_t>& idx,
                                                   const std::vector<WindowDemand>& demand,
                                                   std::vector<double>& expected,
                                                   GoodputPlan& plan) {
  expected.assign(idx.size(), 0);
  if (opts_.window_policy != "goodput") {
    return AllocateWindows(demand, opts_.window_policy == "budget" ? opts_.max_tokens_per_step : 0);
  }
  std::vector<GoodputRequest> reqs;
  for (size_t i = 0; i < idx.size(); ++i) {
    const Job& j = *active_[idx[i]];
    const int64_t wanted = std::max<int64_t>(demand[i].wanted, 1);
    reqs.push_back(
        {demand[i].rows,
         ExpectedCommits(commits_, j.request.policy, j.commit_key, wanted, j.commits.Factor()),
         j.planned_window, j.request.policy.window_invariant()});
  }
  GoodputOptions go;
  go.max_slowdown = opts_.max_slowdown;
  go.max_tokens = opts_.max_tokens_per_step;
  go.stickiness = opts_.window_stickiness;
  go.min_gain = opts_.min_speculation_gain;
  go.lone_request_full_window = opts_.lone_request_full_window;
  go.lone_request_max_window = opts_.lone_request_max_window;
  if (go.lone_request_max_window == kLoneWindowFromCalibration) {
    go.lone_request_max_window = reqs.size() == 1
                                     ? LoneCeiling(active_[idx[0]]->request.policy,
                                                   active_[idx[0]]->commit_key, reqs[0].rows)
                                     : 0;
  }
  // One planned step in explore_every (16) explores a plan twice as wide; a request alone
  // only where it is planned (not given its whole window), so that the cost model also sees
  // the wider steps a lone request would otherwise never take. Exploring is paid from a
  // credit of explore_budget of every planned step's predicted time: a step due to explore
  // that costs more (predicted) than the credit holds plans as usual, and the next planned
  // steps try again.
  const bool planned =
      reqs.size() > 1 ||
      (reqs.size() == 1 && (!go.lone_request_full_window || reqs[0].window_invariant));
  if (planned && opts_.explore_every > 0 && ++planned_steps_ % opts_.explore_every == 0) {
    explore_due_ = true;
  }
  plan = PlanGoodput(reqs, cost_, go);
  bool explore = false;
  if (planned && explore_due_ && opts_.explore_budget > 0) {
    // No wider plan keeps the fairness bound: the step explores at the plan's own windows.
    GoodputPlan widened = plan.wider.empty() ? plan : PlanOfWindows(reqs, cost_, plan.wider);
    const double extra = std::max(0.0, widened.seconds - plan.seconds);
    if (extra <= explore_credit_s_ || opts_.explore_budget >= 1) {
      explore_credit_s_ = std::max(0.0, explore_credit_s_ - extra);
      explore_extra_s_ = extra;
      explore_due_ = false;
      explore = true;
      plan = std::move(widened);
    }
  }
  if (planned && opts_.explore_budget > 0) {
    // At most the budget's share of about 256 such steps held at once, so that a long calm
    // run does not pay for a burst of exploring later.
    explore_credit_s_ = std::min(explore_credit_s_ + opts_.explore_budget * plan.seconds,
                                 opts_.explore_budget * 256 * plan.seconds);
  }
  explored_ = explore;
  for (size_t i = 0; i < reqs.size(); ++i) {
    expected[i] = reqs[i].expected[plan.windows[i] - 1];
    // What the next step may hold: not an exploring step's windows.
    if (!explore) active_[idx[i]]->planned_window = plan.windows[i];
  }
  return plan.windows;
}

Clock::time_point ModelScheduler::next_deadline() const {
  Clock::time_point t = Clock::time_point::max();
  for (const auto& j : waiting_.jobs()) t = std::min(t, j->params.deadline);
  for (const auto& j : active_) t = std::min(t, j->params.deadline);
  return t;
}

void ModelScheduler::End(Job& job, const Status& status) {
  if (job.handle >= 0) {
    batch_.Remove(job.handle);
    job.handle = -1;
  }
  NotifyError(*job.observer, status);
}

void ModelScheduler::EndAll(const Status& status, Outcomes& out) {
  std::vector<std::unique_ptr<Job>> waiting = waiting_.TakeAll();
  for (auto& j : active_) {
    if (j) End(*j, status);  // null after an exception escaped a step's clean-up (EndAll then)
  }
  for (auto& j : waiting) End(*j, status);
  out.failed += static_cast<int64_t>(active_.size() + waiting.size());
  active_.clear();
}

bool ModelScheduler::Tick(const std::unordered_set<int64_t>& cancelled, Clock::time_point now,
                          Outcomes& out) {
  // Cancellations and deadlines take effect here, between steps, and free the slots at once.
  auto ended = [&](Job& j) {
    if (cancelled.count(j.id) > 0) {
      End(j, Cancelled("request " + std::to_string(j.id) + " cancelled"));
      out.cancelled += 1;
      return true;
    }
    if (now >= j.params.deadline) {
      End(j, DeadlineExceeded("deadline exceeded after " +
                              std::to_string(j.handle >= 0 ? batch_.stats(j.handle).nfe : 0) +
                              " steps"));
      out.expired += 1;
      return true;
    }
    return false;
  };
  waiting_.EraseIf(ended);
  std::erase_if(active_, [&](const std::unique_ptr<Job>& j) { return ended(*j); });
  Admit(out);
  if (active_.empty()) return false;
  Step(out);
  return true;
}

// In the WaitQueue's order (priority, then the client with the fewest requests running, then
// the oldest); the request next in that order is never overtaken (nothing starves). It needs
// its KV slots and room in the token budget for one token of every active request plus its own.
void ModelScheduler::Admit(Outcomes& out) {
  int64_t rows = 0;
  WaitQueue::Running running;
  for (const auto& j : active_) {
    rows += batch_.RowsPerNode(j->handle);
    running.Add(*j);
  }
  const auto now = Clock::now();
  while (Job* next = waiting_.Next(running)) {
    Job& j = *next;
    const int64_t need = j.request.sampling.uses_cfg() ? 2 : 1;
    const bool fits = batch_.free_slots() >= need &&
                      (opts_.max_tokens_per_step <= 0 || rows + need <= opts_.max_tokens_per_step);
    if (!fits && !(opts_.preemption && Preempt(j, need, rows, running, out))) break;
    if (j.handle >= 0) {  // preempted earlier: takes slots again and recomputes its entries
      if (Status st = batch_.Resume(j.handle); !st.ok()) {
        End(j, st);
        out.failed += 1;
        waiting_.Take(&j);
        continue;
      }
    } else {
      int64_t share = -1;  // a running request with the same prompt shares its prefill
      for (size_t k = 0; k < active_.size() && share < 0 && !j.request.prompt.empty(); ++k) {
        if (SharesPrefill(active_[k]->request, j.request, model_.gpt->config())) {
          share = active_[k]->handle;
        }
      }
      StatusOr<int64_t> h = batch_.Add(j.request, share);
      if (!h.ok()) {  // validated at submission; only a model-level surprise gets here
        NotifyError(*j.observer, h.status());
        out.failed += 1;
        waiting_.Take(&j);
        continue;
      }
      j.handle = *h;
      j.started = now;
      j.last_preview = now;
    }
    rows += need;
    running.Add(j);
    if (j.commit_key.empty()) j.commit_key = CommitModel::Key(j.request.policy);
    active_.push_back(waiting_.Take(&j));
  }
}

bool ModelScheduler::Preempt(const Job& next, int64_t need, int64_t& rows,
                             WaitQueue::Running& running, Outcomes& out) {
  // The candidates, least urgent first, then the newest (usually the least work lost).
  std::vector<size_t> order;
  int64_t slots = batch_.free_slots(), room = rows;
  for (size_t i = 0; i < active_.size(); ++i) {
    if (active_[i]->params.priority <= next.params.priority) continue;
    order.push_back(i);
    slots += batch_.RowsPerNode(active_[i]->handle);
    room -= batch_.RowsPerNode(active_[i]->handle);
  }
  const int64_t budget = opts_.max_tokens_per_step;
  if (slots < need || (budget > 0 && room + need > budget)) return false;  // would not help
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Job& x = *active_[a];
    const Job& y = *active_[b];
    if (x.params.priority != y.params.priority) return x.params.priority > y.params.priority;
    return x.id > y.id;
  });
  // Victims in that order until it fits; then those it still fits without, the first chosen
  // first (a larger victim chosen later may have made a smaller one unnecessary).
  auto fits = [&](int64_t free, int64_t used) {
    return free >= need && (budget <= 0 || used + need <= budget);
  };
  std::vector<size_t> chosen;
  int64_t free = batch_.free_slots(), used = rows;
  for (size_t i : order) {
    if (fits(free, used)) break;
    chosen.push_back(i);
    free += batch_.RowsPerNode(active_[i]->handle);
    used -= batch_.RowsPerNode(active_[i]->handle);
  }
  std::vector<bool> gone(active_.size(), false);
  for (size_t i : chosen) {
    const int64_t r = batch_.RowsPerNode(active_[i]->handle);
    if (fits(free - r, used + r)) {
      free -= r;
      used += r;
      continue;
    }
    Job& v = *active_[i];
    batch_.Suspend(v.handle);
    v.preemptions += 1;
    running.Remove(v);
    gone[i] = true;
    out.preempted += 1;
  }
  rows = used;
  for (size_t i = active_.size(); i-- > 0;) {
    if (gone[i]) {
      waiting_.Push(std::move(active_[i]));
      active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  return true;
}

void ModelScheduler::Discard(Job& job) {
  if (job.handle >= 0) batch_.Remove(job.handle);
  job.handle = -1;
}

// schedule (each request's window from the token budget) -> run (one SpecBatch step) ->
// postprocess (events, finished requests).
void ModelScheduler::Step(Outcomes& out) {
  const auto t0 = Clock::now();
  // Decoding requests get windows from the window policy; prefilling ones prompt chunks.
  std::vector<size_t> dec, pre;
  std::vector<WindowDemand> dec_demand;
  for (size_t i = 0; i < active_.size(); ++i) {
    const int64_t h = active_[i]->handle;
    if (batch_.prefilling(h)) {
      pre.push_back(i);
    } else {
      dec.push_back(i);
      dec_demand.push_back({batch_.WantedNodes(h), batch_.RowsPerNode(h)});
    }
  }
  std::vector<double> dec_expected;
  GoodputPlan plan;
  const std::vector<int64_t> dec_windows = ChooseWindows(dec, dec_demand, dec_expected, plan);
  const std::vector<int64_t> chunks = PrefillChunks(pre);
  // Per active request: its window (0 while prefilling), demand and expected commits.
  std::vector<int64_t> windows(active_.size(), 0);
  std::vector<WindowDemand> demand(active_.size());
  std::vector<double> expected(active_.size(), 0);
  std::vector<bool> decoding(active_.size(), false);
  std::vector<WindowGrant> grants;
  StepSample sample;
  sample.plan_seconds = Seconds(t0, Clock::now());
  sample.model = model_.name;
  sample.requests = static_cast<int64_t>(active_.size());
  for (size_t k = 0; k < dec.size(); ++k) {
    const size_t i = dec[k];
    windows[i] = dec_windows[k];
    demand[i] = dec_demand[k];
    expected[i] = dec_expected[k];
    decoding[i] = true;
    grants.push_back({active_[i]->handle, windows[i]});
    sample.budget_limited |= windows[i] < demand[i].wanted;
    sample.tokens += windows[i] * demand[i].rows;
  }
  for (size_t k = 0; k < pre.size(); ++k) {
    const int64_t h = active_[pre[k]]->handle;
    grants.push_back({h, chunks[k]});
    sample.tokens += chunks[k] * batch_.RowsPerNode(h);
  }
  std::vector<size_t> traced;  // index into sample.trace, per active request (trace_steps)
  if (opts_.trace_steps) {
    traced.assign(active_.size(), 0);
    TraceStep(dec, windows, demand, expected, sample, traced);
  }
  Status st;
  const ForwardGraphStats graphs_before = batch_.graph_stats();
  try {
    InjectFailure();
    st = batch_.Step(grants);
  } catch (const std::exception& e) {
    st = Internal(std::string("step failed: ") + e.what());
  }
  CountStep(st);
  if (!st.ok()) {
    // The requests in the batch cannot go on (a failing forward would fail again), so they
    // end with the error and the engine serves the rest.
    for (auto& j : active_) End(*j, Internal("generation failed: " + st.message()));
    out.failed += static_cast<int64_t>(active_.size());
    active_.clear();
    return;
  }
  const auto t1 = Clock::now();
  const ForwardGraphStats graphs = batch_.graph_stats();
  sample.graph_captures = graphs.captures - graphs_before.captures;
  sample.graph_capture_failures = graphs.capture_failures - graphs_before.capture_failures;
  if (sample.graph_capture_failures > 0) {
    Notice(opts_, "CUDA graphs: a capture of model " + model_.name +
                      "'s forward failed; that shape bucket runs without a graph from now on: " +
                      graphs.last_failure);
  }
  if (cost_.calibrated()) {
    sample.predicted_seconds =
        plan.seconds > 0 ? plan.seconds : cost_.Predict(sample.tokens, sample.requests);
  }
  if (calibrated_cost_.calibrated()) {
    sample.calibrated_seconds = calibrated_cost_.Predict(sample.tokens, sample.requests);
  }
  sample.expected_committed = plan.expected;
  std::vector<StepEvent> events(active_.size());  // for the requests that decoded this step
  std::vector<size_t> due;                        // requests whose preview is due this step
  for (size_t i = 0; i < active_.size(); ++i) {
    if (!decoding[i]) continue;  // prefilling: no event
    Job& j = *active_[i];
    if (j.first_token == Clock::time_point()) j.first_token = t1;
    sample.committed += static_cast<int64_t>(batch_.tokens(j.handle).size() - j.reported);
    events[i] = Event(j, windows[i]);
    const auto committed = static_cast<int64_t>(events[i].positions.size());
    if (opts_.trace_steps) sample.trace[traced[i]].committed = committed;
    // A step that widened the window (or the request's first) commits what its refined
    // drafts allow, not what the window held would: not learned from unless asked
    // (EngineOptions::commit_learn_growth).
    const bool refined = j.steps > 0 && windows[i] <= j.last_window;
    if (j.request.policy.draft != DraftSource::kNone && (refined || opts_.commit_learn_growth)) {
      // The request against its method's expectation (without its own factor; not in its
      // warm-up), then the method's table.
      const std::string& key = j.commit_key;
      j.commits.Observe(j.steps, committed, commits_.Expected(key, windows[i]),
                        opts_.commit_warmup_steps);
      commits_.Observe(key, windows[i], committed);
    }
    if (j.steps > 0) j.window_change_sum += std::abs(windows[i] - j.last_window);
    j.last_window = windows[i];
    j.steps += 1;
    j.window_sum += windows[i];
    j.expected_sum += expected[i];
    if (PreviewDue(j)) due.push_back(i);
  }
  due = PreviewsThisStep(std::move(due), Seconds(t0, t1),
                         [&](size_t i) { return active_[i]->last_preview; });
  double spent = 0;
  if (!due.empty()) {
    const auto p0 = Clock::now();
    AddPreviews(due, events);
    spent = Seconds(p0, Clock::now());
    previews_.Spent(due.size(), spent);
    for (size_t i : due) {
      Job& j = *active_[i];
      PreviewServed(j, batch_.stats(j.handle).nfe,
                    static_cast<int64_t>(batch_.tokens(j.handle).size()),
                    model_.gpt->config().block_size);
      j.last_preview = p0;
    }
  }
  for (size_t i = 0; i < active_.size(); ++i) {
    if (decoding[i]) NotifyStep(*active_[i]->observer, events[i]);
  }
  // What the step-cost model predicts: the step from planning to the observers, previews
  // excluded (they have their own budget) and so is decoding the finished images.
  sample.step_seconds = Seconds(t0, Clock::now()) - spent;
  // A step that captured a CUDA graph paid a one-off cost, tens of replays. It is counted, as
  // at most max_ratio times the prediction (StepCostModel); leaving it out
  // (refine_on_captures false) also lost what the first visit of each new bucket says, and in
  // replays of an H200's costs did worse than the bound alone (docs/results-serving.md,
  // "Graph captures in the refinement").
  const bool replay = opts_.simulated_step_noise > 0 && !opts_.fixed_step_cost.empty();
  double seconds = sample.step_seconds;
  if (replay) seconds = ReplayedSeconds(sample, windows, decoding);
  if (cost_.calibrated() && opts_.refine_step_cost &&
      (sample.graph_captures == 0 || opts_.refine_on_captures)) {
    cost_.max_ratio = opts_.step_cost_max_ratio;
    cost_.Observe(sample.tokens, sample.requests, seconds);
  }
  for (auto& j : active_) {
    j->predicted_sum += sample.predicted_seconds;
    j->measured_sum += sample.step_seconds;
  }
  std::vector<DecodeQueue::Finished> finished;
  std::erase_if(active_, [&](std::unique_ptr<Job>& j) {
    if (!batch_.done(j->handle)) return false;
    Finish(*j, decoder_.max_batch() > 1 ? &finished : nullptr);
    return true;
  });
  if (!finished.empty()) {
    decoder_.CompleteBatch(
        model_.vq.get(), std::move(finished),
        [vq = model_.vq.get()](const std::vector<const RequestResult*>& results) {
          std::vector<std::vector<int32_t>> grids;
          for (const RequestResult* r : results) grids.push_back(r->tokens);
          std::vector<StatusOr<Image>> images;
          StatusOr<at::Tensor> pixels = TokensToPixels(*vq, grids);
          for (size_t b = 0; b < results.size(); ++b) {
            if (!pixels.ok()) {
              images.emplace_back(pixels.status());
            } else {
              images.emplace_back(PixelsToImage((*pixels)[static_cast<int64_t>(b)]));
            }
          }
          return images;
        });
  }
  sample.seconds = Seconds(t0, Clock::now());
  sample.cpu_wait_seconds =
      RunQueueWaitSinceLastCall(opts_.schedstat_path.empty() ? nullptr
                                                             : opts_.schedstat_path.c_str())
          .value_or(-1);
  NotifyListener(listener_, sample);
}

// StepSample::trace before the step: what the controller saw for each decoding request (its
// factor before this step's commits), and the step-cost model's time for the wanted windows.
void ModelScheduler::TraceStep(const std::vector<size_t>& dec, const std::vector<int64_t>& windows,
                               const std::vector<WindowDemand>& demand,
                               const std::vector<double>& expected, StepSample& sample,
                               std::vector<size_t>& traced) {
  sample.explore = opts_.window_policy == "goodput" && explored_;
  sample.explore_extra_seconds = sample.explore ? explore_extra_s_ : 0;
  int64_t wanted_tokens = sample.tokens;
  for (size_t i : dec) {
    const Job& j = *active_[i];
    const int64_t wanted = std::max<int64_t>(demand[i].wanted, 1);
    wanted_tokens += (wanted - windows[i]) * demand[i].rows;
    StepSample::RequestTrace t;
    t.id = j.id;
    t.method = j.request.policy.preset;
    t.wanted = wanted;
    t.window = windows[i];
    t.rows = demand[i].rows;
    t.factor = j.commits.Factor();
    t.expected = expected[i];
    t.expected_wanted =
        ExpectedCommits(commits_, j.request.policy, j.commit_key, wanted, t.factor).back();
    traced[i] = sample.trace.size();
    sample.trace.push_back(std::move(t));
  }
  if (cost_.calibrated()) {
    sample.wanted_predicted_seconds = cost_.Predict(wanted_tokens, sample.requests);
  }
}

// EngineOptions::fixed_step_cost with simulated_step_noise: the time the refinement sees for
// this step on the device the formula models (its tree and capture costs included), instead
// of this host's. A simulated capture is reported in the sample.
double ModelScheduler::ReplayedSeconds(StepSample& sample, const std::vector<int64_t>& windows,
                                       const std::vector<bool>& decoding) {
  const std::vector<double>& f = opts_.fixed_step_cost;
  int64_t trees = 0, rows = 0, widest = 0;  // trees: requests whose window holds their tree
  for (size_t i = 0; i < active_.size(); ++i) {
    const int64_t h = active_[i]->handle;
    rows += batch_.RowsPerNode(h);
    widest = std::max(widest, windows[i]);
    const DecodingPolicy& p = active_[i]->request.policy;
    if (!decoding[i] || !p.has_tree()) continue;
    int64_t full = 1, level = 1;
    for (int64_t d = 1; d < p.tree_depth; ++d) full += (level *= p.tree_branches);
    trees += windows[i] >= full ? 1 : 0;
  }
  double t = StepCostModel::Linear(f[0], f[1], f[2]).Predict(sample.tokens, sample.requests) +
             opts_.simulated_tree_cost * static_cast<double>(trees);
  if (opts_.simulated_capture_cost > 0) {
    if (replayed_buckets_.insert(StaticShape::Of(sample.tokens, rows, widest, trees)).second) {
      t *= opts_.simulated_capture_cost;
      sample.graph_captures += 1;
    }
  }
  return t *
         std::exp(opts_.simulated_step_noise * std::normal_distribution<double>(0, 1)(noise_rng_));
}

StepEvent ModelScheduler::Event(Job& j, int64_t window) {
  const std::vector<int64_t>& toks = batch_.tokens(j.handle);
  const SpecStats& s = batch_.stats(j.handle);
  StepEvent ev;
  ev.request_id = j.id;
  ev.step = s.nfe;
  ev.window = window;
  for (size_t i = j.reported; i < toks.size(); ++i) {
    ev.positions.push_back(static_cast<int32_t>(i));
    ev.tokens.push_back(static_cast<int32_t>(toks[i]));
  }
  j.reported = toks.size();
  ev.verified = s.drafts_verified - j.verified;
  ev.accepted = s.drafts_accepted - j.accepted;
  j.verified = s.drafts_verified;
  j.accepted = s.drafts_accepted;
  AddDeltas(s.verified_at_depth, j.verified_at_depth, ev.verified_at_depth);
  AddDeltas(s.accepted_at_depth, j.accepted_at_depth, ev.accepted_at_depth);
  const bool done = batch_.done(j.handle);
  if (j.params.stream_drafts && !done) {
    const std::vector<int64_t> d = batch_.drafts(j.handle);
    for (size_t i = 0; i < d.size(); ++i) {
      ev.draft_positions.push_back(static_cast<int32_t>(toks.size() + i));
      ev.draft_tokens.push_back(static_cast<int32_t>(d[i]));
    }
  }
  ev.totals = {s.nfe, s.draft_forwards, s.drafts_verified, s.drafts_accepted,
               static_cast<int64_t>(toks.size())};
  ev.total_tokens = model_.gpt->config().block_size;
  return ev;
}

bool ModelScheduler::PreviewDue(const Job& j) const {
  return PreviewDueAt(j, batch_.stats(j.handle).nfe,
                      static_cast<int64_t>(batch_.tokens(j.handle).size()),
                      model_.gpt->config().block_size);
}

// The result, then the image: decoded by the decode queue (on its thread, or now), which then
// completes the request. Images that finish in one step go to it together (decode_batch).
void ModelScheduler::Finish(Job& j, std::vector<DecodeQueue::Finished>* batch) {
  SpecResult r = batch_.Take(j.handle);
  j.handle = -1;
  const auto t_end = Clock::now();
  const RequestCounters counters{r.stats.nfe, r.stats.draft_forwards, r.stats.drafts_verified,
                                 r.stats.drafts_accepted, static_cast<int64_t>(r.tokens.size())};
  RequestResult res =
      FinishedResult(j, model_.name, model_.gpt->config().grid(), counters, r.stats.step_tokens,
                     r.stats.verified_at_depth, r.stats.accepted_at_depth, t_end);
  res.tokens = r.tokens;
  RequestStats& st = res.stats;
  st.prefill_forwards = r.stats.prefill_forwards;
  st.preemptions = j.preemptions;
  st.mean_window =
      j.steps > 0 ? static_cast<double>(j.window_sum) / static_cast<double>(j.steps) : 0;
  st.mean_window_change =
      j.steps > 1 ? static_cast<double>(j.window_change_sum) / static_cast<double>(j.steps - 1) : 0;
  st.expected_tokens = j.expected_sum;
  st.predicted_step_seconds = j.predicted_sum;
  st.measured_step_seconds = j.measured_sum;
  if (batch != nullptr && j.params.decode_image) {
    batch->push_back({j.observer, std::move(res), t_end});
    return;
  }
  DecodeQueue::ImageDecode decode;
  if (j.params.decode_image) {
    decode = [vq = model_.vq.get()](const RequestResult& r) {
      return TokensToImage(*vq, r.tokens);
    };
  }
  decoder_.Complete(j.observer, std::move(res), t_end, std::move(decode));
}

// The grid so far: committed tokens, then the drafts the next step will verify, then code 0;
// the pixels of tokens not yet committed are faded toward grey. All previews due in a step are
// decoded in one decoder call (the engine thread's only per-preview work; PNG encoding happens
// at the edge). Best effort: on failure the events carry no preview.
void ModelScheduler::AddPreviews(const std::vector<size_t>& due, std::vector<StepEvent>& events) {
  if (due.empty()) return;
  const int64_t N = model_.gpt->config().block_size, g = model_.gpt->config().grid();
  std::vector<std::vector<int32_t>> grids;
  for (size_t i : due) {
    const std::vector<int64_t>& toks = batch_.tokens(active_[i]->handle);
    const std::vector<int64_t> drafts = batch_.drafts(active_[i]->handle);
    std::vector<int32_t> ids(static_cast<size_t>(N), 0);
    for (size_t k = 0; k < toks.size(); ++k) ids[k] = static_cast<int32_t>(toks[k]);
    for (size_t k = 0; k < drafts.size() && toks.size() + k < ids.size(); ++k) {
      ids[toks.size() + k] = static_cast<int32_t>(drafts[k]);
    }
    grids.push_back(std::move(ids));
  }
  try {
    StatusOr<at::Tensor> pixels = TokensToPixels(*model_.vq, grids);
    if (!pixels.ok()) return;
    at::Tensor px = *pixels;                       // [B, H, W, C]
    const int64_t H = px.size(1), W = px.size(2);  // multiples of g (the decoder upsamples)
    for (size_t b = 0; b < due.size(); ++b) {
      at::Tensor one = px[static_cast<int64_t>(b)];
      const auto committed = static_cast<int64_t>(batch_.tokens(active_[due[b]]->handle).size());
      at::Tensor pending = (at::arange(N) >= committed).view({g, g});  // dim these cells
      pending = pending.repeat_interleave(H / g, 0).repeat_interleave(W / g, 1).unsqueeze(-1);
      one = at::where(pending, one.div(4, "floor").add(96), one);
      events[due[b]].preview = PixelsToImage(one);
    }
  } catch (const std::exception&) {
  }
}

}  // namespace imagegen
