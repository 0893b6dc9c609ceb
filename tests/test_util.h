// Helpers shared by the engine tests: temporary directories and small random models written
// in the on-disk format (config.json + model.safetensors) so that loading is tested too.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <torch/cuda.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/gpt.h"
#include "engine/model/safetensors.h"
#include "engine/scheduler/engine.h"
#include "tests/temp_dir.h"
#include "tests/build_paths.h"

namespace imagegen::testing {

// LibTorch's intra-op threads set for a scope and put back at its end, also when an ASSERT
// returns early: at::set_num_threads is process-wide (threads started later take it, the
// engines' too), and ctest runs each test alone but the sanitizer shards run many in one process.
class ScopedIntraOpThreads {
 public:
  explicit ScopedIntraOpThreads(int threads) : before_(at::get_num_threads()) {
    at::set_num_threads(threads);
  }
  ~ScopedIntraOpThreads() { at::set_num_threads(before_); }
  ScopedIntraOpThreads(const ScopedIntraOpThreads&) = delete;
  ScopedIntraOpThreads& operator=(const ScopedIntraOpThreads&) = delete;

 private:
  const int before_;
};

// The device the device-aware tests run their models on: the CPU, or the first CUDA device
// when IMAGEGEN_TEST_DEVICE=cuda and one is present (bench/gpu/run_all.sh sets it).
inline LoadOptions TestLoadOptions() {
  LoadOptions o;
  const char* d = std::getenv("IMAGEGEN_TEST_DEVICE");
  if (d != nullptr && std::string(d) == "cuda" && torch::cuda::is_available()) {
    o.device = c10::Device(c10::kCUDA, 0);
  }
  return o;
}

// Request r of a class-conditional model as the forward's rows: a conditional and an
// unconditional row (slots 2r and 2r + 1, group r) with the class token (class r mod the
// classes, or the null class) and n image tokens (ids that differ by request and position).
inline std::vector<BatchRow> CfgRequestRows(const GptConfig& cfg, int64_t r, int64_t n) {
  std::vector<BatchRow> rows;
  for (int64_t u = 0; u < 2; ++u) {
    BatchRow b;
    b.slot = 2 * r + u;
    b.group = r;
    for (int64_t i = 0; i <= n; ++i) {
      b.tokens.push_back(i == 0 ? (u == 0 ? r % cfg.num_classes : cfg.null_class())
                                : (r * 37 + i * 11) % cfg.vocab_size);
      b.positions.push_back(i);
    }
    rows.push_back(std::move(b));
  }
  return rows;
}

inline void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

struct TinyGptSpec {
  int64_t dim = 32, n_layer = 2, n_head = 4, vocab = 24, classes = 3, grid = 4;
};

// `extra`: more JSON members, starting with ", ".
inline std::string TinyGptConfigJson(const TinyGptSpec& s, const std::string& extra = "") {
  return "{\"type\": \"llamagen-gpt\", \"dim\": " + std::to_string(s.dim) +
         ", \"n_layer\": " + std::to_string(s.n_layer) +
         ", \"n_head\": " + std::to_string(s.n_head) +
         ", \"vocab_size\": " + std::to_string(s.vocab) +
         ", \"num_classes\": " + std::to_string(s.classes) +
         ", \"block_size\": " + std::to_string(s.grid * s.grid) +
         ", \"multiple_of\": 16, \"class_dropout_prob\": 0.1" + extra + "}";
}

// The transformer layers of a tiny random model (LlamaGen names, std 0.3, norms 1 + 0.1 noise),
// drawn from LibTorch's global generator in a fixed order.
inline void AddTinyLayers(std::map<std::string, at::Tensor>& t, int64_t n_layer, int64_t d,
                          int64_t h) {
  auto rnd = [](std::vector<int64_t> shape, double std) { return at::randn(shape) * std; };
  for (int64_t l = 0; l < n_layer; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    t[p + "attention_norm.weight"] = 1 + rnd({d}, 0.1);
    t[p + "attention.wqkv.weight"] = rnd({3 * d, d}, 0.3);
    t[p + "attention.wo.weight"] = rnd({d, d}, 0.3);
    t[p + "ffn_norm.weight"] = 1 + rnd({d}, 0.1);
    t[p + "feed_forward.w1.weight"] = rnd({h, d}, 0.3);
    t[p + "feed_forward.w2.weight"] = rnd({d, h}, 0.3);
    t[p + "feed_forward.w3.weight"] = rnd({h, d}, 0.3);
  }
}

// Random LlamaGen tensors (std 0.3 so that attention and RoPE matter), by LlamaGen name.
inline std::map<std::string, at::Tensor> TinyGptTensors(const TinyGptSpec& s, uint64_t seed) {
  at::manual_seed(seed);
  GptConfig c;
  c.dim = s.dim;
  c.multiple_of = 16;
  const int64_t h = c.ffn_hidden(), d = s.dim;
  std::map<std::string, at::Tensor> t;
  auto rnd = [](std::vector<int64_t> shape, double std) { return at::randn(shape) * std; };
  t["tok_embeddings.weight"] = rnd({s.vocab, d}, 1.0);
  t["cls_embedding.embedding_table.weight"] = rnd({s.classes + 1, d}, 1.0);
  AddTinyLayers(t, s.n_layer, d, h);
  t["norm.weight"] = 1 + rnd({d}, 0.1);
  t["output.weight"] = rnd({s.vocab, d}, 0.3);
  return t;
}

inline std::string WriteTinyGpt(const std::string& dir, const TinyGptSpec& s, uint64_t seed,
                                const std::string& extra_config = "") {
  std::filesystem::create_directories(dir);
  WriteText(dir + "/config.json", TinyGptConfigJson(s, extra_config));
  auto st = WriteSafetensors(dir + "/model.safetensors", TinyGptTensors(s, seed));
  if (!st.ok()) throw std::runtime_error(st.ToString());
  return dir;
}

// A tiny Janus-layout (prompted) model, as tools/convert_janus.py writes one: text ids
// [0, text_vocab), image ids [0, vocab) on a grid x grid token grid, pad id 0. Random weights
// (std 0.3, embeddings 1) so that the prompt, attention and RoPE matter.
struct TinyJanusSpec {
  int64_t dim = 16, n_layer = 2, n_head = 2, ffn = 32, vocab = 3, grid = 3, text_vocab = 8;
  int64_t max_prompt = 8, embed = 4, head = 16;
};

inline std::string WriteTinyJanus(const std::string& dir, const TinyJanusSpec& s, uint64_t seed,
                                  const std::string& extra_config = "") {
  at::manual_seed(seed);
  const int64_t d = s.dim, h = s.ffn;
  std::map<std::string, at::Tensor> t;
  auto rnd = [](std::vector<int64_t> shape, double std) { return at::randn(shape) * std; };
  t["tok_embeddings.weight"] = rnd({s.text_vocab, d}, 1.0);
  t["gen_embed.weight"] = rnd({s.vocab, s.embed}, 1.0);
  t["gen_aligner.layers.0.weight"] = rnd({d, s.embed}, 0.5);
  t["gen_aligner.layers.0.bias"] = rnd({d}, 0.1);
  t["gen_aligner.layers.2.weight"] = rnd({d, d}, 0.5);
  t["gen_aligner.layers.2.bias"] = rnd({d}, 0.1);
  AddTinyLayers(t, s.n_layer, d, h);
  t["norm.weight"] = 1 + rnd({d}, 0.1);
  t["gen_head.output_mlp_projector.weight"] = rnd({s.head, d}, 0.5);
  t["gen_head.output_mlp_projector.bias"] = rnd({s.head}, 0.1);
  t["gen_head.vision_head.weight"] = rnd({s.vocab, s.head}, 0.5);
  t["gen_head.vision_head.bias"] = rnd({s.vocab}, 0.1);
  std::filesystem::create_directories(dir);
  auto n = [](int64_t v) { return std::to_string(v); };
  WriteText(dir + "/config.json",
            "{\"type\": \"janus-gen\", \"dim\": " + n(d) + ", \"n_layer\": " + n(s.n_layer) +
                ", \"n_head\": " + n(s.n_head) + ", \"intermediate_size\": " + n(h) +
                ", \"text_vocab_size\": " + n(s.text_vocab) + ", \"vocab_size\": " + n(s.vocab) +
                ", \"block_size\": " + n(s.grid * s.grid) +
                ", \"max_prompt_len\": " + n(s.max_prompt) + ", \"gen_embed_dim\": " + n(s.embed) +
                ", \"head_hidden\": " + n(s.head) + ", \"pad_id\": 0" + extra_config + "}");
  auto st = WriteSafetensors(dir + "/model.safetensors", t);
  if (!st.ok()) throw std::runtime_error(st.ToString());
  return dir;
}

// A VQ tokenizer for `vocab` codes on a grid x grid token grid: the bundled fmnist-vq decoder
// (fully convolutional, so any grid works) with its first `vocab` codebook rows.
inline void WriteTinyVq(const std::string& dir, int64_t vocab, int64_t grid) {
  const std::string src = std::string(imagegen::testing::TestModelsDir()) + "/fmnist-vq";
  auto f = SafetensorsFile::Open(src + "/model.safetensors");
  if (!f.ok()) throw std::runtime_error(f.status().ToString());
  std::map<std::string, at::Tensor> t;
  for (const auto& [name, info] : (*f)->tensors()) t[name] = *(*f)->Read(name);
  t["quantize.embedding.weight"] = t["quantize.embedding.weight"].narrow(0, 0, vocab).clone();
  std::filesystem::create_directories(dir);
  WriteText(dir + "/config.json",
            "{\"type\": \"llamagen-vq\", \"codebook_size\": " + std::to_string(vocab) +
                ", \"codebook_embed_dim\": 8, \"z_channels\": 32, \"ch\": 16, \"ch_mult\": [1, 2], "
                "\"num_res_blocks\": 1, \"out_channels\": 1, \"num_groups\": 8, \"image_size\": " +
                std::to_string(2 * grid) + "}");
  auto st = WriteSafetensors(dir + "/model.safetensors", t);
  if (!st.ok()) throw std::runtime_error(st.ToString());
}

inline bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Starts an engine with `o` (cache_dir set), stops it, and returns the path and text of the one
// step-cost file it kept there; a test failure (and empty strings) where there is not exactly
// one. Other files beside it (the few-row kernel's rows) are not counted.
inline std::pair<std::string, std::string> StepCostFileAfterAStart(const EngineOptions& o) {
  auto engine = Engine::Start(o);
  if (!engine.ok()) {
    ADD_FAILURE() << engine.status().message();
    return {};
  }
  engine->reset();
  const std::vector<std::string> files = FilesStartingWith(o.cache_dir, "step-cost-");
  if (files.size() != 1) {
    ADD_FAILURE() << files.size() << " step-cost files in " << o.cache_dir;
    return {};
  }
  std::ifstream in(files[0]);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return {files[0], text};
}

}  // namespace imagegen::testing
