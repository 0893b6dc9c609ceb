// The speculative decoding family on an enumerable toy: a tiny random target GPT and a smaller
// draft GPT over a vocabulary of 3 and a 3x3 grid (9 tokens), two classes, CFG 1.5 and top-k 2
// on, so that p depends on class and prefix and has zeros. The exact AR distribution over all
// 3^9 grids is computed from the model's own forward. Every lossless preset must match it on
// 100,000 seeded images (chi-square, p > 0.001); broken verifiers must not. For the lossy
// methods the test reports the total-variation distance to AR; for COOL-SD on the draft model
// the process is small enough to enumerate exactly, so the engine is checked against its exact
// (lossy) distribution and against the bound of seed 003 Theorem 2.
#include "engine/decoding/speculative.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>

#include "tests/spec_toy.h"
#include "tests/stats.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

using namespace imagegen::testing;  // NOLINT: the toy's constants and types

struct RunStats {
  std::vector<int64_t> counts = std::vector<int64_t>(kClasses * kSeqs);
  int64_t images = 0, nfe = 0, verified = 0, accepted = 0, draft_forwards = 0;
  double mean_nfe() const { return static_cast<double>(nfe) / images; }
  // Counts one finished image of class `cls`.
  void Add(int64_t cls, const SpecResult& r) {
    if (static_cast<int64_t>(r.tokens.size()) != kN) throw std::runtime_error("length");
    int64_t idx = 0;
    for (int32_t t : r.tokens) idx = idx * kV + t;
    counts[cls * kSeqs + idx]++;
    images++;
    nfe += r.stats.nfe;
    verified += r.stats.drafts_verified;
    accepted += r.stats.drafts_accepted;
    draft_forwards += r.stats.draft_forwards;
  }
  double acceptance() const { return verified ? static_cast<double>(accepted) / verified : 0; }
};

RunStats Sample(const DecodingPolicy& policy, const SpecOptions& opts = {},
                int64_t per_class = kPerClass, uint64_t seed_base = 0, const Toy& toy = TheToy()) {
  // IMAGEGEN_TEST_SEED_BASE re-runs the statistical tests on other seeds (default 0);
  // IMAGEGEN_TEST_SCALE multiplies the sample size (more power, for investigations).
  if (const char* e = std::getenv("IMAGEGEN_TEST_SEED_BASE"))
    seed_base += std::strtoull(e, nullptr, 10);
  if (const char* e = std::getenv("IMAGEGEN_TEST_SCALE")) per_class *= std::max(1L, std::atol(e));
  RunStats st;
  for (int64_t cls = 0; cls < kClasses; ++cls) {
    for (int64_t first = 0; first < per_class; first += kChunk) {
      std::vector<ImageRequest> reqs(static_cast<size_t>(std::min(kChunk, per_class - first)));
      for (size_t i = 0; i < reqs.size(); ++i) {
        reqs[i].class_id = cls;
        reqs[i].seed =
            seed_base + static_cast<uint64_t>(cls * 1000003 + first + static_cast<int64_t>(i));
        reqs[i].sampling = toy.sampling;
        reqs[i].policy = policy;
      }
      auto res = GenerateSpeculative(*toy.target, toy.draft.get(), reqs, opts);
      if (!res.ok()) throw std::runtime_error(res.status().ToString());
      for (const auto& r : *res) {
        st.Add(cls, r);
        int64_t sum = 0;
        for (int32_t s : r.stats.step_tokens) sum += s;
        if (sum != kN || static_cast<int64_t>(r.stats.step_tokens.size()) != r.stats.nfe) {
          throw std::runtime_error("step accounting");
        }
      }
    }
  }
  return st;
}

std::vector<double> JointAr(const Toy& toy = TheToy()) {
  std::vector<double> p;
  for (int64_t c = 0; c < kClasses; ++c) {
    auto a = toy.Ar(c);
    for (double x : a) p.push_back(x / kClasses);
  }
  return p;
}

std::vector<double> Empirical(const RunStats& st) {
  std::vector<double> e(st.counts.size());
  for (size_t i = 0; i < e.size(); ++i) e[i] = static_cast<double>(st.counts[i]) / st.images;
  return e;
}

DecodingPolicy Preset(const std::string& name, int64_t window) {
  auto p = PolicyFromPreset(name, window);
  if (!p.ok()) throw std::runtime_error(p.status().ToString());
  return *p;
}

// The match rule on a proactive tree: Gumbel top-2 candidates, kept iff one is the token.
DecodingPolicy MatchTree() {
  DecodingPolicy p = Preset("pac-gumbel", 9);
  p.tree_branches = 2;
  p.acceptance = Acceptance::kMatch;
  p.preset = "custom";
  return p;
}

struct LosslessCase {
  const char* name;
  DecodingPolicy policy;
};

std::vector<LosslessCase> LosslessCases() {
  std::vector<LosslessCase> c;
  c.push_back({"ar", Preset("ar", 1)});
  c.push_back({"sjd_onehot_L4", Preset("sjd", 4)});
  DecodingPolicy u = Preset("sjd", 6);
  u.uniform_init_q = true;
  c.push_back({"sjd_uniform_L6", u});
  c.push_back({"scd_mc_L6", Preset("scd-mc", 6)});
  c.push_back({"scd_gs_L6", Preset("scd-gs", 6)});
  DecodingPolicy pac = Preset("sjd-pac", 9);
  pac.tree_branches = 3;  // more than top-k 2 allows: exercises "fewer than K non-zero"
  pac.tree_depth = 2;
  c.push_back({"sjd_pac_K3_D2_L9", pac});
  DecodingPolicy pac2 = Preset("sjd-pac", 9);
  pac2.tree_branches = 2;
  pac2.uniform_init_q = false;
  c.push_back({"sjd_pac_K2_D3_L9_onehot", pac2});
  DecodingPolicy pg = Preset("pac-gumbel", 9);
  pg.tree_branches = 2;
  c.push_back({"pac_gumbel_K2_D3_L9", pg});
  c.push_back({"sd_L4", Preset("sd", 4)});
  c.push_back({"ar_gm", Preset("ar-gm", 1)});
  c.push_back({"scd_gm_L6", Preset("scd-gm", 6)});
  c.push_back({"scd_gm_K2_D3_L9", MatchTree()});
  return c;
}

