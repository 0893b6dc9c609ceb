// The continuous-token family in the serving engine, on the random MAR of the parity fixture
// (tools/parity.py): `mar` reproduces MAR's own loop, cspd with the target as its own draft
// accepts every draft and reproduces the target alone, the authors' variants run, MAR and GPT
// models are served side by side, and bad requests are refused naming the field.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <thread>

#include "engine/decoding/mar_sampler.h"
#include "engine/decoding/philox.h"
#include "engine/model/mar_model.h"
#include "engine/scheduler/engine.h"
#include "tests/engine_client.h"
#include "tests/build_paths.h"
#include "tests/temp_dir.h"

namespace imagegen {
namespace {

namespace fs = std::filesystem;
using testing::Recorder;

std::string RefDir() {
  const char* d = std::getenv("IMAGEGEN_PARITY_DIR");
  return d ? d : "parity";
}

// A models directory with the random MAR (and a copy that drafts for itself), its KL decoder
// and the bundled GPT family, by symlinks.
std::string ModelsDir() {
  static const std::string dir = [] {
    const fs::path d = fs::temp_directory_path() / ("imagegen-mar-" + std::to_string(getpid()));
    testing::TempDirs::Get().Add(d.string());  // removed at exit (the links, not their targets)
    fs::create_directories(d);
    for (const char* m : {"mar-small-random", "kl-small-random"}) {
      fs::create_symlink(fs::absolute(fs::path(RefDir()) / m), d / m);
    }
    for (const char* m : {"fmnist-gpt", "fmnist-vq", "fmnist-draft"}) {
      fs::create_symlink(fs::path(imagegen::testing::TestModelsDir()) / m, d / m);
    }
    // mar-self: the same weights, naming itself as its draft.
    fs::create_directories(d / "mar-self");
    fs::create_symlink(fs::absolute(fs::path(RefDir()) / "mar-small-random" / "model.safetensors"),
                       d / "mar-self" / "model.safetensors");
    std::ifstream in(fs::path(RefDir()) / "mar-small-random" / "config.json");
    std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    cfg.insert(cfg.find('{') + 1, "\"draft_model\": \"mar-self\", ");
    std::ofstream(d / "mar-self" / "config.json") << cfg;
    return d.string();
  }();
  return dir;
}

std::unique_ptr<Engine> Start(std::vector<std::string> models, int decode_thread = -1,
                              int64_t max_slots = 64) {
  EngineOptions o;
  o.max_slots = max_slots;
  o.decode_thread = decode_thread;
  o.models_dir = ModelsDir();
  o.models = std::move(models);
  o.fixed_step_cost = {0.01, 1e-4, 1e-3};
  o.cpu_threads = 1;
  auto e = Engine::Start(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(*e) : nullptr;
}

RequestResult Generate(Engine& e, GenerateParams p) {
  auto rec = std::make_shared<Recorder>();
  auto id = e.Submit(p, rec);
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_TRUE(rec->Wait());
  EXPECT_FALSE(rec->error.has_value()) << rec->error->ToString();
  return rec->result.value_or(RequestResult());
}

GenerateParams Params(const std::string& model, const std::string& method) {
  GenerateParams p;
  p.model = model;
  p.class_id = 3;
  p.seed = 11;
  p.cfg_scale = 3.0;
  p.policy = PolicyFromPreset(method).value();
  return p;
}

// The engine's draws for a request, as MarSampleTokens takes them: MAR's permutation (the
// reverse of the decision order) and every position's stream-0 trajectory noise.
at::Tensor ReferenceImage(const MarModel& m, uint64_t seed, int64_t label,
                          const MarSamplingParams& sp) {
  const int64_t s = m.mar->config().seq_len(), c = m.mar->config().token_dim();
  const int64_t steps = m.mar->head().steps();
  std::vector<int64_t> order(static_cast<size_t>(s));
  std::iota(order.begin(), order.end(), 0);
  std::vector<double> keys(static_cast<size_t>(s));
  for (int64_t p = 0; p < s; ++p) keys[p] = Uniform(seed, p, 0, Purpose::kDraftInit);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  std::reverse(order.begin(), order.end());
  at::Tensor x_T = at::empty({1, s, c}), eps = at::empty({1, s, steps, c});
  for (int64_t p = 0; p < s; ++p) {
    at::Tensor xt, e;
    MarTrajectoryNoise(seed, p, steps, c, &xt, &e);
    x_T[0][p].copy_(xt);
    eps[0][p].copy_(e);
  }
  auto tokens = MarSampleTokens(*m.mar, at::tensor({label}, at::kLong),
                                at::tensor(order, at::kLong).unsqueeze(0), x_T, eps, sp);
  EXPECT_TRUE(tokens.ok());
  auto px = LatentsToPixels(m, *tokens);
  EXPECT_TRUE(px.ok());
  return (*px)[0];
}

at::Tensor Pixels(const RequestResult& r) {
  const Image& im = r.image;
  return at::from_blob(const_cast<char*>(im.pixels.data()), {im.height, im.width, im.channels},
                       at::kByte)
      .clone();
}

// Also with the latents decoded on the decode thread (EngineOptions::decode_thread).
TEST(MarEngineTest, MarMatchesMarsOwnLoop) {
  for (const int decode_thread : {0, 1}) {
    SCOPED_TRACE("decode_thread " + std::to_string(decode_thread));
    auto e = Start({"mar-small-random"}, decode_thread);
    ASSERT_NE(e, nullptr);
    GenerateParams p = Params("mar-small-random", "mar");
    p.policy.cont.num_iter = 8;
    p.preview_every = 2;
    auto rec = std::make_shared<Recorder>();
    ASSERT_TRUE(e->Submit(p, rec).ok());
    ASSERT_TRUE(rec->Wait());
    ASSERT_TRUE(rec->result.has_value()) << rec->error->ToString();
    const RequestResult& r = *rec->result;
    EXPECT_EQ(r.stats.counters.nfe, 8);
    EXPECT_EQ(r.stats.counters.tokens, 256);
    EXPECT_EQ(rec->events.size(), 8u);
    int64_t decided = 0;
    for (const StepEvent& ev : rec->events) decided += static_cast<int64_t>(ev.positions.size());
    EXPECT_EQ(decided, 256);
    EXPECT_GT(rec->events[1].preview.width, 0);  // preview_every 2

    // The engine thread runs LibTorch on one thread (cpu_threads 1); so must the reference, or
    // the two split their reductions differently.
    at::set_num_threads(1);
    auto m = LoadMarModel(ModelsDir(), "mar-small-random", {});
    ASSERT_TRUE(m.ok());
    MarSamplingParams sp;
    sp.num_iter = 8;
    sp.cfg_scale = 3.0;
    const at::Tensor ref = ReferenceImage(*m, 11, 3, sp);
    EXPECT_TRUE(at::equal(Pixels(r), ref))
        << "max diff " << (Pixels(r).to(at::kInt) - ref.to(at::kInt)).abs().max();
  }
}

// MAR's previews (the KL decoder, on the engine thread) keep to EngineOptions::preview_share
// as the discrete family's do; they were decoded every due step whatever the share.
TEST(MarEngineTest, PreviewsKeepToTheirShareOfTheEngine) {
  for (const double share : {0.0, 1e-12}) {
    SCOPED_TRACE("preview_share " + std::to_string(share));
    EngineOptions o;
    o.models_dir = ModelsDir();
    o.models = {"mar-small-random"};
    o.fixed_step_cost = {0.01, 1e-4, 1e-3};
    o.cpu_threads = 1;
    o.preview_share = share;
    auto e = Engine::Start(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    GenerateParams p = Params("mar-small-random", "mar");
    p.policy.cont.num_iter = 8;
    p.preview_every = 1;
    auto rec = std::make_shared<Recorder>();
    ASSERT_TRUE((*e)->Submit(p, rec).ok());
    ASSERT_TRUE(rec->Wait());
    ASSERT_TRUE(rec->result.has_value()) << rec->error->ToString();
    ASSERT_EQ(rec->events.size(), 8u);
    int64_t previews = 0;
    for (const StepEvent& ev : rec->events) previews += ev.preview.empty() ? 0 : 1;
    // No budget: every step but the last (the image itself comes next); a share of 1e-12:
    // the first, which measures the cost, and none after.
    EXPECT_EQ(previews, share == 0 ? 7 : 1);
  }
}

TEST(MarEngineTest, CspdWithTheTargetAsDraftAcceptsAllAndDrawsTheTargetsImage) {
  auto e = Start({"mar-self"});
  ASSERT_NE(e, nullptr);
  GenerateParams target = Params("mar-self", "mar");
  target.policy.cont.num_iter = 256;
  target.policy.cont.final_noise = true;  // cspd's convention
  const RequestResult a = Generate(*e, target);
  GenerateParams spec = Params("mar-self", "cspd");
  spec.policy.window = 8;
  spec.policy.cont.prefill = 0.05;
  const RequestResult b = Generate(*e, spec);
  EXPECT_EQ(b.stats.counters.drafts_accepted, b.stats.counters.drafts_verified);
  EXPECT_GT(b.stats.counters.drafts_verified, 200);
  // 13 pre-fill forwards, then windows of 8 drafts + 1 bonus token.
  EXPECT_EQ(b.stats.counters.nfe, 13 + (256 - 13 + 8) / 9);
  EXPECT_EQ(b.stats.counters.draft_forwards, b.stats.counters.drafts_verified);
  // Aligned, the draft's tokens are the target's (up to the rounding of batched rows).
  EXPECT_LT(b.stats.draft_target_sq_dist, 1e-6);
  const at::Tensor pa = Pixels(a).to(at::kInt), pb = Pixels(b).to(at::kInt);
  // The same draws; the batched target rows may round differently from the one-row forward.
  EXPECT_LE((pa - pb).abs().max().item<int>(), 1);
}

TEST(MarEngineTest, AuthorsVariantsRunAndCount) {
  auto e = Start({"mar-small-random", "fmnist-gpt"});
  ASSERT_NE(e, nullptr);
  // No draft model: cspd is not offered, and asking for it names the field.
  GenerateParams p = Params("mar-small-random", "cspd");
  auto rec = std::make_shared<Recorder>();
  auto id = e->Submit(p, rec);
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("draft model"), std::string::npos);
  const auto& infos = e->Models();
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_TRUE(infos[0].continuous);
  EXPECT_EQ(infos[0].methods, std::vector<std::string>{"mar"});
  EXPECT_FALSE(infos[1].continuous);
  // Discrete-only parameters and methods are refused for MAR, and MAR's for the GPT.
  p = Params("mar-small-random", "mar");
  p.top_k = 5;
  id = e->Submit(p, rec);
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("top_k"), std::string::npos);
  p = Params("mar-small-random", "sjd");
  id = e->Submit(p, rec);
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("method"), std::string::npos);
  p = Params("fmnist-gpt", "mar");
  id = e->Submit(p, rec);
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("continuous"), std::string::npos);
  // Both families in one engine, at the same time.
  GenerateParams m = Params("mar-small-random", "mar");
  m.policy.cont.num_iter = 4;
  GenerateParams g = Params("fmnist-gpt", "sjd");
  auto r1 = std::make_shared<Recorder>(), r2 = std::make_shared<Recorder>();
  ASSERT_TRUE(e->Submit(m, r1).ok());
  ASSERT_TRUE(e->Submit(g, r2).ok());
  ASSERT_TRUE(r1->Wait());
  ASSERT_TRUE(r2->Wait());
  EXPECT_TRUE(r1->result.has_value());
  EXPECT_TRUE(r2->result.has_value());
  EXPECT_EQ(r2->result->tokens.size(), 196u);
}

