// Prompted (text-to-image) generation on an enumerable toy: a tiny random Janus-layout model
// (prompt tokens, gen_aligner inputs, gen_head logits, 1-D rotate-half RoPE) over 3 image
// codes on a 3x3 grid, with CFG 1.5 (the unconditional row's prompt padded as Janus pads it)
// and top-k 2. Three prompts of lengths 2, 4 and 7 are co-batched with a mix of decoding
// methods, the long prompt prefilled 2 tokens a step while the others decode, and images of
// one prompt sharing one prefill. Every conditional distribution is tabulated from the model's
// own forward, which gives the exact AR distribution over all 3^9 grids per prompt: the
// samples of every prompt must match it (chi-square), and must not match another prompt's.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>

#include "engine/decoding/sampling.h"
#include "engine/decoding/speculative.h"
#include "engine/scheduler/engine.h"
#include "tests/spec_toy.h"
#include "tests/stats.h"
#include "tests/test_util.h"

namespace imagegen {
namespace {

using namespace imagegen::testing;  // NOLINT: the toy's constants and helpers

class PromptToy {
 public:
  PromptToy() {
    dir = TempDir("prompt_toy");
    TinyJanusSpec spec;
    const std::string extra =
        ", \"tokenizer\": \"toy-vq\", \"draft_model\": \"toy-t2i-draft\", "
        "\"sampling_defaults\": {\"cfg_scale\": 1.5, \"top_k\": 2}";
    auto t = Gpt::Load(WriteTinyJanus(dir + "/toy-t2i", spec, 41, extra), TestLoadOptions());
    spec.dim = 8;
    spec.n_layer = 1;
    spec.ffn = 16;
    spec.head = 8;
    auto d = Gpt::Load(WriteTinyJanus(dir + "/toy-t2i-draft", spec, 43), TestLoadOptions());
    WriteTinyVq(dir + "/toy-vq", kV, kGrid);
    if (!t.ok() || !d.ok()) throw std::runtime_error("prompt toy models");
    target = std::move(t).value();
    draft = std::move(d).value();
    sampling.cfg_scale = 1.5;
    sampling.top_k = 2;
    for (size_t pi = 0; pi < prompts.size(); ++pi) table.push_back(Tabulate(Request(pi)));
  }

  // Exact AR probability of every complete grid for prompt `pi`.
  std::vector<double> Ar(size_t pi) const { return Exact(table[pi]); }
  // The same for any request (its prompt and negative prompt).
  std::vector<double> Ar(const ImageRequest& r) const { return Exact(Tabulate(r)); }

  ImageRequest Request(size_t pi) const {
    ImageRequest r;
    r.prompt = prompts[pi];
    r.sampling = sampling;
    return r;
  }

  std::unique_ptr<Gpt> target, draft;
  SamplingParams sampling;
  std::string dir;  // a models directory: toy-t2i (drafted for by toy-t2i-draft), toy-vq
  const std::vector<std::vector<int64_t>> prompts = {{1, 5}, {1, 6, 3, 2}, {1, 4, 4, 7, 5, 3, 2}};

 private:
  static std::vector<double> Exact(const std::vector<std::vector<double>>& t) {
    std::vector<double> out(kSeqs);
    for (int64_t s = 0; s < kSeqs; ++s) {
      double pr = 1;
      int64_t prefix = 0;
      for (int64_t k = 0; k < kN; ++k) {
        const int64_t tok = Toy::Digit(s, k);
        pr *= t[static_cast<size_t>(k)][static_cast<size_t>(prefix * kV + tok)];
        prefix = prefix * kV + tok;
      }
      out[static_cast<size_t>(s)] = pr;
    }
    return out;
  }