void PrintTo(const LosslessCase& c, std::ostream* os) { *os << c.name; }

class SpecLosslessTest : public ::testing::TestWithParam<LosslessCase> {};

TEST_P(SpecLosslessTest, MatchesTheExactArDistribution) {
  const auto& c = GetParam();
  RunStats st = Sample(c.policy);
  auto chi = testing::ChiSquareTest(st.counts, JointAr());
  std::printf(
      "%-26s %s\n  %lld images: chi2 %.1f df %d p %.4f | mean NFE %.3f (AR %lld) "
      "acceptance %.3f draft forwards/img %.2f\n",
      c.name, DescribePolicy(c.policy).c_str(), static_cast<long long>(st.images), chi.statistic,
      chi.df, chi.p_value, st.mean_nfe(), static_cast<long long>(kN), st.acceptance(),
      static_cast<double>(st.draft_forwards) / st.images);
  EXPECT_GT(chi.p_value, 0.001);
  if (c.policy.draft != DraftSource::kNone) {
    EXPECT_LT(st.mean_nfe(), kN);  // it did speculate
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, SpecLosslessTest, ::testing::ValuesIn(LosslessCases()),
                         [](const auto& info) { return std::string(info.param.name); });

// The fused final distributions (SpecOptions::fused_probs; on the CPU through its host path,
// which CUDA runs as one kernel): the target's distributions, and for sd the draft model's,
// come from the fused pass (the toy's top-k of 2 of its 3 ids included), and the methods keep
// the exact distribution.
TEST(SpecFusedProbsTest, LosslessMethodsKeepTheExactDistribution) {
  SpecOptions o;
  o.fused_probs = 1;
  for (const auto& [name, window] :
       std::vector<std::pair<const char*, int64_t>>{{"ar", 1}, {"scd-mc", 6}, {"sd", 4}}) {
    const RunStats st = Sample(Preset(name, window), o);
    const auto chi = testing::ChiSquareTest(st.counts, JointAr());
    std::printf("fused distributions, %-6s %lld images: chi2 %.1f df %d p %.4f | mean NFE %.3f\n",
                name, static_cast<long long>(st.images), chi.statistic, chi.df, chi.p_value,
                st.mean_nfe());
    EXPECT_GT(chi.p_value, 0.001) << name;
  }
}

// Broken rules injected through SpecOptions::rules: every draft accepted, and maximal coupling
// storing the old q for kept drafts (the Lumina/Janus SCD-MC code, algorithms.md 3a).
class AcceptEverything : public VerifyRules {
 public:
  at::Tensor Accept(const at::Tensor& u, const at::Tensor&) const override {
    return at::ones_like(u, at::kBool);
  }
};
class KeepOldQ : public VerifyRules {
 public:
  bool KeptDraftFollowsP() const override { return false; }
};

// Power: the same test rejects broken verifiers.
TEST(SpeculativePowerTest, BrokenVariantsFail) {
  const auto exact = JointAr();
  const AcceptEverything accept_everything;
  SpecOptions always;
  always.rules = &accept_everything;
  auto a = testing::ChiSquareTest(Sample(Preset("sjd", 4), always).counts, exact);
  const KeepOldQ keep_old_q;
  SpecOptions old_q;
  old_q.rules = &keep_old_q;
  auto m = testing::ChiSquareTest(Sample(Preset("scd-mc", 6), old_q).counts, exact);
  std::printf(
      "accept-always sjd: chi2 %.1f p %.3g\nscd-mc storing the old q for kept drafts "
      "(algorithms.md 3a): chi2 %.1f df %d p %.3g\n",
      a.statistic, a.p_value, m.statistic, m.df, m.p_value);
  EXPECT_LT(a.p_value, 1e-6);
  EXPECT_LT(m.p_value, 1e-3);
}

// Gumbel noise shared by every position (a key without the position): each token's draw then
// depends on the tokens before it.
class SharedGumbelNoise : public VerifyRules {
 public:
  uint32_t GumbelPosition(uint32_t) const override { return 0; }
};

// Power for the match rule: the same test rejects ar-gm and scd-gm with the noise shared by
// positions.
TEST(SpeculativePowerTest, MatchRuleWithNoiseSharedByPositionsFails) {
  const auto exact = JointAr();
  const SharedGumbelNoise shared;
  SpecOptions o;
  o.rules = &shared;
  for (const auto& [name, window] :
       std::vector<std::pair<const char*, int64_t>>{{"ar-gm", 1}, {"scd-gm", 6}}) {
    const auto chi = testing::ChiSquareTest(Sample(Preset(name, window), o).counts, exact);
    std::printf("%s with one Gumbel noise for all positions: chi2 %.1f df %d p %.3g\n", name,
                chi.statistic, chi.df, chi.p_value);
    EXPECT_LT(chi.p_value, 1e-6) << name;
  }
}

// LlamaGen's cfg_interval: guidance stops after image token cfg_interval + 1, in AR and in the
// speculative methods alike (the verifier's p follows the position's scale); the same samples
// do not fit the always-guided distribution (power).
TEST(SpeculativeCfgIntervalTest, GuidanceStopsAfterTheIntervalInEveryMethod) {
  const Toy toy(/*cfg_interval=*/2);  // tokens 0..3 guided, 4..8 from the conditional alone
  const auto exact = JointAr(toy), guided = JointAr();
  double tv = 0;
  for (size_t i = 0; i < exact.size(); ++i) tv += 0.5 * std::abs(exact[i] - guided[i]);
  std::printf("total variation between cfg_interval 2 and always guided: %.4f\n", tv);
  for (const auto& [name, window] :
       std::vector<std::pair<std::string, int64_t>>{{"ar", 1}, {"sjd", 4}, {"sd", 4}}) {
    RunStats st = Sample(Preset(name, window), {}, kPerClass / 2, 0, toy);
    auto chi = testing::ChiSquareTest(st.counts, exact);
    auto off = testing::ChiSquareTest(st.counts, guided);
    std::printf("%-4s %lld images: chi2 %.1f df %d p %.4f; against always guided p %.3g\n",
                name.c_str(), static_cast<long long>(st.images), chi.statistic, chi.df, chi.p_value,
                off.p_value);
    EXPECT_GT(chi.p_value, 0.001) << name;
    EXPECT_LT(off.p_value, 1e-6) << name;
  }
}

// Batch composition does not change a request's tokens: the toy requests of one method give the
// same grids when co-batched with requests of every other method.
TEST(SpeculativeBatchTest, MixedMethodsInOneBatchGiveTheSameGrids) {
  Toy& toy = TheToy();
  auto cases = LosslessCases();
  std::vector<ImageRequest> mixed;
  std::vector<std::vector<int32_t>> alone;
  for (int64_t i = 0; i < 64; ++i) {
    ImageRequest r;
    r.class_id = i % kClasses;
    r.seed = 777 + static_cast<uint64_t>(i);
    r.sampling = toy.sampling;
    r.policy = cases[static_cast<size_t>(i) % cases.size()].policy;
    auto one = GenerateSpeculative(*toy.target, toy.draft.get(), {r});
    ASSERT_TRUE(one.ok()) << one.status().ToString() << " " << DescribePolicy(r.policy);
    alone.push_back((*one)[0].tokens);
    mixed.push_back(r);
  }
  auto all = GenerateSpeculative(*toy.target, toy.draft.get(), mixed);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  for (size_t i = 0; i < mixed.size(); ++i)
    EXPECT_EQ((*all)[i].tokens, alone[i]) << "request " << i;
}

// Adds `count` toy requests of class `cls` to `batch`, with the seeds Sample gives images
// first .. first + count - 1 of that class; returns their handles.
std::vector<int64_t> AddToyRequests(SpecBatch& batch, const DecodingPolicy& policy, int64_t cls,
                                    int64_t first, int64_t count) {
  std::vector<int64_t> handles;
  for (int64_t i = 0; i < count; ++i) {
    ImageRequest r;
    r.class_id = cls;
    r.seed = static_cast<uint64_t>(cls * 1000003 + first + i);
    r.sampling = TheToy().sampling;
    r.policy = policy;
    auto h = batch.Add(r);
    if (!h.ok()) throw std::runtime_error(h.status().ToString());
    handles.push_back(*h);
  }
  return handles;
}

// Toy grids of `policy` for Sample's seeds 0..n-1 of class `cls`, in one batch; `moving`: every
// request is granted a window drawn anew each step from [1, 9] (a fixed sequence).
std::vector<std::vector<int32_t>> ToyGrids(const DecodingPolicy& policy, int64_t cls, int64_t n,
                                           bool moving, const SpecOptions& opts = {}) {
  const Toy& toy = TheToy();
  SpecBatch batch(*toy.target, toy.draft.get(), 2 * n, opts);
  const std::vector<int64_t> handles = AddToyRequests(batch, policy, cls, 0, n);
  uint64_t lcg = 4242;
  while (batch.active() > 0) {
    std::vector<WindowGrant> grants;
    for (int64_t h : handles) {
      if (batch.done(h) || !moving) continue;
      lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
      grants.push_back({h, 1 + static_cast<int64_t>((lcg >> 33) % 9)});
    }
    if (Status s = batch.Step(grants); !s.ok()) throw std::runtime_error(s.ToString());
  }
  std::vector<std::vector<int32_t>> out;
  for (int64_t h : handles) out.push_back(batch.Take(h).tokens);
  return out;
}

// The match rule's promise: a seed draws ar-gm's grid at every window (2..9), on a tree, with
// windows that move every step, beside other requests, and with the fused verification off
// (the eager path). scd-gs, the same drafts under the exact rule, draws other grids (power).
TEST(SpecMatchRuleTest, EveryWindowTreeAndBatchDrawsTheArGmGrid) {
  constexpr int64_t kSeeds = 200;
  SpecOptions eager;
  eager.fused_verify = false;
  for (int64_t cls = 0; cls < kClasses; ++cls) {
    const auto ar = ToyGrids(Preset("ar-gm", 1), cls, kSeeds, false);
    std::vector<std::pair<std::string, std::vector<std::vector<int32_t>>>> runs;
    for (int64_t w = 2; w <= 9; ++w) {
      runs.emplace_back("scd-gm L" + std::to_string(w),
                        ToyGrids(Preset("scd-gm", w), cls, kSeeds, false));
    }
    runs.emplace_back("scd-gm tree", ToyGrids(MatchTree(), cls, kSeeds, false));
    runs.emplace_back("scd-gm moving", ToyGrids(Preset("scd-gm", 9), cls, kSeeds, true));
    runs.emplace_back("tree moving", ToyGrids(MatchTree(), cls, kSeeds, true));
    runs.emplace_back("scd-gm eager", ToyGrids(Preset("scd-gm", 6), cls, kSeeds, false, eager));
    runs.emplace_back("ar-gm eager", ToyGrids(Preset("ar-gm", 1), cls, kSeeds, false, eager));
    runs.emplace_back("tree eager", ToyGrids(MatchTree(), cls, kSeeds, true, eager));
    for (const auto& [name, grids] : runs) {
      int64_t differ = 0;
      for (int64_t i = 0; i < kSeeds; ++i) differ += grids[i] != ar[i] ? 1 : 0;
      EXPECT_EQ(differ, 0) << name << ", class " << cls;
    }
    const auto gs = ToyGrids(Preset("scd-gs", 6), cls, kSeeds, false);
    int64_t differ = 0;
    for (int64_t i = 0; i < kSeeds; ++i) differ += gs[i] != ar[i] ? 1 : 0;
    std::printf("class %lld: %zu runs equal ar-gm's %lld grids; scd-gs differs in %lld\n",
                static_cast<long long>(cls), runs.size(), static_cast<long long>(kSeeds),
                static_cast<long long>(differ));
    EXPECT_GT(differ, kSeeds / 4);
  }
  // Co-batched: ar-gm, scd-gm and scd-mc requests in one batch, grids as alone.
  std::vector<ImageRequest> mixed;
  for (int64_t i = 0; i < 48; ++i) {
    ImageRequest r;
    r.class_id = i % kClasses;
    r.seed = static_cast<uint64_t>(r.class_id * 1000003 + i / kClasses);
    r.sampling = TheToy().sampling;
    r.policy = i % 3 == 0 ? Preset("scd-mc", 6) : i % 3 == 1 ? Preset("scd-gm", 6) : MatchTree();
    mixed.push_back(r);
  }
  auto all = GenerateSpeculative(*TheToy().target, TheToy().draft.get(), mixed);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  std::vector<std::vector<std::vector<int32_t>>> ar;
  for (int64_t cls = 0; cls < kClasses; ++cls) {
    ar.push_back(ToyGrids(Preset("ar-gm", 1), cls, 48 / kClasses, false));
  }
  for (size_t i = 0; i < mixed.size(); ++i) {
    if (i % 3 == 0) continue;
    EXPECT_EQ((*all)[i].tokens, ar[mixed[i].class_id][i / kClasses]) << "request " << i;
  }
}

// Preemption by recomputation (SpecBatch::Suspend / Resume). Steps `batch` until its requests
// `handles` are done, preempting them: after every step, each running request is suspended one time
// in four (its KV slots freed); before the next, each suspended one is resumed three times in four,
// in the order suspended, so that it comes back in slots another request held. The coin is a fixed
// pseudo-random sequence kept in `lcg`. Adds the suspensions.
void StepWithPreemption(SpecBatch& batch, const std::vector<int64_t>& handles, uint64_t& lcg,
                        int64_t* suspensions) {
  auto coin = [&lcg] {
    lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return (lcg >> 33) % 4 == 0;
  };
  std::vector<int64_t> paused;
  while (batch.active() > 0 || !paused.empty()) {
    std::vector<int64_t> still;  // one in four stays away another step
    for (int64_t h : paused) {
      if (coin()) {
        still.push_back(h);
      } else if (Status s = batch.Resume(h); !s.ok()) {
        throw std::runtime_error(s.ToString());
      }
    }
    paused = still;
    if (Status s = batch.Step(); !s.ok()) throw std::runtime_error(s.ToString());
    for (int64_t h : handles) {
      if (!batch.done(h) && std::find(paused.begin(), paused.end(), h) == paused.end() && coin()) {
        batch.Suspend(h);
        paused.push_back(h);
        *suspensions += 1;
      }
    }
  }
}

// Sample's statistics, with every batch's requests preempted by StepWithPreemption: a resumed
// request prefills its class and committed tokens again (in chunks of
// SpecOptions::prefill_chunk, 0: all at once) while the others go on. Adds the suspensions.
RunStats SampleWithPreemption(const DecodingPolicy& policy, const SpecOptions& opts,
                              int64_t per_class, int64_t* suspensions) {
  const Toy& toy = TheToy();
  RunStats st;
  uint64_t lcg = 12345;
  for (int64_t cls = 0; cls < kClasses; ++cls) {
    for (int64_t first = 0; first < per_class; first += kChunk) {
      const int64_t count = std::min(kChunk, per_class - first);
      SpecBatch batch(*toy.target, toy.draft.get(), 2 * count, opts);
      const std::vector<int64_t> handles = AddToyRequests(batch, policy, cls, first, count);
      StepWithPreemption(batch, handles, lcg, suspensions);
      for (int64_t h : handles) st.Add(cls, batch.Take(h));
      if (batch.free_slots() != 2 * count) throw std::runtime_error("slots leaked");
    }
  }
  return st;
}

// Requests preempted mid-image and resumed in other slots still sample the exact AR
// distribution, in every family of drafting (none, Jacobi, coupled Jacobi, trees, a draft
// model), and with the recomputation spread over steps (2 positions a step, crossing from
// the class to the image tokens); skipping the recomputation (the new slots hold another
// request's entries) fails.
TEST(SpecBatchPreemptionTest, SuspendedAndResumedRequestsKeepTheExactDistribution) {
  const auto exact = JointAr();
  struct Case {
    std::string name;
    int64_t window, chunk;
  };
  for (const Case& c : std::vector<Case>{{"ar", 1, 0},
                                         {"sjd", 4, 0},
                                         {"scd-mc", 6, 0},
                                         {"sjd-pac", 9, 0},
                                         {"sd", 4, 0},
                                         {"sjd", 4, 2}}) {
    const std::string& name = c.name;
    SpecOptions opts;
    opts.prefill_chunk = c.chunk;
    int64_t suspensions = 0;
    // Half the other exactness tests' scale (50,000 images a case, for CI's time): what goes
    // wrong in a resume (the broken variant below) is far beyond its power.
    RunStats st = SampleWithPreemption(Preset(name, c.window), opts, kPerClass / 2, &suspensions);
    auto chi = testing::ChiSquareTest(st.counts, exact);
    std::printf(
        "%-8s chunk %lld: %lld images, %lld suspensions: chi2 %.1f df %d p %.4f | mean NFE "
        "%.3f\n",
        name.c_str(), static_cast<long long>(c.chunk), static_cast<long long>(st.images),
        static_cast<long long>(suspensions), chi.statistic, chi.df, chi.p_value, st.mean_nfe());
    EXPECT_GT(chi.p_value, 0.001) << name;
    EXPECT_GT(suspensions, st.images / 2) << name;  // most images were paused at least once
  }
  SpecOptions broken;
  broken.testing_resume_without_recompute = true;
  int64_t suspensions = 0;
  auto chi = testing::ChiSquareTest(
      SampleWithPreemption(Preset("sjd", 4), broken, kPerClass / 10, &suspensions).counts, exact);
  std::printf("sjd resumed without recomputing its KV: chi2 %.1f p %.3g\n", chi.statistic,
              chi.p_value);
  EXPECT_LT(chi.p_value, 1e-6);
}

// Toy grids of `policy` for Sample's seeds 0..n-1 of class `cls` in one batch, preempted by
// StepWithPreemption. Adds the suspensions.
std::vector<std::vector<int32_t>> ToyGridsWithPreemption(const DecodingPolicy& policy, int64_t cls,
                                                         int64_t n, const SpecOptions& opts,
                                                         int64_t* suspensions) {
  const Toy& toy = TheToy();
  SpecBatch batch(*toy.target, toy.draft.get(), 2 * n, opts);
  const std::vector<int64_t> handles = AddToyRequests(batch, policy, cls, 0, n);
  uint64_t lcg = 777;
  StepWithPreemption(batch, handles, lcg, suspensions);
  std::vector<std::vector<int32_t>> out;
  for (int64_t h : handles) out.push_back(batch.Take(h).tokens);
  return out;
}

// The match rule after preemption by recomputation: a seed suspended mid-image and resumed in
// other slots (its class and committed tokens prefilled again, at once or 2 positions a step)
// still draws ar-gm's grid, on chains and trees. A resumed request starts from fresh drafts
// (its old ones are dropped), but its committed tokens are a function of the noise at their
// positions alone, so other drafts cannot move them. Power: resuming without recomputing the KV
// entries (the slots hold another request's) draws other grids.
TEST(SpecMatchRuleTest, PreemptedAndResumedRequestsDrawTheArGmGrid) {
  constexpr int64_t kSeeds = 64;
  SpecOptions whole, chunked, broken;
  whole.batch_invariant = chunked.batch_invariant = broken.batch_invariant = true;
  chunked.prefill_chunk = 2;
  broken.testing_resume_without_recompute = true;
  struct Case {
    std::string name;
    DecodingPolicy policy;
    const SpecOptions* opts;
  };
  const std::vector<Case> cases = {{"scd-gm L6", Preset("scd-gm", 6), &whole},
                                   {"scd-gm L9 chunked", Preset("scd-gm", 9), &chunked},
                                   {"tree", MatchTree(), &whole},
                                   {"ar-gm chunked", Preset("ar-gm", 1), &chunked}};
  int64_t broken_differ = 0, broken_suspensions = 0;
  for (int64_t cls = 0; cls < kClasses; ++cls) {
    const auto ar = ToyGrids(Preset("ar-gm", 1), cls, kSeeds, false);
    for (const Case& c : cases) {
      int64_t suspensions = 0;
      const auto grids = ToyGridsWithPreemption(c.policy, cls, kSeeds, *c.opts, &suspensions);
      int64_t differ = 0;
      for (int64_t i = 0; i < kSeeds; ++i) differ += grids[i] != ar[i] ? 1 : 0;
      EXPECT_EQ(differ, 0) << c.name << ", class " << cls;
      EXPECT_GT(suspensions, kSeeds / 2) << c.name << ", class " << cls;
    }
    const auto bad =
        ToyGridsWithPreemption(Preset("scd-gm", 6), cls, kSeeds, broken, &broken_suspensions);
    for (int64_t i = 0; i < kSeeds; ++i) broken_differ += bad[i] != ar[i] ? 1 : 0;
  }
  std::printf(
      "resumed without recomputing the KV: %lld of %lld grids differ from ar-gm's "
      "(%lld suspensions)\n",
      static_cast<long long>(broken_differ), static_cast<long long>(kSeeds * kClasses),
      static_cast<long long>(broken_suspensions));
  EXPECT_GT(broken_differ, kSeeds * kClasses / 4);
}

// Like Sample, in SpecBatches whose every request is granted a window drawn anew each step
// (uniform in 1 .. its policy's window, a fixed pseudo-random sequence), as the goodput
// controller may grant them: windows cut short and grown again. Adds the cut drafts fed again.
RunStats SampleWithMovingWindows(const DecodingPolicy& policy, const SpecOptions& opts,
                                 int64_t per_class, int64_t* cut_fed) {
  const Toy& toy = TheToy();
  RunStats st;
  uint64_t lcg = 98765;
  auto window = [&lcg, &policy] {
    lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return 1 + static_cast<int64_t>((lcg >> 33) % static_cast<uint64_t>(policy.window));
  };
  for (int64_t cls = 0; cls < kClasses; ++cls) {
    for (int64_t first = 0; first < per_class; first += kChunk) {
      const int64_t count = std::min(kChunk, per_class - first);
      SpecBatch batch(*toy.target, toy.draft.get(), 2 * count, opts);
      const std::vector<int64_t> handles = AddToyRequests(batch, policy, cls, first, count);
      while (batch.active() > 0) {
        std::vector<WindowGrant> grants;
        for (int64_t h : handles) {
          if (!batch.done(h)) grants.push_back({h, window()});
        }
        if (Status s = batch.Step(grants); !s.ok()) throw std::runtime_error(s.ToString());
      }
      for (int64_t h : handles) {
        *cut_fed += batch.stats(h).cut_drafts_fed;
        st.Add(cls, batch.Take(h));
      }
    }
  }
  return st;
}

// Windows that move every step keep the exact AR distribution when a longer window feeds the
// drafts a shorter one cut (SpecOptions::keep_cut_drafts, verified as one-hot proposals), in
// plain, maximal-coupled and tree Jacobi decoding, with one-hot and uniform initial drafts;
// verifying them as if they were fresh uniform drafts (the initial q of SJD-PAC) fails.
TEST(SpecMovingWindowTest, KeptCutDraftsKeepTheExactDistribution) {
  const auto exact = JointAr();
  DecodingPolicy pac = Preset("sjd-pac", 9);
  pac.tree_branches = 3;
  pac.tree_depth = 2;
  const std::vector<std::pair<std::string, DecodingPolicy>> cases = {
      {"sjd", Preset("sjd", 6)}, {"scd-mc", Preset("scd-mc", 6)}, {"sjd-pac", pac}};
  for (const auto& [name, policy] : cases) {
    int64_t cut_fed = 0;
    const RunStats st = SampleWithMovingWindows(policy, {}, kPerClass / 2, &cut_fed);
    const auto chi = testing::ChiSquareTest(st.counts, exact);
    std::printf(
        "moving windows, %-8s %lld images, %.2f cut drafts fed again per image: chi2 %.1f "
        "df %d p %.4f | mean NFE %.3f\n",
        name.c_str(), static_cast<long long>(st.images),
        static_cast<double>(cut_fed) / static_cast<double>(st.images), chi.statistic, chi.df,
        chi.p_value, st.mean_nfe());
    EXPECT_GT(chi.p_value, 0.001) << name;
    EXPECT_GT(cut_fed, st.images / 2) << name;  // the kept drafts were fed again
  }
  SpecOptions broken;
  broken.testing_cut_drafts_with_initial_q = true;
  int64_t cut_fed = 0;
  const auto chi = testing::ChiSquareTest(
      SampleWithMovingWindows(pac, broken, kPerClass / 2, &cut_fed).counts, exact);
  std::printf("sjd-pac verifying kept cut drafts with the uniform initial q: chi2 %.1f p %.3g\n",
              chi.statistic, chi.p_value);
  EXPECT_LT(chi.p_value, 1e-6);
}

// The static-shape forward (ForwardOptions::static_shapes, what CUDA graphs replay) through the
// whole speculative step: target and draft forwards, chains, trees, device-fed drafts, a
// scratch slot in both caches. Its logits equal the ragged forward's within rounding
// (StaticForwardTest), so the same requests draw the same images but for the rare uniform that
// falls within that rounding of a token boundary: at least 99% identical per preset (256 requests),
// with the same steps where identical. (Lossless as it is: the acceptance rules never depend on how
// the forward rounds.)
TEST(SpecStaticShapesTest, EveryMethodDrawsTheEagerForwardsImages) {
  const Toy& toy = TheToy();
  struct Case {
    const char* name;
    DecodingPolicy policy;
  };
  DecodingPolicy pac = Preset("sjd-pac", 9);
  pac.tree_branches = 2;
  for (const Case& c : std::vector<Case>{{"ar", Preset("ar", 1)},
                                         {"sjd", Preset("sjd", 6)},
                                         {"scd-mc", Preset("scd-mc", 6)},
                                         {"sjd-pac K2", pac},
                                         {"gsd", Preset("gsd", 6)},
                                         {"sd", Preset("sd", 4)}}) {
    std::vector<ImageRequest> reqs(256);
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].class_id = static_cast<int64_t>(i % kClasses);
      reqs[i].seed = 777 + i;
      reqs[i].sampling = toy.sampling;
      reqs[i].policy = c.policy;
    }
    SpecOptions fixed;
    fixed.static_shapes = true;
    auto eager = GenerateSpeculative(*toy.target, toy.draft.get(), reqs);
    auto stat = GenerateSpeculative(*toy.target, toy.draft.get(), reqs, fixed);
    ASSERT_TRUE(eager.ok()) << eager.status().ToString();
    ASSERT_TRUE(stat.ok()) << stat.status().ToString();
    int64_t same = 0, same_steps = 0, nfe = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      if ((*eager)[i].tokens != (*stat)[i].tokens) continue;
      same += 1;
      same_steps += (*eager)[i].stats.nfe == (*stat)[i].stats.nfe ? 1 : 0;
      nfe += (*stat)[i].stats.nfe;
    }
    std::printf("%-10s static shapes: %lld of %zu images identical, mean NFE %.2f\n", c.name,
                static_cast<long long>(same), reqs.size(), same > 0 ? double(nfe) / same : 0.0);
    EXPECT_GE(same, 253) << c.name;  // 99%
    EXPECT_EQ(same_steps, same) << c.name;
  }
}