TEST(MarEngineTest, CspdDeparturesAndCancellation) {
  auto e = Start({"mar-self"});
  ASSERT_NE(e, nullptr);
  GenerateParams p = Params("mar-self", "cspd");
  p.policy.window = 4;
  p.policy.cont.verified_context = true;  // the authors' effective target
  p.policy.cont.inner_temperature = 42;
  p.policy.cont.invert_sigma = true;
  p.policy.cont.residual_rounds = 100;
  p.policy.cont.zero_fallback = true;
  p.policy.cont.draft_mean = true;
  const RequestResult r = Generate(*e, p);
  EXPECT_EQ(r.stats.counters.tokens, 256);
  EXPECT_GT(r.stats.counters.drafts_verified, 0);
  // The draft's token is its mean, the target's is drawn with the final step's noise.
  EXPECT_GT(r.stats.draft_target_sq_dist, 0);
  // A cancel mid-way ends the request with CANCELLED and frees its rows.
  auto rec = std::make_shared<Recorder>(e.get(), 3);
  GenerateParams c = Params("mar-self", "cspd");
  ASSERT_TRUE(e->Submit(c, rec).ok());
  ASSERT_TRUE(rec->Wait());
  ASSERT_TRUE(rec->error.has_value());
  EXPECT_EQ(rec->error->code(), Code::kCancelled);
  for (int i = 0; i < 200 && e->Stats().models[0].slots_used != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(e->Stats().models[0].slots_used, 0);
}

// A rejected token's residual draw goes on past its first residual_rounds proposals when none
// was kept (CspdContinueResidual, up to kCspdMaxResidualRounds), with the next rounds of the
// same keyed streams: a request drawn one proposal at a time is the request drawn 256 at a
// time (the default), pixel for pixel, with no fallback. At temperature 0.01 the target drafting
// for itself rejects a few tokens whose residuals keep few proposals (one took over 256 here).
// Power: with the draw stopped at the first chunk, one proposal per chunk falls back and
// changes the image.
TEST(MarEngineTest, CspdResidualGoesOnPastItsFirstChunkAsOneDrawOfAllItsRounds) {
  auto e = Start({"mar-self"});
  ASSERT_NE(e, nullptr);
  std::vector<RequestResult> runs;
  for (int rounds : {1, 256}) {
    GenerateParams p = Params("mar-self", "cspd");
    p.policy.window = 8;
    p.temperature = kCspdMinTemperature;
    p.seed = 12;
    p.policy.cont.residual_rounds = rounds;
    runs.push_back(Generate(*e, p));
  }
  const RequestResult& one = runs[0];
  const int64_t rejected = one.stats.counters.drafts_verified - one.stats.counters.drafts_accepted;
  ASSERT_GT(rejected, 0);
  EXPECT_GT(one.stats.residual_rounds, rejected);  // some residual needed more than one round
  for (const RequestResult& r : runs) {
    EXPECT_EQ(r.stats.residual_fallbacks, 0);
    EXPECT_EQ(r.stats.residual_rounds, one.stats.residual_rounds);
    EXPECT_TRUE(r.image.pixels == one.image.pixels) << "the images differ";
  }
}

// What the server cannot run is refused when submitted, naming the field, not after a wait in
// the queue: a cspd window whose rows (window + 1 contexts, two each with CFG) exceed the
// server's, and cspd tokens taken at the mean (its acceptance test needs a draw).
TEST(MarEngineTest, RequestsTheServerCannotRunAreRefusedAtSubmit) {
  auto e = Start({"mar-self"}, -1, /*max_slots=*/8);
  ASSERT_NE(e, nullptr);
  auto submit = [&](const GenerateParams& p) { return e->Submit(p, std::make_shared<Recorder>()); };
  GenerateParams p = Params("mar-self", "cspd");
  p.policy.window = 4;  // 5 contexts x 2 = 10 rows > 8
  auto id = submit(p);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().field(), "window") << id.status().ToString();
  EXPECT_NE(id.status().message().find("needs 10 forward rows per step, the server has 8"),
            std::string::npos)
      << id.status().ToString();
  p.policy.window = 3;  // 4 x 2 = 8: fits, and runs
  auto rec = std::make_shared<Recorder>();
  ASSERT_TRUE(e->Submit(p, rec).ok());
  ASSERT_TRUE(rec->Wait());
  EXPECT_FALSE(rec->error.has_value()) << rec->error->ToString();
  p.policy.window = 7;  // without guidance, 8 rows fit (taken, then cancelled: not run)
  p.cfg_scale = 1.0;
  id = submit(p);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  e->Cancel(*id);
  p.policy.window = 3;
  p.cfg_scale = 3.0;
  p.policy.cont.final_noise = false;
  id = submit(p);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().field(), "final_noise") << id.status().ToString();
  // mar takes its tokens at the mean by default.
  GenerateParams m = Params("mar-self", "mar");
  m.policy.cont.final_noise = false;
  id = submit(m);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  e->Cancel(*id);
}