  // p(. | condition rows, image prefix) for every prefix length and prefix, from the target's
  // forward on the request's conditional and unconditional rows.
  std::vector<std::vector<double>> Tabulate(const ImageRequest& r) const {
    const GptConfig& cfg = target->config();
    const std::vector<int64_t> prompt = ConditionTokens(r, cfg);
    const std::vector<int64_t> uncond = UnconditionalTokens(r, cfg);
    const auto P = static_cast<int64_t>(prompt.size());
    std::vector<std::vector<double>> out(kN);
    for (int64_t len = 0; len < kN; ++len) {
      const int64_t count = Pow(kV, len), L = P + len;
      KvCache cache = target->NewCache(2 * count);
      std::vector<BatchRow> rows;
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t u = 0; u < 2; ++u) {
          BatchRow row;
          row.slot = 2 * i + u;
          row.prefix = P;
          row.tokens = u == 0 ? prompt : uncond;
          for (int64_t k = 0; k < len; ++k) row.tokens.push_back(i / Pow(kV, len - 1 - k) % kV);
          for (int64_t p = 0; p < L; ++p) row.positions.push_back(p);
          rows.push_back(std::move(row));
        }
      }
      at::Tensor l = target->Forward(rows, cache)->cpu();
      at::Tensor last_c = at::arange(L - 1, 2 * count * L, 2 * L);
      at::Tensor g = CfgCombine(l.index_select(0, last_c), l.index_select(0, last_c + L),
                                at::full({count}, static_cast<float>(sampling.cfg_scale)));
      at::Tensor p =
          FinalProbs(g, std::vector<SamplingParams>(count, sampling)).to(at::kDouble).contiguous();
      out[static_cast<size_t>(len)].assign(p.data_ptr<double>(), p.data_ptr<double>() + count * kV);
    }
    return out;
  }

  std::vector<std::vector<std::vector<double>>> table;
};

PromptToy& TheToy() {
  static PromptToy* toy = new PromptToy();
  return *toy;
}

DecodingPolicy Preset(const std::string& name, int64_t window) {
  auto p = PolicyFromPreset(name, window);
  if (!p.ok()) throw std::runtime_error(p.status().ToString());
  return *p;
}

struct Method {
  const char* name;
  DecodingPolicy policy;
};

std::vector<Method> Methods() {
  DecodingPolicy pac = Preset("sjd-pac", 9);
  pac.tree_branches = 2;
  return {{"ar", Preset("ar", 1)},
          {"sjd L4", Preset("sjd", 4)},
          {"scd-mc L6", Preset("scd-mc", 6)},
          {"sjd-pac K2 L9", pac},
          {"sd L4", Preset("sd", 4)}};
}