// An AR request paused and resumed draws the same tokens as without the pause: its random
// draws are keyed by its steps, and the recomputed KV entries equal the ones it had.
TEST(SpecBatchPreemptionTest, ArRequestResumedGivesTheSameGrid) {
  const Toy& toy = TheToy();
  for (uint64_t seed = 0; seed < 16; ++seed) {
    ImageRequest r;
    r.class_id = static_cast<int64_t>(seed % kClasses);
    r.seed = seed;
    r.sampling = toy.sampling;
    r.policy = Preset("ar", 1);
    auto alone = GenerateSpeculative(*toy.target, nullptr, {r});
    ASSERT_TRUE(alone.ok());
    SpecOptions o;
    o.batch_invariant = true;
    SpecBatch batch(*toy.target, nullptr, 4, o);
    auto other = batch.Add(r);  // holds slots while the request is away
    auto h = batch.Add(r);
    ASSERT_TRUE(h.ok() && other.ok());
    for (int step = 0; !batch.done(*h); ++step) {
      if (step == 3) {
        batch.Suspend(*h);
        ASSERT_TRUE(batch.Step().ok());  // the other one goes on
        ASSERT_TRUE(batch.Resume(*h).ok());
      }
      ASSERT_TRUE(batch.Step().ok());
    }
    EXPECT_EQ(batch.Take(*h).tokens, (*alone)[0].tokens) << "seed " << seed;
  }
}

