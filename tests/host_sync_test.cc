// The host-sync budget of a decoding step (issue 14): every preset's step, draft-model ones
// included, reads the device back exactly once (HostStep's packed verdicts), makes no other call
// that would make the host wait for a CUDA device (item(), nonzero, masked_select, unique, a
// blocking .to()/.cpu()), and sends its host data in a bounded number of non-blocking uploads.
// Counted on the CPU with SyncWatch and ThreadTransfers (engine/model/transfer.h); on a CUDA device
// also with LibTorch's own sync debug mode, which sees every synchronizing CUDA call.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#ifdef IMAGEGEN_TEST_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

#include "engine/decoding/fused_kernels.h"
#include "engine/decoding/speculative.h"
#include "engine/model/image_model.h"
#include "engine/model/models_dir.h"
#include "engine/model/transfer.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

struct StepCounts {
  int64_t steps = 0, readbacks = 0, syncing = 0, stray = 0, max_uploads = 0, uploads = 0;
  int64_t max_readbacks = 0, cuda_syncs = 0;
  // Device launches (LaunchCount) per step outside the target forward (the draft model's
  // forwards apart), the most in any step.
  int64_t max_other_launches = 0, max_draft_launches = 0, max_forward_launches = 0;
  std::vector<std::string> seen;
};

#ifdef IMAGEGEN_TEST_CUDA
// Counts the warnings of LibTorch's CUDA sync debug mode ("called a synchronizing CUDA
// operation").
class SyncWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++count;
  }
  int64_t count = 0;
};
#endif

ImageRequest Request(const ImageModel& m, const std::string& preset, int64_t cls, uint64_t seed) {
  const GptConfig& c = m.gpt->config();
  ImageRequest r;
  r.class_id = cls;
  r.seed = seed;
  r.sampling = {c.default_cfg_scale, c.default_temperature, c.default_top_k, c.default_top_p};
  r.policy = *PolicyFromPreset(preset);
  return r;
}

// Steps `images` images of `preset` (co-batched) to the end, counting per step. `launches`:
// also the device launches, split by StepTiming (whose device syncs around the forward would
// count as syncs on CUDA). `fused`: SpecOptions::fused_verify; `fused_probs`: its fused_probs.
StepCounts RunSteps(const ImageModel& m, const std::string& preset,
                    const VerifyRules* rules = nullptr, int images = 2, bool launches = false,
                    bool fused = true, int fused_probs = -1) {
  SpecOptions o;
  o.batch_invariant = true;
  o.rules = rules;
  o.fused_verify = fused;
  o.fused_probs = fused_probs;
  StepTiming timing;
  if (launches) o.timing = &timing;
  SpecBatch batch(*m.gpt, m.draft.get(), 2 * images, o);
  for (int i = 0; i < images; ++i) {
    EXPECT_TRUE(batch.Add(Request(m, preset, (7 + 3 * i) % 10, 1 + i)).ok());
  }
  StepCounts c;
  const bool cuda = m.gpt->options().device.is_cuda();
  while (batch.active() > 0) {
    const TransferCounts before = ThreadTransfers();
    const StepTiming was = timing;
    int64_t cuda_syncs = 0;
    {
      std::optional<LaunchCount> count;
      if (launches) count.emplace();
      SyncWatch watch;
#ifdef IMAGEGEN_TEST_CUDA
      SyncWarnings warnings;
      std::optional<c10::WarningUtils::WarningHandlerGuard> guard;
      if (cuda) {
        guard.emplace(&warnings);
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
      }
#endif
      const Status st = batch.Step();
      EXPECT_TRUE(st.ok()) << st.ToString();
#ifdef IMAGEGEN_TEST_CUDA
      if (cuda) {
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
        cuda_syncs = warnings.count;
      }
#endif
      c.syncing += watch.syncing_calls();
      c.stray += watch.stray_moves();
      for (const std::string& s : watch.seen()) {
        if (c.seen.size() < 8) c.seen.push_back(s);
      }
    }
    const TransferCounts& after = ThreadTransfers();
    const int64_t readbacks = after.readbacks - before.readbacks;
    const int64_t uploads = after.uploads - before.uploads;
    c.steps += 1;
    c.readbacks += readbacks;
    c.max_readbacks = std::max(c.max_readbacks, readbacks);
    c.uploads += uploads;
    c.max_uploads = std::max(c.max_uploads, uploads);
    c.cuda_syncs = std::max(c.cuda_syncs, cuda_syncs);
    const int64_t draft = timing.draft_launches - was.draft_launches;
    const int64_t forward = timing.forward_launches - was.forward_launches;
    const int64_t other = timing.step_launches - was.step_launches - draft - forward;
    c.max_forward_launches = std::max(c.max_forward_launches, forward);
    c.max_draft_launches = std::max(c.max_draft_launches, draft);
    c.max_other_launches = std::max(c.max_other_launches, other);
  }
  (void)cuda;
  return c;
}