TEST(PromptTest, CoBatchedPromptsMatchTheirExactDistributions) {
  PromptToy& toy = TheToy();
  const std::vector<Method> methods = Methods();
  const size_t prompts = toy.prompts.size();
  constexpr int64_t kPerPrompt = 30000, kChunk = 5000;
  std::vector<std::vector<int64_t>> counts(prompts, std::vector<int64_t>(kSeqs, 0));
  std::vector<int64_t> nfe(methods.size(), 0), images(methods.size(), 0);
  std::vector<int64_t> prefill_forwards(prompts, 0), prefilled_images(prompts, 0);
  SpecOptions opts;
  opts.prefill_chunk = 2;  // the 7-token prompt prefills over 3 steps while the others decode
  for (int64_t first = 0; first < kPerPrompt; first += kChunk) {
    std::vector<ImageRequest> reqs;
    std::vector<size_t> which, how;
    for (int64_t i = first; i < first + kChunk; ++i) {
      for (size_t pi = 0; pi < prompts; ++pi) {
        ImageRequest r = toy.Request(pi);
        r.seed = static_cast<uint64_t>(i * 7919 + static_cast<int64_t>(pi));
        const size_t m = static_cast<size_t>(i + static_cast<int64_t>(pi)) % methods.size();
        r.policy = methods[m].policy;
        reqs.push_back(r);
        which.push_back(pi);
        how.push_back(m);
      }
    }
    auto res = GenerateSpeculative(*toy.target, toy.draft.get(), reqs, opts);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    for (size_t k = 0; k < res->size(); ++k) {
      const SpecResult& r = (*res)[k];
      ASSERT_EQ(static_cast<int64_t>(r.tokens.size()), kN);
      int64_t idx = 0;
      for (int32_t t : r.tokens) idx = idx * kV + t;
      counts[which[k]][static_cast<size_t>(idx)]++;
      nfe[how[k]] += r.stats.nfe;
      images[how[k]] += 1;
      prefill_forwards[which[k]] += r.stats.prefill_forwards;
      prefilled_images[which[k]] += r.stats.prefill_forwards > 0 ? 1 : 0;
    }
  }
  std::vector<std::vector<double>> exact;
  for (size_t pi = 0; pi < prompts; ++pi) exact.push_back(toy.Ar(pi));
  for (size_t pi = 0; pi < prompts; ++pi) {
    const auto chi = testing::ChiSquareTest(counts[pi], exact[pi]);
    const auto other = testing::ChiSquareTest(counts[pi], exact[(pi + 1) % prompts]);
    std::printf(
        "prompt of %zu tokens: %lld images, chi2 %.1f df %d p %.4f; against the next prompt's "
        "distribution p %.3g; prefill forwards %lld by %lld image(s) (one per chunk of "
        "requests; the rest copied its KV)\n",
        toy.prompts[pi].size(), static_cast<long long>(kPerPrompt), chi.statistic, chi.df,
        chi.p_value, other.p_value, static_cast<long long>(prefill_forwards[pi]),
        static_cast<long long>(prefilled_images[pi]));
    EXPECT_GT(chi.p_value, 0.001);
    EXPECT_LT(other.p_value, 1e-6) << "the test cannot tell prompts apart";
    // One image per chunk prefilled (GenerateSpeculative shares the prompt's prefill).
    EXPECT_EQ(prefilled_images[pi], toy.prompts[pi].size() > 1 ? kPerPrompt / kChunk : 0);
    const auto chunks = static_cast<int64_t>((toy.prompts[pi].size() - 1 + 1) / 2);
    EXPECT_EQ(prefill_forwards[pi], chunks * (kPerPrompt / kChunk));
  }
  for (size_t m = 0; m < methods.size(); ++m) {
    const double mean = static_cast<double>(nfe[m]) / static_cast<double>(images[m]);
    std::printf("  %-14s mean NFE %.3f (AR %lld)\n", methods[m].name, mean,
                static_cast<long long>(kN));
    if (methods[m].policy.draft == DraftSource::kNone) {
      EXPECT_EQ(nfe[m], kN * images[m]);
    } else {
      EXPECT_LT(mean, kN);  // it did speculate
    }
  }
}