// Relaxed SD on the draft model (COOL-SD), enumerated exactly: rounds of gamma drafts from the
// draft's q, acceptance f_i = min(1, w_i p/q), resampling G*_i = norm([p - min(q, w_i p)]_+),
// bonus from p. Returns the distribution over grids and the Theorem 2 bound summed over rounds.
struct CoolExact {
  std::vector<double> dist;
  double bound_sum = 0;    // sum over rounds of E[bound of that round] (hybrid argument)
  double first_bound = 0;  // Theorem 2 bound of the first round (empty prefix)
  double first_tv = 0;     // TV(P-hat, P) of the first round with virtual extension
};

CoolExact EnumerateCool(int64_t cls, const DecodingPolicy& pol) {
  const Toy& toy = TheToy();
  CoolExact out;
  out.dist.assign(kSeqs, 0.0);
  std::vector<std::map<int64_t, double>> states(kN + 1);  // by length: prefix index -> mass
  states[0][0] = 1.0;
  auto f = [](double w, double p, double q) {
    return q > 0 ? std::min(1.0, w * p / q) : (p > 0 ? 1.0 : 0.0);
  };
  struct Out {
    int64_t len, idx;
    double prob;
  };
  for (int64_t len = 0; len < kN; ++len) {
    for (const auto& [prefix, mass] : states[len]) {
      const int64_t gamma = std::min(pol.window - 1, kN - 1 - len);
      const auto w = CoolWeights(pol.cool_delta, pol.cool_nu, gamma);
      double bound = 0;
      std::vector<Out> round;  // the round's possible outputs
      // Depth-first over accepted drafts x_1..x_i, carrying reach = Q(x_1:i) prod f.
      std::function<void(int64_t, int64_t, double)> go = [&](int64_t i, int64_t pre, double reach) {
        const int64_t l = len + i;
        const double* p = toy.P(cls, l, pre);
        if (i == gamma) {  // all accepted: the bonus from p
          for (int64_t v = 0; v < kV; ++v) {
            if (p[v] > 0) round.push_back({l + 1, pre * kV + v, reach * p[v]});
          }
          return;
        }
        const double* q = toy.Q(cls, l, pre);
        double reject = 0, gs = 0;
        std::vector<double> g(kV);
        for (int64_t v = 0; v < kV; ++v) {
          reject += q[v] * (1 - f(w[i], p[v], q[v]));
          g[v] = std::max(0.0, p[v] - std::min(q[v], w[i] * p[v]));
          gs += g[v];
        }
        for (int64_t v = 0; v < kV; ++v) g[v] = gs > 0 ? g[v] / gs : p[v];
        for (int64_t v = 0; v < kV; ++v) {  // Theorem 2, the term of position i + 1
          bound += 0.5 * reach * std::fabs(q[v] * f(w[i], p[v], q[v]) - p[v] + g[v] * reject);
          if (reject > 0 && g[v] > 0) round.push_back({l + 1, pre * kV + v, reach * reject * g[v]});
        }
        for (int64_t v = 0; v < kV; ++v) {
          const double a = q[v] * f(w[i], p[v], q[v]);
          if (a > 0) go(i + 1, pre * kV + v, reach * a);
        }
      };
      go(0, prefix, 1.0);
      for (const Out& o : round) states[o.len][o.idx] += mass * o.prob;
      out.bound_sum += mass * bound;
      if (len == 0) {
        // P-hat of Theorem 2: the round's output extended with p to gamma + 1 tokens.
        const int64_t L1 = gamma + 1;
        std::vector<double> ph(static_cast<size_t>(Pow(kV, L1))), pp(ph.size());
        std::function<void(int64_t, int64_t, double, std::vector<double>&)> extend =
            [&](int64_t l, int64_t pre, double m, std::vector<double>& acc) {
              if (l == L1) {
                acc[static_cast<size_t>(pre)] += m;
                return;
              }
              const double* p = toy.P(cls, l, pre);
              for (int64_t v = 0; v < kV; ++v) {
                if (p[v] > 0) extend(l + 1, pre * kV + v, m * p[v], acc);
              }
            };
        for (const Out& o : round) extend(o.len, o.idx, o.prob, ph);
        extend(0, 0, 1.0, pp);
        out.first_bound = bound;
        out.first_tv = testing::TotalVariation(ph, pp);
      }
    }
  }
  for (const auto& [seq, m] : states[kN]) out.dist[static_cast<size_t>(seq)] += m;
  return out;
}