std::string Seen(const StepCounts& c) {
  std::string s;
  for (const std::string& x : c.seen) s += " " + x;
  return s;
}

class HostSyncTest : public ::testing::TestWithParam<const char*> {};

const ImageModel& Model() {
  static const ImageModel* m = [] {
    auto r = LoadImageModel(DefaultModelsDir(), "fmnist-gpt", testing::TestLoadOptions(),
                            /*with_draft=*/true);
    if (!r.ok()) throw std::runtime_error(r.status().ToString());
    return new ImageModel(std::move(r).value());
  }();
  return *m;
}

TEST_P(HostSyncTest, OneReadBackAndNoOtherSyncPerStep) {
  const ImageModel& m = Model();
  const StepCounts c = RunSteps(m, GetParam());
  // Draft-model steps (sd, cool-sd) keep their drafts on the device too (NodeTokens).
  const bool draft_model = PolicyFromPreset(GetParam())->draft == DraftSource::kDraftModel;
  std::printf(
      "%-12s on %s: %lld steps, readbacks/step %.2f (max %lld), uploads/step %.1f (max %lld), "
      "syncing calls %lld, stray moves %lld, CUDA sync warnings/step (max) %lld\n",
      GetParam(), m.gpt->options().device.str().c_str(), static_cast<long long>(c.steps),
      static_cast<double>(c.readbacks) / c.steps, static_cast<long long>(c.max_readbacks),
      static_cast<double>(c.uploads) / c.steps, static_cast<long long>(c.max_uploads),
      static_cast<long long>(c.syncing), static_cast<long long>(c.stray),
      static_cast<long long>(c.cuda_syncs));
  EXPECT_EQ(c.readbacks, c.steps);
  EXPECT_EQ(c.max_readbacks, 1);
  EXPECT_EQ(c.syncing, 0) << Seen(c);
  EXPECT_EQ(c.stray, 0) << Seen(c);
  EXPECT_LE(c.cuda_syncs, 1);  // the readback itself
  // Uploads are non-blocking on CUDA; the bound keeps them few: a target forward and its
  // sampling take 4, verification and the next drafts up to 11 more (trees, GSD); a
  // draft-model step adds 5 per drafted token (window 6 by default).
  EXPECT_LE(c.max_uploads, draft_model ? 16 + 5 * 5 : 16);
}