// Negative prompts: the unconditional row is the negative prompt, and the shorter of it and the
// prompt gets pad ids after its first token. Co-batched, with the negative prompt longer than
// the prompt in one case and shorter in the other, and a mix of methods, the samples match the
// exact AR distribution of those rows, and not the distribution without the negative prompt
// (the test's power: a negative prompt that were ignored would fail it).
TEST(PromptTest, NegativePromptsMatchTheirExactDistributions) {
  PromptToy& toy = TheToy();
  const GptConfig& cfg = toy.target->config();
  const int64_t pad = cfg.pad_id;
  ImageRequest longer = toy.Request(0);  // {1, 5}
  longer.negative_prompt = {1, 6, 3, 2};
  ImageRequest shorter = toy.Request(2);  // 7 tokens
  shorter.negative_prompt = {1, 6};
  EXPECT_EQ(ConditionTokens(longer, cfg), (std::vector<int64_t>{1, pad, pad, 5}));
  EXPECT_EQ(UnconditionalTokens(longer, cfg), (std::vector<int64_t>{1, 6, 3, 2}));
  EXPECT_EQ(ConditionTokens(shorter, cfg), toy.prompts[2]);
  EXPECT_EQ(UnconditionalTokens(shorter, cfg),
            (std::vector<int64_t>{1, pad, pad, pad, pad, pad, 6}));
  const std::vector<ImageRequest> cases = {longer, shorter};
  const std::vector<size_t> plain = {0, 2};  // the same prompts without a negative prompt
  const std::vector<Method> methods = Methods();
  constexpr int64_t kPerCase = 20000, kChunk = 5000;
  std::vector<std::vector<int64_t>> counts(cases.size(), std::vector<int64_t>(kSeqs, 0));
  SpecOptions opts;
  opts.prefill_chunk = 2;
  int64_t prefilled = 0;
  for (int64_t first = 0; first < kPerCase; first += kChunk) {
    std::vector<ImageRequest> reqs;
    for (int64_t i = first; i < first + kChunk; ++i) {
      for (size_t c = 0; c < cases.size(); ++c) {
        ImageRequest r = cases[c];
        r.seed = static_cast<uint64_t>(i * 7907 + static_cast<int64_t>(c) + 11);
        r.policy =
            methods[static_cast<size_t>(i + static_cast<int64_t>(c)) % methods.size()].policy;
        reqs.push_back(r);
      }
    }
    auto res = GenerateSpeculative(*toy.target, toy.draft.get(), reqs, opts);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    for (size_t k = 0; k < res->size(); ++k) {
      int64_t idx = 0;
      for (int32_t t : (*res)[k].tokens) idx = idx * kV + t;
      counts[k % cases.size()][static_cast<size_t>(idx)]++;
      prefilled += (*res)[k].stats.prefill_forwards > 0 ? 1 : 0;
    }
  }
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto chi = testing::ChiSquareTest(counts[c], toy.Ar(cases[c]));
    const auto without = testing::ChiSquareTest(counts[c], toy.Ar(plain[c]));
    std::printf(
        "prompt of %zu tokens, negative prompt of %zu: chi2 %.1f df %d p %.4f; against the "
        "prompt alone p %.3g\n",
        cases[c].prompt.size(), cases[c].negative_prompt.size(), chi.statistic, chi.df, chi.p_value,
        without.p_value);
    EXPECT_GT(chi.p_value, 0.001);
    EXPECT_LT(without.p_value, 1e-6) << "the negative prompt made no difference";
  }
  // Images with the same prompt and negative prompt share a prefill: one per case and chunk.
  EXPECT_EQ(prefilled, static_cast<int64_t>(cases.size()) * (kPerCase / kChunk));
}

// Batch-invariant forwards: an image that copies a sibling's prefill is the image it would
// have drawn prefilling itself, and a prompt prefilled in chunks of 1, 3 or all at once gives
// the same image.
TEST(PromptTest, SharedAndChunkedPrefillGiveTheSameImages) {
  PromptToy& toy = TheToy();
  SpecOptions opts;
  opts.batch_invariant = true;
  auto run = [&](int64_t chunk, bool share) {
    opts.prefill_chunk = chunk;
    SpecBatch batch(*toy.target, toy.draft.get(), 64, opts);
    std::vector<int64_t> handles;
    for (int64_t i = 0; i < 24; ++i) {
      ImageRequest r = toy.Request(2);
      r.seed = static_cast<uint64_t>(100 + i);
      r.policy = Methods()[static_cast<size_t>(i) % Methods().size()].policy;
      auto h = batch.Add(r, share && i > 0 ? handles[0] : -1);
      EXPECT_TRUE(h.ok()) << h.status().ToString();
      handles.push_back(*h);
    }
    while (batch.active() > 0) EXPECT_TRUE(batch.Step().ok());
    std::vector<std::vector<int32_t>> out;
    int64_t prefills = 0;
    for (int64_t h : handles) {
      SpecResult r = batch.Take(h);
      prefills += r.stats.prefill_forwards;
      out.push_back(r.tokens);
    }
    std::printf("chunk %lld, %s: %lld prefill forwards\n", static_cast<long long>(chunk),
                share ? "shared" : "each its own", static_cast<long long>(prefills));
    return std::make_pair(out, prefills);
  };
  const auto alone = run(0, false);
  const auto shared = run(0, true);
  const auto by1 = run(1, true);
  const auto by3 = run(3, false);
  EXPECT_EQ(alone.first, shared.first);
  EXPECT_EQ(alone.first, by1.first);
  EXPECT_EQ(alone.first, by3.first);
  EXPECT_EQ(alone.second, 24);  // 6 prompt tokens in one chunk, per image
  EXPECT_EQ(shared.second, 1);  // one image prefilled, 23 copied
  EXPECT_EQ(by1.second, 6);
  EXPECT_EQ(by3.second, 48);
}