// COOL-SD (draft model): the engine matches the exactly enumerated relaxed process, whose
// distance to AR is reported and stays under the Theorem 2 bound.
TEST(SpeculativeLossyTest, CoolSdMatchesItsExactDistributionUnderTheTheorem2Bound) {
  for (double delta : {1.1, 2.0}) {
    DecodingPolicy pol = Preset("cool-sd", 4);
    pol.cool_delta = delta;
    std::vector<double> joint;
    double tv = 0, bound_sum = 0;
    for (int64_t c = 0; c < kClasses; ++c) {
      CoolExact e = EnumerateCool(c, pol);
      const auto ar = TheToy().Ar(c);
      const double tvc = testing::TotalVariation(e.dist, ar);
      std::printf(
          "cool-sd delta %.1f class %lld: exact TV to AR %.4f <= summed Theorem 2 bound "
          "%.4f; first round: TV(P-hat, P) %.4f <= bound %.4f\n",
          delta, static_cast<long long>(c), tvc, e.bound_sum, e.first_tv, e.first_bound);
      EXPECT_LE(e.first_tv, e.first_bound + 1e-12);
      EXPECT_LE(tvc, e.bound_sum + 1e-12);
      tv += tvc / kClasses;
      bound_sum += e.bound_sum / kClasses;
      for (double x : e.dist) joint.push_back(x / kClasses);
    }
    RunStats st = Sample(pol);
    auto chi = testing::ChiSquareTest(st.counts, joint);
    auto chi_ar = testing::ChiSquareTest(st.counts, JointAr());
    std::printf(
        "cool-sd delta %.1f: engine vs its exact distribution chi2 %.1f df %d p %.4f; vs "
        "AR p %.3g; mean NFE %.3f acceptance %.3f; TV %.4f (bound %.4f)\n",
        delta, chi.statistic, chi.df, chi.p_value, chi_ar.p_value, st.mean_nfe(), st.acceptance(),
        tv, bound_sum);
    EXPECT_GT(chi.p_value, 0.001);
    EXPECT_GT(tv, 0.0);
  }
}