// A preset as a test name: "scd-mc" -> "scd_mc".
std::string PresetTestName(const ::testing::TestParamInfo<const char*>& info) {
  std::string s = info.param;
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

INSTANTIATE_TEST_SUITE_P(Presets, HostSyncTest,
                         ::testing::Values("ar", "sjd", "scd-mc", "scd-gs", "sjd-pac", "pac-gumbel",
                                           "gsd", "cool-sd", "sd", "ar-gm", "scd-gm"),
                         PresetTestName);

// Issue 14: the sampling and verification work of a step is launched for all windows at once,
// so its count of device launches does not grow with the requests in the batch (on a GPU each
// launch costs the host microseconds whatever its size). The chain presets: a tree's launches
// grow with its widest node (K siblings are verified in turn), which more requests can widen.
// The forwards (the target's, and the draft model's for sd) do grow: the batch-invariant
// forward calls attention once per request (docs/engine.md); they are printed, not bounded.
class LaunchesTest : public ::testing::TestWithParam<const char*> {};

TEST_P(LaunchesTest, NonForwardLaunchesPerStepDoNotGrowWithTheRequests) {
  const StepCounts one = RunSteps(Model(), GetParam(), nullptr, 1, true);
  const StepCounts four = RunSteps(Model(), GetParam(), nullptr, 4, true);
  std::printf(
      "%-8s launches per step (most), 1 / 4 requests: non-forward %lld / %lld, target "
      "forward %lld / %lld, draft model %lld / %lld\n",
      GetParam(), static_cast<long long>(one.max_other_launches),
      static_cast<long long>(four.max_other_launches),
      static_cast<long long>(one.max_forward_launches),
      static_cast<long long>(four.max_forward_launches),
      static_cast<long long>(one.max_draft_launches),
      static_cast<long long>(four.max_draft_launches));
  EXPECT_GT(one.max_other_launches, 0);  // the counter sees the step
  EXPECT_EQ(four.max_other_launches, one.max_other_launches);
}

INSTANTIATE_TEST_SUITE_P(ChainPresets, LaunchesTest,
                         ::testing::Values("ar", "sjd", "scd-mc", "scd-gs", "gsd", "cool-sd", "sd",
                                           "ar-gm", "scd-gm"),
                         PresetTestName);

// A step with no drafts (AR, or every window held to one token) has nothing to verify and
// skips the verification's launches (VerifyWindows).
TEST(LaunchesPowerTest, AStepWithoutDraftsSkipsTheVerification) {  // the eager verification's
  const StepCounts ar = RunSteps(Model(), "ar", nullptr, 2, true, /*fused=*/false);
  const StepCounts sjd = RunSteps(Model(), "sjd", nullptr, 2, true, /*fused=*/false);
  EXPECT_LT(ar.max_other_launches + 25, sjd.max_other_launches);
}

// With IMAGEGEN_FUSED_KERNELS=0 (the GPU script's fallback) CUDA steps take the eager path
// whatever SpecOptions asks: there is no fused pass to count.
bool FusedPathOff() { return Model().gpt->options().device.is_cuda() && !FusedKernelsOn(); }

// The fused verification (SpecOptions::fused_verify) is one launch where the eager one is
// about 30 (GSD's clusters about 80 more), for every chain method, and where a tree's is about
// 20 per sibling and its extra candidates' draws about 15 each.
TEST(LaunchesTest, FusedChainVerificationReplacesTheEagerLaunches) {
  if (FusedPathOff()) GTEST_SKIP() << "IMAGEGEN_FUSED_KERNELS=0 on CUDA";
  for (const char* preset : {"sjd", "scd-gs", "cool-sd", "gsd"}) {
    const StepCounts fused = RunSteps(Model(), preset, nullptr, 2, true, true);
    const StepCounts eager = RunSteps(Model(), preset, nullptr, 2, true, false);
    std::printf("%-8s non-forward launches per step (most), fused / eager: %lld / %lld\n", preset,
                static_cast<long long>(fused.max_other_launches),
                static_cast<long long>(eager.max_other_launches));
    EXPECT_GE(eager.max_other_launches - fused.max_other_launches, 25) << preset;
    if (std::string(preset) == "gsd") {  // the clusters too: as few as a plain chain's
      EXPECT_LE(fused.max_other_launches,
                RunSteps(Model(), "sjd", nullptr, 2, true, true).max_other_launches)
          << preset;
    }
  }
  // Trees: the siblings' verification in turn and the extra candidates' draws, in the same pass.
  for (const char* preset : {"sjd-pac", "pac-gumbel"}) {
    const StepCounts tree_f = RunSteps(Model(), preset, nullptr, 2, true, true);
    const StepCounts tree_e = RunSteps(Model(), preset, nullptr, 2, true, false);
    std::printf("%-10s non-forward launches per step (most), fused / eager: %lld / %lld\n", preset,
                static_cast<long long>(tree_f.max_other_launches),
                static_cast<long long>(tree_e.max_other_launches));
    EXPECT_GE(tree_e.max_other_launches - tree_f.max_other_launches, 100) << preset;
  }
}

// The fused final distributions (SpecOptions::fused_probs; here its host path, which CUDA runs
// as one kernel) replace the target's row gathers, CFG combine, temperature, softmax and float64
// conversion, and for sd the draft model's too; with fused_verify off they are off as well.
// gsd, scd-gs: their clusters and Gumbel drafts in the fused verification, their
// distributions here.
TEST(LaunchesTest, FusedFinalDistributionsReplaceTheEagerLaunches) {
  if (FusedPathOff()) GTEST_SKIP() << "IMAGEGEN_FUSED_KERNELS=0 on CUDA";
  for (const char* preset : {"ar", "sjd", "sd", "gsd", "scd-gs"}) {
    const StepCounts fused = RunSteps(Model(), preset, nullptr, 2, true, true, 1);
    const StepCounts eager = RunSteps(Model(), preset, nullptr, 2, true, true, 0);
    std::printf(
        "%-4s non-forward launches per step (most), fused / eager distributions: %lld / "
        "%lld\n",
        preset, static_cast<long long>(fused.max_other_launches),
        static_cast<long long>(eager.max_other_launches));
    EXPECT_GE(eager.max_other_launches - fused.max_other_launches, 5) << preset;
    const StepCounts off = RunSteps(Model(), preset, nullptr, 2, true, false, 1);
    const StepCounts off0 = RunSteps(Model(), preset, nullptr, 2, true, false, 0);
    EXPECT_EQ(off.max_other_launches, off0.max_other_launches) << preset;
  }
}

// Power: a verifier that decides row by row (a launch per window node) is caught.
class RowByRow : public VerifyRules {
 public:
  at::Tensor Accept(const at::Tensor& u, const at::Tensor& ratio) const override {
    std::vector<at::Tensor> rows;
    for (int64_t i = 0; i < u.size(0); ++i) rows.push_back(u.select(0, i) < ratio.select(0, i));
    return at::stack(rows);
  }
};

TEST(LaunchesPowerTest, AVerifierThatLoopsOverRowsIsCaught) {
  const RowByRow rules;
  const StepCounts one = RunSteps(Model(), "sjd", &rules, 1, true);
  const StepCounts four = RunSteps(Model(), "sjd", &rules, 4, true);
  EXPECT_GT(four.max_other_launches, one.max_other_launches + 16);
}

// LaunchCount counts the outermost call that does device work: one for a composite op (linear
// is a matmul and an add inside), none for views, allocations and a conversion to the dtype a
// tensor already has.
TEST(LaunchesPowerTest, LaunchCountCountsKernelsNotViews) {
  const at::Tensor x = at::rand({4, 6}), w = at::rand({3, 6}), b = at::rand({3});
  struct Probe {
    const char* what;
    std::function<void()> fn;
    int64_t launches;
  };
  const std::vector<Probe> probes = {
      {"add", [&] { (void)(x + x); }, 1},
      {"linear", [&] { (void)at::linear(x, w, b); }, 1},
      {"zeros", [&] { (void)at::zeros({4}); }, 1},
      {"to(double)", [&] { (void)x.to(at::kDouble); }, 1},
      {"two ops", [&] { (void)(x * 2).sum(); }, 2},
      {"views",
       [&] {
         (void)x.view({6, 4}).narrow(0, 1, 2).t().unsqueeze(0).select(0, 0);
       },
       0},
      {"empty", [&] { (void)at::empty({8}); }, 0},
      {"to(float)", [&] { (void)x.to(at::kFloat); }, 0},
  };
  for (const Probe& p : probes) {
    LaunchCount count;
    p.fn();
    EXPECT_EQ(count.launches(), p.launches) << p.what;
    EXPECT_EQ(ThreadLaunches(), p.launches) << p.what;
  }
  EXPECT_EQ(ThreadLaunches(), 0);  // none live
}

// Power: a verifier that reads a value back mid-step (as code that calls item() would) is
// caught, and so are the other kinds of hidden sync.
class ReadsBack : public VerifyRules {
 public:
  at::Tensor Accept(const at::Tensor& u, const at::Tensor& ratio) const override {
    if (u.sum().item<double>() < -1) return u < 0;  // never true; the read is the point
    return VerifyRules::Accept(u, ratio);
  }
};

TEST(HostSyncPowerTest, AHiddenReadBackIsCaught) {
  const ReadsBack rules;
  const StepCounts c = RunSteps(Model(), "sjd", &rules);
  EXPECT_GE(c.syncing, c.steps);
  EXPECT_NE(Seen(c).find("aten::_local_scalar_dense"), std::string::npos) << Seen(c);
}

TEST(HostSyncPowerTest, SyncWatchSeesEachKind) {
  at::Tensor x = at::arange(6, at::kLong);
  struct Probe {
    const char* what;
    std::function<void()> fn;
    bool syncing;
  };
  const std::vector<Probe> probes = {
      {"item", [&] { (void)x.sum().item<int64_t>(); }, true},
      {"nonzero", [&] { (void)at::nonzero(x > 2); }, true},
      {"masked_select", [&] { (void)x.masked_select(x > 2); }, true},
      {"unique", [&] { (void)at::_unique2(x); }, true},
      {"to(device)", [&] { (void)x.to(at::Device(at::kCPU)); }, false},
      {"cpu()", [&] { (void)x.cpu(); }, false},
      {"to(other)", [&] { (void)x.to(at::zeros({1}, at::kDouble)); }, false},
  };
  for (const Probe& p : probes) {
    SyncWatch w;
    p.fn();
    EXPECT_EQ(w.syncing_calls() > 0, p.syncing) << p.what;
    EXPECT_EQ(w.stray_moves() > 0, !p.syncing) << p.what;
  }
  // The helpers' own moves, and dtype conversions, are not stray.
  SyncWatch w;
  (void)ReadBack(UploadLongs({1, 2, 3}, at::Device(at::kCPU)));
  (void)x.to(at::kDouble);
  EXPECT_EQ(w.syncing_calls(), 0);
  EXPECT_EQ(w.stray_moves(), 0);
}

}  // namespace
}  // namespace imagegen