// The serving engine: prompts of three lengths from many clients at once, with the prompt
// prefill spread over steps (2 tokens a step across all prefilling requests) and requests of
// one prompt sharing a running one's prefill, give exactly the images the offline batch gives
// for the same seeds (batch-invariant forwards, the engine's default; full windows, since a
// window the budget shrinks draws another sample of the same distribution).
class Collect : public RequestObserver {
 public:
  void OnStep(const StepEvent& e) override {
    std::lock_guard<std::mutex> l(mu);
    events += 1;
    streamed += static_cast<int64_t>(e.tokens.size());
  }
  void OnComplete(RequestResult r) override {
    std::lock_guard<std::mutex> l(mu);
    result = std::move(r);
    done = true;
    cv.notify_all();
  }
  void OnError(const Status& s) override {
    std::lock_guard<std::mutex> l(mu);
    error = s;
    done = true;
    cv.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int64_t events = 0, streamed = 0;
  RequestResult result;
  Status error;
};

// Submits `n` requests of the toy's prompts in turn to `engine` (seed seed0 + i, the method
// changing every `per_method` requests, the image decoded for every `decode_every`-th; 0: none)
// and returns the same requests for the offline batch; a refused submission fails the test and
// ends the list there.
std::vector<ImageRequest> SubmitToyPrompts(Engine& engine, PromptToy& toy, int64_t n,
                                           uint64_t seed0, int64_t per_method, int64_t decode_every,
                                           std::vector<std::shared_ptr<Collect>>* obs) {
  const std::vector<Method> methods = Methods();
  std::vector<ImageRequest> offline;
  for (int64_t i = 0; i < n; ++i) {
    const size_t pi = static_cast<size_t>(i) % toy.prompts.size();
    GenerateParams p;
    p.prompt_token_ids = toy.prompts[pi];
    p.seed = seed0 + static_cast<uint64_t>(i);
    p.policy = methods[static_cast<size_t>(i / per_method) % methods.size()].policy;
    p.decode_image = decode_every > 0 && i % decode_every == 0;
    auto observer = std::make_shared<Collect>();
    auto id = engine.Submit(p, observer);
    if (!id.ok()) {
      ADD_FAILURE() << id.status().ToString();
      break;
    }
    obs->push_back(observer);
    ImageRequest r = toy.Request(pi);
    r.seed = *p.seed;
    r.policy = p.policy;
    offline.push_back(r);
  }
  return offline;
}

// The offline batch's images (batch-invariant forwards) of `requests`.
StatusOr<std::vector<SpecResult>> OfflineImages(PromptToy& toy,
                                                const std::vector<ImageRequest>& requests) {
  SpecOptions so;
  so.batch_invariant = true;
  return GenerateSpeculative(*toy.target, toy.draft.get(), requests, so);
}

TEST(EnginePromptTest, ServedPromptsGiveTheOfflineImages) {
  PromptToy& toy = TheToy();
  EngineOptions o;
  o.models_dir = toy.dir;
  o.models = {"toy-t2i"};
  o.window_policy = "full";  // windows as offline: a shrunk window draws another sample
  o.prefill_tokens_per_step = 2;
  auto started = Engine::Start(o);
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  Engine& engine = **started;
  const ModelInfo& info = engine.Models()[0];
  EXPECT_TRUE(info.prompted);
  EXPECT_EQ(info.max_prompt_len, 8);
  EXPECT_EQ(info.text_vocab_size, 8);
  EXPECT_EQ(info.num_classes, 0);

  std::vector<std::shared_ptr<Collect>> obs;
  const std::vector<ImageRequest> offline =
      SubmitToyPrompts(engine, toy, 24, /*seed0=*/500, /*per_method=*/3, /*decode_every=*/8, &obs);
  ASSERT_EQ(obs.size(), offline.size());
  auto expect = OfflineImages(toy, offline);
  ASSERT_TRUE(expect.ok()) << expect.status().ToString();
  int64_t shared = 0;
  for (size_t i = 0; i < obs.size(); ++i) {
    obs[i]->Wait();
    ASSERT_TRUE(obs[i]->error.ok()) << obs[i]->error.ToString();
    const RequestResult& r = obs[i]->result;
    EXPECT_EQ(r.tokens, (*expect)[i].tokens) << "request " << i;
    EXPECT_EQ(r.prompt_tokens, static_cast<int64_t>(offline[i].prompt.size()));
    EXPECT_EQ(obs[i]->streamed, kN);  // every token streamed, in decoding steps only
    EXPECT_EQ(obs[i]->events, r.stats.counters.nfe);
    shared += r.stats.prefill_forwards == 0 ? 1 : 0;
    if (i % 8 == 0) {
      EXPECT_GT(r.image.pixels.size(), 0u);
    }
  }
  std::printf("24 prompted requests served; %lld copied a running request's prefill\n",
              static_cast<long long>(shared));
  EXPECT_GT(shared, 0);

  // Fields: a class for a prompted model, no prompt, a prompt too long, an id out of range.
  GenerateParams bad;
  bad.class_id = 0;
  EXPECT_EQ(engine.Submit(bad, std::make_shared<Collect>()).status().field(), "class_id");
  bad.class_id.reset();
  EXPECT_EQ(engine.Submit(bad, std::make_shared<Collect>()).status().field(), "prompt");
  bad.prompt_token_ids.assign(9, 1);
  EXPECT_EQ(engine.Submit(bad, std::make_shared<Collect>()).status().field(), "prompt");
  bad.prompt_token_ids = {1, 9};
  EXPECT_EQ(engine.Submit(bad, std::make_shared<Collect>()).status().field(), "prompt_token_ids");
  engine.Shutdown(std::chrono::milliseconds(0));
}

// A prompted model through the static-shape forward (EngineOptions::cuda_graphs, the CUDA
// default; on the CPU the same forward runs without graphs): prefill chunks and image windows
// padded to their buckets draw the offline images, up to rounding (the two forwards differ
// there, so a uniform within it of a token boundary may draw another token: at most one of the
// 12 images).
TEST(EnginePromptTest, StaticShapesServeThePromptedImages) {
  PromptToy& toy = TheToy();
  EngineOptions o;
  o.models_dir = toy.dir;
  o.models = {"toy-t2i"};
  o.window_policy = "full";
  o.prefill_tokens_per_step = 3;  // prompts of up to 8 ids in chunks, beside decoding windows
  o.cuda_graphs = 1;
  auto started = Engine::Start(o);
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  Engine& engine = **started;
  std::vector<std::shared_ptr<Collect>> obs;
  const std::vector<ImageRequest> offline =
      SubmitToyPrompts(engine, toy, 12, /*seed0=*/900, /*per_method=*/1, /*decode_every=*/0, &obs);
  ASSERT_EQ(obs.size(), offline.size());
  auto expect = OfflineImages(toy, offline);
  ASSERT_TRUE(expect.ok()) << expect.status().ToString();
  int same = 0;
  for (size_t i = 0; i < obs.size(); ++i) {
    obs[i]->Wait();
    ASSERT_TRUE(obs[i]->error.ok()) << obs[i]->error.ToString();
    EXPECT_EQ(obs[i]->result.tokens.size(), (*expect)[i].tokens.size());
    same += obs[i]->result.tokens == (*expect)[i].tokens ? 1 : 0;
  }
  std::printf("static shapes: %d of %zu prompted images identical to the offline ones\n", same,
              obs.size());
  EXPECT_GE(same, 11);
  engine.Shutdown(std::chrono::milliseconds(0));
}

// A group (a client's n images) is queued at once and admitted in order: the first image
// prefills, the others copy its prefill, and each image is the one its seed draws alone. Bad
// groups and negative prompts are refused naming the field.
TEST(EnginePromptTest, GroupsShareOnePrefillAndBadNegativePromptsNameTheField) {
  PromptToy& toy = TheToy();
  EngineOptions o;
  o.models_dir = toy.dir;
  o.models = {"toy-t2i"};
  o.window_policy = "full";
  o.prefill_tokens_per_step = 2;
  o.max_queue = 6;
  auto started = Engine::Start(o);
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  Engine& engine = **started;
  std::vector<GenerateParams> group;
  std::vector<std::shared_ptr<RequestObserver>> obs;
  std::vector<ImageRequest> offline;
  for (int64_t i = 0; i < 4; ++i) {
    GenerateParams p;
    p.prompt_token_ids = toy.prompts[2];
    p.negative_prompt_token_ids = {1, 6, 3};
    p.seed = static_cast<uint64_t>(900 + i);
    p.policy = Preset("scd-mc", 6);
    group.push_back(p);
    obs.push_back(std::make_shared<Collect>());
    ImageRequest r = toy.Request(2);
    r.negative_prompt = p.negative_prompt_token_ids;
    r.seed = *p.seed;
    r.policy = p.policy;
    offline.push_back(r);
  }
  auto ids = engine.SubmitGroup(group, obs);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  ASSERT_EQ(ids->size(), 4u);
  SpecOptions so;
  so.batch_invariant = true;
  std::vector<SpecResult> expect;
  for (const ImageRequest& r : offline) {  // each alone
    auto one = GenerateSpeculative(*toy.target, toy.draft.get(), {r}, so);
    ASSERT_TRUE(one.ok()) << one.status().ToString();
    expect.push_back((*one)[0]);
  }
  int64_t prefilled = 0;
  for (size_t i = 0; i < obs.size(); ++i) {
    auto* c = static_cast<Collect*>(obs[i].get());
    c->Wait();
    ASSERT_TRUE(c->error.ok()) << c->error.ToString();
    EXPECT_EQ(c->result.request_id, (*ids)[i]);
    EXPECT_EQ(c->result.seed, 900 + i);
    EXPECT_EQ(c->result.tokens, expect[i].tokens) << "image " << i;
    prefilled += c->result.stats.prefill_forwards > 0 ? 1 : 0;
  }
  EXPECT_EQ(prefilled, 1) << "the group's images copy the first one's prefill";
  EXPECT_NE(expect[0].tokens, expect[1].tokens);

  auto field = [&](const GenerateParams& p, size_t n = 1) {
    std::vector<GenerateParams> g(n, p);
    std::vector<std::shared_ptr<RequestObserver>> os;
    for (size_t i = 0; i < n; ++i) os.push_back(std::make_shared<Collect>());
    auto r = engine.SubmitGroup(g, os);
    return r.ok() ? std::string("ok") : r.status().field();
  };
  GenerateParams p = group[0];
  EXPECT_EQ(field(p, 7), "n");  // larger than the queue of 6 could ever hold
  p.cfg_scale = 1.0;            // no guidance: a negative prompt would do nothing
  EXPECT_EQ(field(p), "negative_prompt");
  p.cfg_scale.reset();
  p.negative_prompt_token_ids.assign(9, 1);  // max_prompt_len 8
  EXPECT_EQ(field(p), "negative_prompt");
  p.negative_prompt_token_ids = {1, 8};  // text ids in [0, 8)
  EXPECT_EQ(field(p), "negative_prompt_token_ids");
  engine.Shutdown(std::chrono::milliseconds(0));
}

TEST(PromptTest, BadPromptsNameTheField) {
  PromptToy& toy = TheToy();
  ImageRequest r = toy.Request(0);
  r.policy = Preset("sjd", 4);
  EXPECT_TRUE(ValidateImageRequest(r, *toy.target, toy.draft.get()).ok());
  r.prompt.clear();
  EXPECT_EQ(ValidateImageRequest(r, *toy.target, nullptr).field(), "prompt");
  r.prompt.assign(9, 1);  // max_prompt_len 8
  EXPECT_EQ(ValidateImageRequest(r, *toy.target, nullptr).field(), "prompt");
  r.prompt = {1, 8};  // text ids in [0, 8)
  EXPECT_EQ(ValidateImageRequest(r, *toy.target, nullptr).field(), "prompt_token_ids");
  SpecBatch batch(*toy.target, nullptr, 8);
  auto a = batch.Add(toy.Request(0));
  ASSERT_TRUE(a.ok());
  auto b = batch.Add(toy.Request(1), *a);  // a different prompt cannot share a's prefill
  EXPECT_EQ(b.status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace imagegen