// GSD and COOL-SD on Jacobi drafts: total variation to AR, next to the sampling noise of a
// lossless method at the same number of images.
TEST(SpeculativeLossyTest, JacobiLossyMethodsReportTheirDistance) {
  const auto exact = JointAr();
  const double noise = testing::TotalVariation(Empirical(Sample(Preset("sjd", 6))), exact);
  DecodingPolicy gsd = Preset("gsd", 6);
  gsd.gsd_group = 3;
  gsd.gsd_delta = 0.5;
  gsd.gsd_distance = 1e9;  // the toy embeddings are random: distance filter off
  DecodingPolicy cool = Preset("cool-sjd", 6);
  for (const auto& [name, pol] :
       {std::pair<const char*, DecodingPolicy>{"gsd", gsd}, {"cool-sjd", cool}}) {
    RunStats st = Sample(pol);
    const double tv = testing::TotalVariation(Empirical(st), exact);
    auto chi = testing::ChiSquareTest(st.counts, exact);
    std::printf(
        "%s %s: TV to AR %.4f (noise floor of a lossless run %.4f), chi2 p %.3g, "
        "mean NFE %.3f acceptance %.3f\n",
        name, DescribePolicy(pol).c_str(), tv, noise, chi.p_value, st.mean_nfe(), st.acceptance());
    EXPECT_GT(tv, noise);
  }
}