// cspd refuses a temperature below kCspdMinTemperature at Submit, naming the field (it was
// taken, and its drafts were then refused by float32 rounding: 1 of 243 accepted at 1e-5);
// at the floor a self-drafted request accepts nearly every draft (216 of 217 measured; 194
// of 233, 83%, at 1e-3, which the bound below would fail); mar itself takes any positive
// temperature.
TEST(MarEngineTest, CspdRefusesTemperaturesBelowItsFloorAndAcceptsItsDraftsAtIt) {
  auto e = Start({"mar-self"});
  ASSERT_NE(e, nullptr);
  GenerateParams p = Params("mar-self", "cspd");
  p.policy.window = 8;
  p.policy.cont.prefill = 0.05;
  for (double t : {1e-30, 1e-5, 0.999 * kCspdMinTemperature}) {
    p.temperature = t;
    auto id = e->Submit(p, std::make_shared<Recorder>());
    ASSERT_FALSE(id.ok()) << t;
    EXPECT_EQ(id.status().field(), "temperature") << id.status().ToString();
    EXPECT_NE(id.status().message().find("at least 0.01 for cspd"), std::string::npos)
        << id.status().ToString();
  }
  p.temperature = kCspdMinTemperature;
  const RequestResult r = Generate(*e, p);
  EXPECT_GT(r.stats.counters.drafts_verified, 200);
  EXPECT_GE(static_cast<double>(r.stats.counters.drafts_accepted),
            0.95 * static_cast<double>(r.stats.counters.drafts_verified));
  GenerateParams m = Params("mar-self", "mar");
  m.temperature = 1e-30;
  const RequestResult rm = Generate(*e, m);
  EXPECT_FALSE(rm.image.pixels.empty());
}

}  // namespace
}  // namespace imagegen