// w_i = delta * exp(-nu i - mu) with sum_i exp(-nu i - mu) = gamma: algorithms.md 5 gives
// 2.595, 1.289, 0.640, 0.318, 0.158 for nu = 0.7, gamma = 5, delta = 1.
TEST(SpeculativePolicyTest, CoolWeightsFollowSeed003) {
  const auto w = CoolWeights(1.0, 0.7, 5);
  const double want[] = {2.595, 1.289, 0.640, 0.318, 0.158};
  double sum = 0;
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(w[i], want[i], 1e-3);
    sum += w[i];
  }
  EXPECT_NEAR(sum / 5, 1.0, 1e-12);
  EXPECT_NEAR(CoolWeights(1.1, 0.7, 4)[0], 1.1 * 2.144, 2e-3);
  for (const auto& name : PresetNames()) {
    auto p = PolicyFromPreset(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_TRUE(ValidatePolicy(*p, 196, true).ok()) << name;
  }
}

TEST(SpeculativeValidationTest, BadPoliciesNameTheField) {
  Toy& toy = TheToy();
  SpecBatch batch(*toy.target, nullptr, 4);
  ImageRequest r;
  r.sampling = toy.sampling;
  r.policy = Preset("sjd", 4);
  r.policy.window = 100;
  // Requests are validated once (ValidateImageRequest, at submission); Add takes them as given.
  Status s = ValidateImageRequest(r, *toy.target, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("window"), std::string::npos);
  r.policy = Preset("sd", 4);
  s = ValidateImageRequest(r, *toy.target, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("draft"), std::string::npos);
  r.policy = Preset("sjd-pac", 9);
  r.policy.tree_branches = 3;
  r.policy.tree_depth = 4;  // 1 + 3 + 9 + 27 nodes > 9
  s = ValidateImageRequest(r, *toy.target, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tree_depth"), std::string::npos);
  r.policy = Preset("scd-gm", 4);
  r.policy.coupling = Coupling::kMaximal;  // the match rule needs Gumbel drafts
  s = ValidateImageRequest(r, *toy.target, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("coupling"), std::string::npos);
  EXPECT_FALSE(PolicyFromPreset("nope").ok());
  r.policy = Preset("sjd", 4);
  EXPECT_TRUE(ValidateImageRequest(r, *toy.target, nullptr).ok());
  EXPECT_TRUE(batch.Add(r).ok());
  EXPECT_TRUE(batch.Add(r).ok());
  auto full = batch.Add(r);  // two CFG requests fill the four slots
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), Code::kResourceExhausted);
}

}  // namespace
}  // namespace imagegen
