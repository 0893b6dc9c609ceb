#include "engine/model/gpt.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

// The complete Json type: ReadModelConfig returns one by value (json.h only declares it).
#include <nlohmann/json.hpp>

#include "engine/decoding/fused_kernels.h"
#include "engine/decoding/sampling_params.h"
#include "engine/model/cuda_graphs.h"
#include "engine/model/cuda_stream.h"
#include "engine/model/device.h"
#include "engine/model/norm_rope.h"
#include "engine/model/row_attention.h"
#include "engine/model/transfer.h"

namespace imagegen {
namespace {

int64_t RoundUp(int64_t n, int64_t k) { return n % k == 0 ? n : n + k - n % k; }

// The interleaved rotary embedding as LlamaGen writes it: the pairs as complex numbers times the
// table's (cos, sin), one complex multiply in fp32 (three kernels in bf16, one in fp32, against
// RopeOps's ten).
// x may be a strided view (of the qkv projection).
at::Tensor ApplyRopeComplex(const at::Tensor& x, const at::Tensor& table) {
  const int64_t t = x.size(0), h = x.size(1), hd = x.size(2);
  at::Tensor xc = at::view_as_complex(x.to(at::kFloat).reshape({t, h, hd / 2, 2}));
  at::Tensor out = at::view_as_real(xc * at::view_as_complex(table).unsqueeze(1));
  return out.reshape({t, h, hd}).to(x.scalar_type());
}

// x w^T: amx's bf16 products where it is prepared (batch-invariant at any row count); else
// small's kernel where it takes every row count (LoadOptions::engine_linear: batch-invariant by
// construction); else batch-invariant: small's kernel up to its max_rows (it rounds as the BLAS
// does on 16 or more rows), and never the BLAS on fewer than kInvariantMinRows rows (the rows
// padded to that many).
at::Tensor Linear(const at::Tensor& x, const at::Tensor& w, bool invariant,
                  const SmallRowsLinear& small, const AmxBf16Linear& amx) {
  if (amx.ok()) return amx(x);
  const int64_t m = x.size(0);
  if (small.every_row() || (invariant && small.ok() && m <= small.max_rows())) return small(x);
  if (!invariant || m >= kInvariantMinRows) return at::linear(x, w);
  at::Tensor xp = at::zeros({kInvariantMinRows, x.size(1)}, x.options());
  xp.narrow(0, 0, m).copy_(x);
  return at::linear(xp, w).narrow(0, 0, m);
}

// allow[r, i, j] [R, W, K]: query i of row r may attend cache entry j. A real query attends the
// committed prefix (j < cache_len) and, among the new tokens (jj = j - cache_len in [0, n)),
// those its mask allows (causal: jj <= i). A padding query (i >= n) attends entry 0 only, so
// that its softmax stays finite; its output is dropped. meta [3, R, 1, 1]: cache_len, n, has its
// own mask; pairs: the flat indices (r * W + i) * W + j of the allowed pairs of those masks (with
// `dummy`, padding pairs point at one element past the mask).
at::Tensor AllowMask(const at::Tensor& meta, const at::Tensor& pairs, bool custom, int64_t R,
                     int64_t W, int64_t K, at::Device dev, bool dummy = false) {
  const auto lopt = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor cl = meta[0], nr = meta[1], own = meta[2] > 0;  // [R, 1, 1]
  at::Tensor qi = at::arange(W, lopt).view({1, W, 1});
  at::Tensor kj = at::arange(K, lopt).view({1, 1, K});
  at::Tensor jj = kj - cl;  // [R, 1, K]
  at::Tensor fresh = (jj >= 0) & (jj < nr);
  at::Tensor lower = jj <= qi;  // [R, W, K]
  if (custom) {
    at::Tensor local =
        at::zeros({R * W * W + (dummy ? 1 : 0)}, lopt.dtype(at::kBool)).index_fill_(0, pairs, true);
    if (dummy) local = local.narrow(0, 0, R * W * W);
    at::Tensor from_mask = local.view({R, W, W}).gather(2, jj.clamp(0, W - 1).expand({R, W, K}));
    lower = at::where(own, from_mask, lower);
  }
  at::Tensor real = qi < nr;
  return (real & ((kj < cl) | (fresh & lower))) | (~real & (kj == 0));
}

}  // namespace

bool StaticBoolMask() {
  const char* e = std::getenv("IMAGEGEN_SDPA_BOOL_MASK");
  return e != nullptr && std::string(e) == "1";
}

int64_t GptConfig::ffn_hidden() const {
  if (intermediate_size > 0) return intermediate_size;
  int64_t hidden = static_cast<int64_t>(2.0 * 4 * dim / 3);
  if (ffn_dim_multiplier > 0) hidden = static_cast<int64_t>(ffn_dim_multiplier * hidden);
  return RoundUp(hidden, multiple_of);
}

int64_t GptConfig::grid() const {
  auto g = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(block_size))));
  return g;
}

namespace {

// The sampling defaults every request that sets no sampling field gets: checked at load, so that
// a bad file is reported against the file and not against requests that never set the field.
Status CheckSamplingDefaults(const GptConfig& c, const std::string& where) {
  const SamplingParams defaults{c.default_cfg_scale, c.default_temperature, c.default_top_k,
                                c.default_top_p};
  if (Status s = ValidateSampling(defaults, c.vocab_size); !s.ok()) {
    std::string text = s.message();
    if (text.rfind(s.field() + ": ", 0) == 0) text = text.substr(s.field().size() + 2);
    return FailedPrecondition(where + ": 'sampling_defaults." + s.field() + "' " + text);
  }
  if (defaults.uses_cfg() && !c.prompted() && !c.has_null_class()) {
    return FailedPrecondition(
        where + ": 'sampling_defaults.cfg_scale' > 1 needs a null class (class_dropout_prob > 0)");
  }
  // A prompted model's unconditional prompt is padding: without a pad_id every request that
  // keeps the default guidance would fail, naming a cfg_scale its client never sent.
  if (defaults.uses_cfg() && c.prompted() && c.pad_id < 0) {
    return FailedPrecondition(where + ": 'sampling_defaults.cfg_scale' > 1 needs 'pad_id' (the " +
                              "unconditional prompt's padding)");
  }
  return OkStatus();
}

Status ParseSamplingDefaults(JsonFields& f, GptConfig& c, const std::string& where) {
  if (const Json* d = f.Find("sampling_defaults"); d != nullptr) {
    JsonFields sd(*d, where + ": sampling_defaults");
    ASSIGN_OR_RETURN(c.default_cfg_scale, sd.Number("cfg_scale", c.default_cfg_scale));
    ASSIGN_OR_RETURN(c.default_temperature, sd.Number("temperature", 1.0));
    ASSIGN_OR_RETURN(c.default_top_k, sd.Int("top_k", 0));
    ASSIGN_OR_RETURN(c.default_top_p, sd.Number("top_p", 1.0));
  }
  return OkStatus();
}

// config.json of "type": "janus-gen" (written by tools/convert_janus.py).
StatusOr<GptConfig> ParseJanusConfig(JsonFields& f, const std::string& where) {
  GptConfig c;
  c.arch = GptArch::kJanus;
  c.num_classes = 0;
  c.cls_token_num = 0;
  c.class_dropout_prob = 0;
  c.default_cfg_scale = 5.0;  // Janus's generation_inference.py: cfg_weight 5, temperature 1
  ASSIGN_OR_RETURN(c.dim, f.Int("dim"));
  ASSIGN_OR_RETURN(c.n_layer, f.Int("n_layer"));
  ASSIGN_OR_RETURN(c.n_head, f.Int("n_head"));
  ASSIGN_OR_RETURN(c.intermediate_size, f.Int("intermediate_size"));
  ASSIGN_OR_RETURN(c.text_vocab_size, f.Int("text_vocab_size"));
  ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size"));
  ASSIGN_OR_RETURN(c.block_size, f.Int("block_size"));
  ASSIGN_OR_RETURN(c.max_prompt_len, f.Int("max_prompt_len"));
  ASSIGN_OR_RETURN(c.gen_embed_dim, f.Int("gen_embed_dim"));
  ASSIGN_OR_RETURN(c.head_hidden, f.Int("head_hidden"));
  ASSIGN_OR_RETURN(c.rope_base, f.Number("rope_base", 10000));
  ASSIGN_OR_RETURN(c.norm_eps, f.Number("norm_eps", 1e-6));
  ASSIGN_OR_RETURN(c.pad_id, f.Int("pad_id", -1));
  ASSIGN_OR_RETURN(c.prompt_template, f.String("prompt_template", "{prompt}"));
  ASSIGN_OR_RETURN(c.text_tokenizer, f.String("text_tokenizer", ""));
  ASSIGN_OR_RETURN(c.tokenizer, f.String("tokenizer", ""));
  ASSIGN_OR_RETURN(c.draft_model, f.String("draft_model", ""));
  RETURN_IF_ERROR(ParseSamplingDefaults(f, c, where));
  ASSIGN_OR_RETURN(int64_t n_kv_head, f.Int("n_kv_head", c.n_head));
  auto bad = [&](const std::string& what) { return FailedPrecondition(where + ": " + what); };
  if (c.dim <= 0 || c.n_layer <= 0 || c.n_head <= 0 || c.intermediate_size <= 0 ||
      c.text_vocab_size <= 0 || c.vocab_size <= 0 || c.block_size <= 0 || c.max_prompt_len <= 0 ||
      c.gen_embed_dim <= 0 || c.head_hidden <= 0) {
    return bad(
        "dim, n_layer, n_head, intermediate_size, text_vocab_size, vocab_size, block_size, "
        "max_prompt_len, gen_embed_dim and head_hidden must be positive");
  }
  if (n_kv_head != c.n_head) return bad("'n_kv_head' != 'n_head' (GQA) is not supported");
  if (c.dim > 65536 || c.n_layer > 1024 || c.n_head > 1024 || c.intermediate_size > (1 << 20) ||
      c.text_vocab_size > (1 << 22) || c.vocab_size > (1 << 22) || c.block_size > 128 * 128 ||
      c.max_prompt_len > 65536 || c.gen_embed_dim > 65536 || c.head_hidden > (1 << 20)) {
    return bad(
        "model sizes out of range (dim, max_prompt_len, gen_embed_dim <= 65536, n_layer/n_head "
        "<= 1024, intermediate_size and head_hidden <= 1048576, vocabularies <= 4194304, "
        "block_size <= 16384)");
  }
  if (!(c.rope_base > 1) || c.rope_base > 1e12 || !(c.norm_eps >= 0) || c.norm_eps > 1) {
    return bad("rope_base in (1, 1e12] and norm_eps in [0, 1] are required");
  }
  if (c.dim % c.n_head != 0 || c.head_dim() % 2 != 0) {
    return bad("'dim' / 'n_head' must be even (rotate-half RoPE)");
  }
  if (c.grid() * c.grid() != c.block_size) return bad("'block_size' must be a square (grid^2)");
  if (c.pad_id < -1 || c.pad_id >= c.text_vocab_size) {
    return bad("'pad_id' must be -1 (none) or a text token id in [0, text_vocab_size)");
  }
  if (c.prompt_template.find("{prompt}") == std::string::npos) {
    return bad("'prompt_template' must contain \"{prompt}\"");
  }
  RETURN_IF_ERROR(CheckSamplingDefaults(c, where));
  return c;
}

}  // namespace

StatusOr<GptConfig> ParseGptConfig(const Json& json, const std::string& where) {
  JsonFields f(json, where);
  GptConfig c;
  ASSIGN_OR_RETURN(std::string type, f.String("type", "llamagen-gpt"));
  if (type == "janus-gen") return ParseJanusConfig(f, where);
  if (type != "llamagen-gpt") {
    return FailedPrecondition(where + ": 'type' is \"" + type +
                              "\", expected \"llamagen-gpt\" or \"janus-gen\"");
  }
  ASSIGN_OR_RETURN(c.dim, f.Int("dim"));
  ASSIGN_OR_RETURN(c.n_layer, f.Int("n_layer"));
  ASSIGN_OR_RETURN(c.n_head, f.Int("n_head"));
  ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size"));
  ASSIGN_OR_RETURN(c.num_classes, f.Int("num_classes"));
  ASSIGN_OR_RETURN(c.block_size, f.Int("block_size"));
  ASSIGN_OR_RETURN(c.cls_token_num, f.Int("cls_token_num", 1));
  ASSIGN_OR_RETURN(c.multiple_of, f.Int("multiple_of", 256));
  ASSIGN_OR_RETURN(c.ffn_dim_multiplier, f.Number("ffn_dim_multiplier", 0));
  ASSIGN_OR_RETURN(c.rope_base, f.Number("rope_base", 10000));
  ASSIGN_OR_RETURN(c.norm_eps, f.Number("norm_eps", 1e-5));
  ASSIGN_OR_RETURN(c.class_dropout_prob, f.Number("class_dropout_prob", 0.1));
  ASSIGN_OR_RETURN(c.tokenizer, f.String("tokenizer", ""));
  ASSIGN_OR_RETURN(c.draft_model, f.String("draft_model", ""));
  if (f.Find("class_names") != nullptr) {
    ASSIGN_OR_RETURN(c.class_names, f.StringList("class_names"));
  }
  RETURN_IF_ERROR(ParseSamplingDefaults(f, c, where));
  ASSIGN_OR_RETURN(int64_t n_kv_head, f.Int("n_kv_head", c.n_head));
  auto bad = [&](const std::string& what) { return FailedPrecondition(where + ": " + what); };
  if (c.dim <= 0 || c.n_layer <= 0 || c.n_head <= 0 || c.vocab_size <= 0 || c.num_classes <= 0 ||
      c.block_size <= 0 || c.cls_token_num != 1 || c.multiple_of <= 0) {
    return bad(
        "dim, n_layer, n_head, vocab_size, num_classes, block_size, multiple_of must be "
        "positive and cls_token_num must be 1 (class-conditional models)");
  }
  if (n_kv_head != c.n_head) return bad("'n_kv_head' != 'n_head' (GQA) is not supported");
  // Bounds that keep a corrupt config from asking for absurd allocations.
  if (c.dim > 65536 || c.n_layer > 1024 || c.n_head > 1024 || c.vocab_size > (1 << 22) ||
      c.num_classes > (1 << 22) || c.block_size > 128 * 128 || c.multiple_of > 65536) {
    return bad(
        "model sizes out of range (dim <= 65536, n_layer/n_head <= 1024, vocab_size "
        "and num_classes <= 4194304, block_size <= 16384)");
  }
  if (c.ffn_dim_multiplier < 0 || c.ffn_dim_multiplier > 64 || !(c.rope_base > 1) ||
      c.rope_base > 1e12 || !(c.norm_eps >= 0) || c.norm_eps > 1 || !(c.class_dropout_prob >= 0) ||
      c.class_dropout_prob >= 1) {
    return bad(
        "ffn_dim_multiplier in [0, 64], rope_base in (1, 1e12], norm_eps in [0, 1] and "
        "class_dropout_prob in [0, 1) are required");
  }
  if (c.dim % c.n_head != 0 || c.head_dim() % 4 != 0) {
    return bad("'dim' / 'n_head' must be a multiple of 4 (2D RoPE)");
  }
  if (c.grid() * c.grid() != c.block_size) return bad("'block_size' must be a square (grid^2)");
  if (!c.class_names.empty() && static_cast<int64_t>(c.class_names.size()) != c.num_classes) {
    return bad("'class_names' has " + std::to_string(c.class_names.size()) +
               " entries but 'num_classes' is " + std::to_string(c.num_classes));
  }
  RETURN_IF_ERROR(CheckSamplingDefaults(c, where));
  return c;
}

at::Tensor RopeTable2d(int64_t grid, int64_t head_dim, double base, int64_t cls_token_num) {
  // float32 throughout, op for op as LlamaGen's precompute_freqs_cis_2d, so converted official
  // checkpoints see the same table.
  const int64_t half = head_dim / 2;
  at::Tensor freqs =
      1.0 / at::pow(base, at::arange(0, half, 2, at::kLong).narrow(0, 0, half / 2).to(at::kFloat) /
                              static_cast<double>(half));
  at::Tensor ang = at::outer(at::arange(grid, at::kFloat), freqs);  // [g, half/2]
  at::Tensor grid_ang = at::cat({ang.unsqueeze(1).expand({grid, grid, half / 2}),
                                 ang.unsqueeze(0).expand({grid, grid, half / 2})},
                                -1);  // [g, g, half]: row angles then column angles
  at::Tensor table =
      at::stack({at::cos(grid_ang), at::sin(grid_ang)}, -1).reshape({grid * grid, half, 2});
  return at::cat({at::zeros({cls_token_num, half, 2}, at::kFloat), table}, 0);
}

at::Tensor RopeTable1d(int64_t len, int64_t head_dim, double base) {
  // As transformers' LlamaRotaryEmbedding (rope_type "default") computes it, in float32.
  at::Tensor inv_freq = 1.0 / at::pow(base, at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) /
                                                static_cast<double>(head_dim));
  at::Tensor ang = at::outer(at::arange(len, at::kLong).to(at::kFloat), inv_freq);
  return at::stack({at::cos(ang), at::sin(ang)}, -1).contiguous();  // [len, hd/2, 2]
}

StatusOr<std::unique_ptr<Gpt>> Gpt::Load(const std::string& dir, const LoadOptions& opts) {
  ASSIGN_OR_RETURN(Json json, ReadModelConfig(dir));
  ASSIGN_OR_RETURN(GptConfig cfg, ParseGptConfig(json, dir + "/config.json"));
  ASSIGN_OR_RETURN(auto store, WeightStore::Open(dir));
  return FromStore(cfg, *store, opts);
}

StatusOr<std::unique_ptr<Gpt>> Gpt::FromStore(const GptConfig& cfg, WeightStore& store,
                                              const LoadOptions& opts) {
  try {
    return FromStoreImpl(cfg, store, opts);
  } catch (const c10::Error& e) {
    return ResourceExhausted(store.dir() + ": loading failed in LibTorch (out of memory?): " +
                             e.what_without_backtrace());
  }
}

StatusOr<std::unique_ptr<Gpt>> Gpt::FromStoreImpl(const GptConfig& cfg, WeightStore& store,
                                                  const LoadOptions& opts) {
  PrepareAttention(opts.device);
  std::unique_ptr<Gpt> m(new Gpt());
  m->cfg_ = cfg;
  m->opts_ = opts;
  const int64_t d = cfg.dim, h = cfg.ffn_hidden();
  if (cfg.prompted()) {
    // Image-token inputs are gen_aligner(gen_embed(id)): one fixed row per id, computed once
    // (in fp32) instead of per token. Text rows follow them, as class rows do for LlamaGen.
    const int64_t e = cfg.gen_embed_dim;
    ASSIGN_OR_RETURN(at::Tensor ge,
                     store.Take("gen_embed.weight", {cfg.vocab_size, e}, opts, true));
    ASSIGN_OR_RETURN(at::Tensor a0w, store.Take("gen_aligner.layers.0.weight", {d, e}, opts, true));
    ASSIGN_OR_RETURN(at::Tensor a0b, store.Take("gen_aligner.layers.0.bias", {d}, opts, true));
    ASSIGN_OR_RETURN(at::Tensor a2w, store.Take("gen_aligner.layers.2.weight", {d, d}, opts, true));
    ASSIGN_OR_RETURN(at::Tensor a2b, store.Take("gen_aligner.layers.2.bias", {d}, opts, true));
    at::Tensor image_rows = at::linear(at::gelu(at::linear(ge, a0w, a0b)), a2w, a2b);
    ASSIGN_OR_RETURN(at::Tensor text,
                     store.Take("tok_embeddings.weight", {cfg.text_vocab_size, d}, opts));
    m->embed_ = at::cat({image_rows.to(opts.dtype), text}, 0).contiguous();
    const int64_t hh = cfg.head_hidden;
    ASSIGN_OR_RETURN(m->head_w1_,
                     store.Take("gen_head.output_mlp_projector.weight", {hh, d}, opts));
    ASSIGN_OR_RETURN(m->head_b1_, store.Take("gen_head.output_mlp_projector.bias", {hh}, opts));
    ASSIGN_OR_RETURN(m->output_,
                     store.Take("gen_head.vision_head.weight", {cfg.vocab_size, hh}, opts));
    ASSIGN_OR_RETURN(m->head_b2_, store.Take("gen_head.vision_head.bias", {cfg.vocab_size}, opts));
  } else {
    const int64_t label_rows = cfg.condition_ids();
    ASSIGN_OR_RETURN(at::Tensor tok,
                     store.Take("tok_embeddings.weight", {cfg.vocab_size, d}, opts));
    ASSIGN_OR_RETURN(at::Tensor cls,
                     store.Take("cls_embedding.embedding_table.weight", {label_rows, d}, opts));
    m->embed_ = at::cat({tok, cls}, 0).contiguous();
  }
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    Layer L;
    ASSIGN_OR_RETURN(L.attention_norm, store.Take(p + "attention_norm.weight", {d}, opts));
    ASSIGN_OR_RETURN(L.wqkv, store.Take(p + "attention.wqkv.weight", {3 * d, d}, opts));
    ASSIGN_OR_RETURN(L.wo, store.Take(p + "attention.wo.weight", {d, d}, opts));
    ASSIGN_OR_RETURN(L.ffn_norm, store.Take(p + "ffn_norm.weight", {d}, opts));
    ASSIGN_OR_RETURN(L.w1, store.Take(p + "feed_forward.w1.weight", {h, d}, opts));
    ASSIGN_OR_RETURN(L.w2, store.Take(p + "feed_forward.w2.weight", {d, h}, opts));
    ASSIGN_OR_RETURN(L.w3, store.Take(p + "feed_forward.w3.weight", {h, d}, opts));
    m->layers_.push_back(std::move(L));
  }
  ASSIGN_OR_RETURN(m->norm_, store.Take("norm.weight", {d}, opts));
  if (!cfg.prompted()) {
    ASSIGN_OR_RETURN(m->output_, store.Take("output.weight", {cfg.vocab_size, d}, opts));
  }
  // freqs_cis is recomputed (models.md 1.4); KV caches are never weights.
  RETURN_IF_ERROR(store.Finish({"freqs_cis", "*.kv_cache."}));
  m->rope_ = m->RopeTable().to(opts.device);
  m->FuseMlpWeights();
  return m;
}

std::unique_ptr<Gpt> Gpt::Random(const GptConfig& cfg, const LoadOptions& opts, uint64_t seed) {
  PrepareAttention(opts.device);
  at::manual_seed(seed);
  const auto o = at::TensorOptions().dtype(opts.dtype).device(opts.device);
  auto w = [&](std::vector<int64_t> shape) { return (at::randn(shape, o) * 0.02).contiguous(); };
  const int64_t d = cfg.dim, h = cfg.ffn_hidden();
  const int64_t label_rows = cfg.condition_ids();
  std::unique_ptr<Gpt> m(new Gpt());
  m->cfg_ = cfg;
  m->opts_ = opts;
  m->embed_ = w({cfg.vocab_size + label_rows, d});
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    Layer L;
    L.attention_norm = at::ones({d}, o);
    L.wqkv = w({3 * d, d});
    L.wo = w({d, d});
    L.ffn_norm = at::ones({d}, o);
    L.w1 = w({h, d});
    L.w2 = w({d, h});
    L.w3 = w({h, d});
    m->layers_.push_back(std::move(L));
  }
  m->norm_ = at::ones({d}, o);
  if (cfg.prompted()) {
    m->head_w1_ = w({cfg.head_hidden, d});
    m->head_b1_ = w({cfg.head_hidden});
    m->output_ = w({cfg.vocab_size, cfg.head_hidden});
    m->head_b2_ = w({cfg.vocab_size});
  } else {
    m->output_ = w({cfg.vocab_size, d});
  }
  m->rope_ = m->RopeTable().to(opts.device);
  m->FuseMlpWeights();
  return m;
}

void Gpt::FuseMlpWeights() {
  fused_static_ = opts_.fused_static_forward.value_or(opts_.device.is_cuda());
  const at::ScalarType dt = embed_.scalar_type();
  row_attention_ = opts_.row_attention.value_or(true) && opts_.device.is_cpu() &&
                   embed_.scalar_type() == at::kFloat && RowAttentionTakes(cfg_.head_dim());
  const char* env = std::getenv("IMAGEGEN_ROPE_SCATTER");
  rope_scatter_ = opts_.rope_scatter.value_or(env != nullptr && std::string(env) == "1") &&
                  fused_static_ && !cfg_.prompted() && (dt == at::kFloat || dt == at::kBFloat16) &&
                  (opts_.device.is_cpu() || (opts_.device.is_cuda() && RopeScatterKernelBuilt()));
  const bool cpu_fp32 = opts_.device.is_cpu() && dt == at::kFloat;
  row_norm_ = {};
  rope_rows_ = false;
  if (opts_.fused_norm_rope.value_or(true) && cpu_fp32) {
    row_norm_ = RowNorm::Prepare(cfg_.dim, cfg_.norm_eps);
    rope_rows_ = RopeRowsMatch(2 * cfg_.n_head, cfg_.head_dim(), cfg_.prompted());
  }
  small_rows_ok_ = small_rows_total_ = amx_ok_ = amx_total_ = 0;
  small_rows_min_ = small_rows_max_ = 0;
  struct Kernels {
    SmallRowsLinear* small;
    AmxBf16Linear* amx;
    const at::Tensor* w;
  };
  std::vector<Kernels> linears;
  for (Layer& L : layers_) {
    linears.insert(linears.end(), {{&L.small_wqkv, &L.amx_wqkv, &L.wqkv},
                                   {&L.small_wo, &L.amx_wo, &L.wo},
                                   {&L.small_w1, &L.amx_w1, &L.w1},
                                   {&L.small_w2, &L.amx_w2, &L.w2},
                                   {&L.small_w3, &L.amx_w3, &L.w3}});
  }
  linears.push_back({&small_output_, &amx_output_, &output_});
  if (head_w1_.defined()) linears.push_back({&small_head_w1_, &amx_head_w1_, &head_w1_});
  int64_t linear_bytes = 0;
  for (const Kernels& k : linears) linear_bytes += static_cast<int64_t>(k.w->nbytes());
  linear_bytes_ = linear_bytes;
  // The eager forward's products (the fused layer of a static forward keeps its GEMMs).
  if (opts_.bf16_matmul && cpu_fp32) {
    for (const Kernels& k : linears) {
      *k.amx = AmxBf16Linear::Prepare(*k.w);
      amx_ok_ += k.amx->ok() ? 1 : 0;
      ++amx_total_;
    }
  }
  const bool all_amx = amx_total_ > 0 && amx_ok_ == amx_total_;  // no few-row products left
  // The engine's kernel on every row count of the eager forward (the static forward's fused
  // layer keeps its GEMMs): any model size (the user chose the second copy).
  const bool every_row = opts_.engine_linear;
  const bool kernel_wanted =
      opts_.small_rows_gemm.value_or(true) && cpu_fp32 && !all_amx && SmallRowsLinear::Supported();
  small_rows_over_size_ = kernel_wanted && !every_row && linear_bytes > kSmallGemmMaxWeightBytes;
  if (kernel_wanted && !small_rows_over_size_) {
    for (const Kernels& k : linears) {
      *k.small = every_row ? SmallRowsLinear::EveryRow(*k.w)
                           : SmallRowsLinear::Prepare(*k.w, opts_.small_rows_gemm_rows);
      ++small_rows_total_;
      if (!k.small->ok()) continue;
      const int64_t rows = k.small->max_rows();
      small_rows_min_ = small_rows_ok_ == 0 ? rows : std::min(small_rows_min_, rows);
      small_rows_max_ = std::max(small_rows_max_, rows);
      ++small_rows_ok_;
    }
  }
  engine_linear_ = every_row && small_rows_ok_ > 0;  // EveryRow is ok for all or none
  if (!fused_static_) return;
  const int64_t h = cfg_.ffn_hidden();
  for (Layer& L : layers_) {
    L.w13 = at::cat({L.w1, L.w3}, 0);  // contiguous; w1 and w3 freed as their views replace them
    L.w1 = L.w13.narrow(0, 0, h);
    L.w3 = L.w13.narrow(0, h, h);
  }
}

at::Tensor Gpt::RopeTable() const {
  if (cfg_.prompted()) return RopeTable1d(cfg_.seq_len(), cfg_.head_dim(), cfg_.rope_base);
  return RopeTable2d(cfg_.grid(), cfg_.head_dim(), cfg_.rope_base, cfg_.cls_token_num);
}

int64_t Gpt::weight_bytes() const {
  int64_t b = static_cast<int64_t>(output_.nbytes() + norm_.nbytes());
  for (const at::Tensor* t : {&head_w1_, &head_b1_, &head_b2_}) {
    if (t->defined()) b += static_cast<int64_t>(t->nbytes());
  }
  for (const Layer& L : layers_) {
    for (const at::Tensor* t :
         {&L.attention_norm, &L.wqkv, &L.wo, &L.ffn_norm, &L.w1, &L.w2, &L.w3}) {
      b += static_cast<int64_t>(t->nbytes());
    }
  }
  return b;
}

KvCache Gpt::NewCache(int64_t slots, int64_t extra, bool scratch_slot) const {
  KvCache c;
  c.slots = slots;
  c.capacity = cfg_.seq_len() + extra;
  c.scratch = scratch_slot ? slots : -1;
  const int64_t all = slots + (scratch_slot ? 1 : 0);
  auto o = at::TensorOptions().dtype(opts_.dtype).device(opts_.device);
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    c.k.push_back(at::zeros({all, c.capacity, cfg_.n_head, cfg_.head_dim()}, o));
    c.v.push_back(at::zeros({all, c.capacity, cfg_.n_head, cfg_.head_dim()}, o));
  }
  return c;
}

Status Gpt::Validate(const std::vector<BatchRow>& batch, const KvCache& cache,
                     bool check_tokens) const {
  if (batch.empty()) return InvalidArgument("forward: empty batch");
  const int64_t label_rows = cfg_.condition_ids();
  std::vector<bool> seen(static_cast<size_t>(cache.slots), false);
  for (size_t r = 0; r < batch.size(); ++r) {
    const BatchRow& row = batch[r];
    const std::string where = "forward: row " + std::to_string(r) + ": ";
    const auto n = static_cast<int64_t>(row.tokens.size());
    if (n == 0) return InvalidArgument(where + "no tokens");
    if (static_cast<int64_t>(row.positions.size()) != n) {
      return InvalidArgument(where + "tokens and positions differ in length");
    }
    if (row.slot < 0 || row.slot >= cache.slots) return InvalidArgument(where + "bad slot");
    const int64_t prefix = RowPrefix(row);
    if (prefix < 0 || prefix > cfg_.prefix_capacity() || (cfg_.prompted() && prefix == 0)) {
      return InvalidArgument(where + "prefix must be in [1, " +
                             std::to_string(cfg_.prefix_capacity()) + "]");
    }
    if (row.cache_len < 0 || row.cache_len + n > cache.capacity) {
      return InvalidArgument(where + "cache_len + tokens exceeds the slot capacity");
    }
    if (!row.mask.empty()) {
      if (static_cast<int64_t>(row.mask.size()) != n * n) {
        return InvalidArgument(where + "mask must be n*n");
      }
      // Every token attends to itself, so no query is left without keys (NaN softmax).
      for (int64_t i = 0; i < n; ++i) {
        if (row.mask[i * n + i] == 0) return InvalidArgument(where + "mask diagonal must be set");
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = row.positions[i], tok = row.tokens[i];
      if (pos < 0 || pos >= prefix + cfg_.block_size) {
        return InvalidArgument(where + "position out of range");
      }
      // With device tokens only the condition tokens are known here (the rows carry them too).
      if (!check_tokens && pos >= prefix) continue;
      const int64_t limit = pos < prefix ? label_rows : cfg_.vocab_size;
      if (tok < 0 || tok >= limit) return InvalidArgument(where + "token id out of range");
    }
    if (seen[static_cast<size_t>(row.slot)])
      return InvalidArgument(where + "slot used twice in a batch");
    seen[static_cast<size_t>(row.slot)] = true;
  }
  return OkStatus();
}

StatusOr<at::Tensor> Gpt::Forward(const std::vector<BatchRow>& batch, KvCache& cache,
                                  const at::Tensor& device_tokens, ForwardOptions fopts) const {
  RETURN_IF_ERROR(Validate(batch, cache, !device_tokens.defined()));
  if (fopts.batch_invariant) {
    for (size_t r = 1; r < batch.size(); ++r) {
      const BatchRow &a = batch[r - 1], &b = batch[r];
      if (a.group >= 0 && a.group == b.group &&
          (a.tokens.size() != b.tokens.size() || a.cache_len != b.cache_len || a.mask != b.mask)) {
        return InvalidArgument("forward: rows of one group differ in length or mask");
      }
    }
  }
  int64_t total = 0;
  for (const auto& r : batch) total += static_cast<int64_t>(r.tokens.size());
  if (device_tokens.defined()) {
    if (device_tokens.numel() != total) {
      return InvalidArgument("forward: device_tokens must hold one id per new token");
    }
  }
  if (fopts.static_shapes || fopts.cuda_graphs) {
    if (cache.scratch < 0) {
      return InvalidArgument("forward: static shapes need a cache with a scratch slot");
    }
    try {
      const StaticShape shape = StaticBucket(batch);
      const std::vector<int64_t> host = StaticUpload(batch, cache, shape, device_tokens.defined());
      at::Tensor padded;
      if (device_tokens.defined()) {
        padded = at::constant_pad_nd(device_tokens.to(at::kLong).reshape({total}),
                                     {0, shape.tokens - total});
      }
      at::Tensor logits;
      if (fopts.cuda_graphs && opts_.device.is_cuda()) {
        ASSIGN_OR_RETURN(logits, RunForwardGraph(*this, cache, shape, host, padded));
      } else {
        logits = StaticForward(UploadLongs(host, opts_.device), padded, shape, cache);
      }
      return logits.narrow(0, 0, total);
    } catch (const c10::Error& e) {
      return Internal(std::string("forward failed in LibTorch: ") + e.what_without_backtrace());
    }
  }
  try {
    return ForwardImpl(batch, cache, device_tokens, fopts.batch_invariant);
  } catch (const c10::Error& e) {
    return Internal(std::string("forward failed in LibTorch: ") + e.what_without_backtrace());
  }
}

at::Tensor Gpt::ForwardImpl(const std::vector<BatchRow>& batch, KvCache& cache,
                            const at::Tensor& device_tokens, bool invariant) const {
  const int64_t R = static_cast<int64_t>(batch.size());
  const int64_t H = cfg_.n_head, hd = cfg_.head_dim(), D = cfg_.dim;
  int64_t T = 0, nmax = 0, kv_max = 0;
  bool consecutive = true;
  for (int64_t r = 0; r < R; ++r) {
    const auto n = static_cast<int64_t>(batch[r].tokens.size());
    T += n;
    nmax = std::max(nmax, n);
    kv_max = std::max(kv_max, batch[r].cache_len + n);
    consecutive &= batch[r].slot == batch[0].slot + r;
  }
  // SDPA calls where RowAttention does not take every row (LoadOptions::row_attention): the
  // whole batch padded to nmax x kv_max, or (batch-invariant) one call per row group with
  // exactly its own lengths.
  struct Call {
    int64_t r0 = 0, rows = 0, t0 = 0, n = 0, kv = 0;
  };
  std::vector<Call> calls;
  if (invariant && !row_attention_) {
    int64_t t = 0;
    for (int64_t r = 0; r < R; ++r) {
      const BatchRow& row = batch[r];
      const auto n = static_cast<int64_t>(row.tokens.size());
      if (r > 0 && row.group >= 0 && row.group == batch[r - 1].group) {
        calls.back().rows += 1;
      } else {
        calls.push_back({r, 1, t, n, row.cache_len + n});
      }
      t += n;
    }
  }

  // Everything the device needs from the host, in one upload: per new token its id, position,
  // cache index (slot * capacity + i) and padded index (r * nmax + i); per row its slot,
  // cache_len, token count and whether it has its own mask; then the flat indices
  // (r * nmax + i) * nmax + j of the allowed pairs of those masks. The attention mask is built
  // from these on the device.
  std::vector<int64_t> host;
  const bool feed_ids = !device_tokens.defined();
  int64_t custom_pairs = 0;
  for (const BatchRow& row : batch) {
    for (uint8_t m : row.mask) custom_pairs += m != 0 ? 1 : 0;
  }
  host.reserve(static_cast<size_t>((feed_ids ? 4 : 3) * T + 4 * R + custom_pairs));
  // With device tokens: the flat indices of the condition tokens among them, whose embedding
  // rows follow the image vocabulary.
  std::vector<int64_t> cond_idx;
  if (feed_ids) {
    for (const BatchRow& row : batch) {
      const int64_t prefix = RowPrefix(row);
      for (size_t i = 0; i < row.tokens.size(); ++i) {
        host.push_back(row.positions[i] < prefix ? cfg_.vocab_size + row.tokens[i] : row.tokens[i]);
      }
    }
  } else {
    int64_t t = 0;
    for (const BatchRow& row : batch) {
      const int64_t prefix = RowPrefix(row);
      for (size_t i = 0; i < row.tokens.size(); ++i, ++t) {
        if (row.positions[i] < prefix) cond_idx.push_back(t);
      }
    }
  }
  for (const BatchRow& row : batch)
    host.insert(host.end(), row.positions.begin(), row.positions.end());
  for (const BatchRow& row : batch) {
    for (size_t i = 0; i < row.tokens.size(); ++i) {
      host.push_back(row.slot * cache.capacity + row.cache_len + static_cast<int64_t>(i));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (size_t i = 0; i < batch[r].tokens.size(); ++i) {
      host.push_back(r * nmax + static_cast<int64_t>(i));
    }
  }
  for (const BatchRow& row : batch) host.push_back(row.slot);
  for (const BatchRow& row : batch) host.push_back(row.cache_len);
  for (const BatchRow& row : batch) host.push_back(static_cast<int64_t>(row.tokens.size()));
  for (const BatchRow& row : batch) host.push_back(row.mask.empty() ? 0 : 1);
  for (int64_t r = 0; r < R; ++r) {
    const BatchRow& row = batch[r];
    const auto n = static_cast<int64_t>(row.tokens.size());
    for (int64_t i = 0; i < n && !row.mask.empty(); ++i) {
      for (int64_t j = 0; j < n; ++j) {
        if (row.mask[i * n + j] != 0) host.push_back((r * nmax + i) * nmax + j);
      }
    }
  }
  host.insert(host.end(), cond_idx.begin(), cond_idx.end());
  const auto dev = opts_.device;
  at::Tensor up = UploadLongs(host, dev);
  int64_t off = 0;
  auto take = [&](int64_t n) {
    at::Tensor t = up.narrow(0, off, n);
    off += n;
    return t;
  };
  at::Tensor ids = feed_ids ? take(T) : device_tokens.to(at::kLong).reshape({T});
  at::Tensor pos = take(T), dst = take(T), src = take(T), slots = take(R);
  at::Tensor meta = take(3 * R).view({3, R, 1, 1});  // cache_len, n, has its own mask
  at::Tensor pairs = take(custom_pairs);
  if (!cond_idx.empty()) {  // condition tokens among the device tokens
    ids = ids.index_add(
        0, take(static_cast<int64_t>(cond_idx.size())),
        at::full({static_cast<int64_t>(cond_idx.size())}, cfg_.vocab_size, ids.options()));
  }

  // With RowAttention (LoadOptions::row_attention) every row attends through it, reading its
  // slot, lengths and mask from the host, and no SDPA call is left. (Rows of more than 16 new
  // tokens kept an SDPA call each until 2026-12-06; with the kernel on both threads RowAttention
  // is faster at every length measured: row_attention.h.)
  std::vector<RowAttentionSpan> spans;
  if (row_attention_) {
    int64_t t = 0;
    for (const BatchRow& row : batch) {
      const auto n = static_cast<int64_t>(row.tokens.size());
      spans.push_back(
          {row.slot, row.cache_len, n, t, row.mask.empty() ? nullptr : row.mask.data()});
      t += n;
    }
  }
  // allow[r, i, j]: query i of row r may attend cache entry j (AllowMask); not built when no
  // SDPA call is left to use it.
  at::Tensor allow;
  if (spans.empty() && (!invariant || !calls.empty())) {
    allow = AllowMask(meta, pairs, custom_pairs > 0, R, nmax, kv_max, dev);
    if (!invariant) allow = allow.unsqueeze(1);  // [R, 1, nmax, kv_max]
  }
  Attend attend = [&](size_t l, const at::Tensor& q) -> at::Tensor {
    const at::Tensor& ck = cache.k[l];
    const at::Tensor& cv = cache.v[l];
    if (!spans.empty()) {  // every row through RowAttention
      at::Tensor out = at::empty({T, D}, q.options());
      RowAttention(q, ck, cv, spans, out);
      return out;
    }
    if (invariant) {
      // Fresh operands per call (index_select and contiguous allocate): identical inputs
      // (values, shapes, strides, alignment) whatever the batch, hence identical outputs.
      std::vector<at::Tensor> outs;
      outs.reserve(calls.size());
      for (const Call& c : calls) {
        at::Tensor qc =
            q.narrow(0, c.t0, c.rows * c.n).view({c.rows, c.n, H, hd}).transpose(1, 2).contiguous();
        at::Tensor sc = slots.narrow(0, c.r0, c.rows);
        at::Tensor kc = ck.narrow(1, 0, c.kv).index_select(0, sc).transpose(1, 2);
        at::Tensor vc = cv.narrow(1, 0, c.kv).index_select(0, sc).transpose(1, 2);
        at::Tensor mc =
            allow.narrow(0, c.r0, c.rows).narrow(1, 0, c.n).narrow(2, 0, c.kv).unsqueeze(1).clone();
        at::Tensor oc = at::scaled_dot_product_attention(qc, kc, vc, mc);
        outs.push_back(oc.transpose(1, 2).reshape({c.rows * c.n, D}));
      }
      return outs.size() == 1 ? outs[0] : at::cat(outs);
    }
    at::Tensor keys, vals;  // [R, kv_max, H, hd]
    if (consecutive) {
      keys = ck.narrow(0, batch[0].slot, R).narrow(1, 0, kv_max);
      vals = cv.narrow(0, batch[0].slot, R).narrow(1, 0, kv_max);
    } else {
      keys = ck.narrow(1, 0, kv_max).index_select(0, slots);
      vals = cv.narrow(1, 0, kv_max).index_select(0, slots);
    }
    at::Tensor qp = at::zeros({R * nmax, H, hd}, q.options()).index_copy_(0, src, q);
    qp = qp.view({R, nmax, H, hd}).transpose(1, 2);
    at::Tensor o =
        at::scaled_dot_product_attention(qp, keys.transpose(1, 2), vals.transpose(1, 2), allow);
    return o.transpose(1, 2).reshape({R * nmax, D}).index_select(0, src);
  };
  return Decode(embed_.index_select(0, ids), rope_.index_select(0, pos), dst, cache, invariant,
                attend);
}

at::Tensor Gpt::Norm(const at::Tensor& x, const at::Tensor& weight) const {
  return row_norm_.ok() ? row_norm_(x, weight) : RmsNormOps(x, weight, cfg_.norm_eps);
}

at::Tensor Gpt::Decode(at::Tensor x, const at::Tensor& rope, const at::Tensor& dst, KvCache& cache,
                       bool invariant, const Attend& attend, bool fused,
                       const Scatter& scatter) const {
  const int64_t T = x.size(0), H = cfg_.n_head, hd = cfg_.head_dim(), D = cfg_.dim;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    if (fused) {
      // The reference layer below in about 20 kernels instead of about 47 (LoadOptions::
      // fused_static_forward): x is this forward's own tensor (an index_select), so the
      // residual adds go into it in place, as the output GEMMs' beta = 1.
      const int64_t h = L.w1.size(0);
      at::Tensor qkv = at::linear(at::rms_norm(x, {D}, L.attention_norm, cfg_.norm_eps), L.wqkv);
      at::Tensor q;  // undefined where scatter has written the queries for attend
      if (scatter) {
        scatter(l, qkv);
      } else {
        at::Tensor qk2 = qkv.narrow(-1, 0, 2 * D).view({T, 2 * H, hd});
        at::Tensor qk = cfg_.prompted() ? RopeOps(qk2, rope, true) : ApplyRopeComplex(qk2, rope);
        cache.k[l].view({-1, H, hd}).index_copy_(0, dst, qk.narrow(1, H, H));
        cache.v[l].view({-1, H, hd}).index_copy_(0, dst, qkv.narrow(-1, 2 * D, D).view({T, H, hd}));
        q = qk.narrow(1, 0, H);
      }
      x.addmm_(attend(l, q), L.wo.t());
      at::Tensor gu = at::linear(at::rms_norm(x, {D}, L.ffn_norm, cfg_.norm_eps), L.w13);
      x.addmm_(at::silu(gu.narrow(-1, 0, h)) * gu.narrow(-1, h, h), L.w2.t());
      continue;
    }
    at::Tensor qkv = Linear(Norm(x, L.attention_norm), L.wqkv, invariant, L.small_wqkv, L.amx_wqkv);
    // q and k rotated in one pass, as 2H heads sharing each token's table: the same arithmetic
    // on every element, half the launches.
    const at::Tensor qk2 = qkv.narrow(-1, 0, 2 * D).reshape({T, 2 * H, hd});
    at::Tensor qk =
        rope_rows_ ? RopeRows(qk2, rope, cfg_.prompted()) : RopeOps(qk2, rope, cfg_.prompted());
    at::Tensor q = qk.narrow(1, 0, H);
    at::Tensor k = qk.narrow(1, H, H);
    at::Tensor v = qkv.narrow(-1, 2 * D, D).reshape({T, H, hd});
    cache.k[l].view({-1, H, hd}).index_copy_(0, dst, k);
    cache.v[l].view({-1, H, hd}).index_copy_(0, dst, v);
    x = x + Linear(attend(l, q), L.wo, invariant, L.small_wo, L.amx_wo);
    at::Tensor hn = Norm(x, L.ffn_norm);
    x = x + Linear(at::silu(Linear(hn, L.w1, invariant, L.small_w1, L.amx_w1)) *
                       Linear(hn, L.w3, invariant, L.small_w3, L.amx_w3),
                   L.w2, invariant, L.small_w2, L.amx_w2);
  }
  at::Tensor h = fused ? at::rms_norm(x, {D}, norm_, cfg_.norm_eps) : Norm(x, norm_);
  if (cfg_.prompted()) {  // gen_head: Linear, GELU (exact), Linear
    h = at::gelu(Linear(h, head_w1_, invariant, small_head_w1_, amx_head_w1_) + head_b1_);
    return (Linear(h, output_, invariant, small_output_, amx_output_) + head_b2_).to(at::kFloat);
  }
  return Linear(h, output_, invariant, small_output_, amx_output_).to(at::kFloat);
}

StaticShape Gpt::StaticBucket(const std::vector<BatchRow>& batch) const {
  int64_t T = 0, nmax = 0, pairs = 0;
  for (const BatchRow& row : batch) {
    T += static_cast<int64_t>(row.tokens.size());
    nmax = std::max(nmax, static_cast<int64_t>(row.tokens.size()));
    for (uint8_t m : row.mask) pairs += m != 0 ? 1 : 0;
  }
  return StaticShape::Of(T, static_cast<int64_t>(batch.size()), nmax, pairs);
}

std::vector<int64_t> Gpt::StaticUpload(const std::vector<BatchRow>& batch, const KvCache& cache,
                                       const StaticShape& shape, bool device_tokens) const {
  const auto R = static_cast<int64_t>(batch.size());
  const int64_t W = shape.width, cap = cache.capacity;
  std::vector<int64_t> host(static_cast<size_t>(shape.upload_size()), 0);
  int64_t* ids = host.data();
  int64_t* pos = ids + shape.tokens;
  int64_t* dst = pos + shape.tokens;
  int64_t* qin = dst + shape.tokens;
  int64_t* slot = qin + shape.tokens;
  int64_t* cl = slot + shape.rows;
  int64_t* nr = cl + shape.rows;
  int64_t* own = nr + shape.rows;
  int64_t* pairs = own + shape.rows;
  int64_t t = 0, p = 0;
  for (int64_t r = 0; r < R; ++r) {
    const BatchRow& row = batch[r];
    const int64_t prefix = RowPrefix(row), n = static_cast<int64_t>(row.tokens.size());
    for (int64_t i = 0; i < n; ++i, ++t) {
      const bool cond = row.positions[i] < prefix;
      ids[t] = (cond ? cfg_.vocab_size : 0) + (device_tokens ? 0 : row.tokens[i]);
      pos[t] = row.positions[i];
      dst[t] = row.slot * cap + row.cache_len + i;
      qin[t] = r * W + i;
    }
    slot[r] = row.slot;
    cl[r] = row.cache_len;
    nr[r] = n;
    own[r] = row.mask.empty() ? 0 : 1;
    for (int64_t i = 0; i < n && !row.mask.empty(); ++i) {
      for (int64_t j = 0; j < n; ++j) {
        if (row.mask[i * n + j] != 0) pairs[p++] = (r * W + i) * W + j;
      }
    }
  }
  // Padding tokens embed id 0 at position 0, write to the scratch slot and take the dummy
  // query row past the batch's; padding rows read the scratch slot with no tokens; padding
  // pairs set the dummy element past the mask.
  for (int64_t i = 0; t < shape.tokens; ++t, ++i) {
    dst[t] = cache.scratch * cap + i % cap;
    qin[t] = shape.rows * W;
  }
  for (int64_t r = R; r < shape.rows; ++r) slot[r] = cache.scratch;
  for (; p < shape.pairs; ++p) pairs[p] = shape.rows * W * W;
  return host;
}

at::Tensor Gpt::StaticForward(const at::Tensor& upload, const at::Tensor& device_tokens,
                              const StaticShape& shape, KvCache& cache) const {
  const int64_t T = shape.tokens, R = shape.rows, W = shape.width, K = cache.capacity;
  const int64_t H = cfg_.n_head, hd = cfg_.head_dim(), D = cfg_.dim;
  int64_t off = 0;
  auto take = [&](int64_t n) {
    at::Tensor t = upload.narrow(0, off, n);
    off += n;
    return t;
  };
  at::Tensor ids = take(T), pos = take(T), dst = take(T), qin = take(T), slots = take(R);
  at::Tensor meta = take(3 * R).view({3, R, 1, 1});  // cache_len, n, has its own mask
  at::Tensor pairs = take(shape.pairs);
  if (device_tokens.defined()) ids = ids + device_tokens;
  at::Tensor qout = qin.clamp_max(R * W - 1);  // padding tokens read row 0; dropped

  // allow[r, i, j] over every entry j of the slot's capacity; padding pairs point past the mask
  // (StaticUpload): one dummy element more.
  at::Tensor allow = AllowMask(meta, pairs, shape.pairs > 0, R, W, K, opts_.device, /*dummy=*/true)
                         .unsqueeze(1);  // [R, 1, W, K]
  if (!StaticBoolMask()) {
    // As the additive bias SDPA takes, built once for all layers: given a boolean mask, SDPA
    // builds this same bias (0 or -inf, in the activations' dtype) in every call, and on CUDA
    // the memory-efficient kernel then copies a bias whose rows are not 16-element aligned
    // into an aligned one, also in every call. Here the rows are padded to a multiple of 16
    // elements: the same values, and about five kernels a layer fewer on a GPU.
    const int64_t Ka = (K + 15) / 16 * 16;
    allow = at::zeros({R, 1, W, Ka}, embed_.options())
                .narrow(3, 0, K)
                .masked_fill_(allow.logical_not(), -std::numeric_limits<double>::infinity());
  }

  // The queries laid out [R, W] (one dummy row more, for padding tokens), zeroed once for all
  // layers: each layer writes the same rows, so the others stay zero.
  at::Tensor qbuf = at::zeros({R * W + 1, H, hd}, embed_.options());
  Attend attend = [&](size_t l, const at::Tensor& q) -> at::Tensor {
    at::Tensor keys = cache.k[l].index_select(0, slots).transpose(1, 2);  // [R, H, K, hd]
    at::Tensor vals = cache.v[l].index_select(0, slots).transpose(1, 2);
    at::Tensor qp = q.defined() ? qbuf.index_copy_(0, qin, q) : qbuf;
    qp = qp.narrow(0, 0, R * W).view({R, W, H, hd}).transpose(1, 2);
    at::Tensor o = at::scaled_dot_product_attention(qp, keys, vals, allow);
    return o.transpose(1, 2).reshape({R * W, D}).index_select(0, qout);
  };
  at::Tensor rope = rope_.index_select(0, pos);  // [T, hd / 2, 2] float32, contiguous
  Scatter scatter;
  if (rope_scatter_) {
    // The rotary embedding and the queries', keys' and values' index_copy_ in one kernel (on
    // the CPU its host path): qkv [T, 3D] rows, the cache [slots * capacity, H, hd] and the
    // query buffer [R * W + 1, H, hd] contiguous. Padding tokens write the scratch slot and the
    // dummy query row, as the index_copy_ do.
    scatter = [&](size_t l, const at::Tensor& qkv) {
      TORCH_CHECK(qkv.stride(1) == 1 && cache.k[l].is_contiguous() && cache.v[l].is_contiguous() &&
                      qkv.scalar_type() == qbuf.scalar_type() &&
                      qkv.scalar_type() == cache.k[l].scalar_type(),
                  "rope scatter: unexpected layout");
      kernels::RopeScatterArgs a;
      a.qkv = qkv.data_ptr();
      a.row_stride = qkv.stride(0);
      a.table = rope.data_ptr<float>();
      a.dst = dst.data_ptr<int64_t>();
      a.qin = qin.data_ptr<int64_t>();
      a.k_cache = cache.k[l].data_ptr();
      a.v_cache = cache.v[l].data_ptr();
      a.queries = qbuf.data_ptr();
      a.tokens = T;
      a.heads = H;
      a.head_dim = hd;
      a.dtype = qkv.scalar_type() == at::kBFloat16 ? kernels::RopeDtype::kBFloat16
                                                   : kernels::RopeDtype::kFloat32;
      if (qkv.is_cuda()) {
        const c10::DeviceGuard on(qkv.device());  // a null (default) stream: the current device's
        const int err = LaunchRopeScatterKernel(a, CurrentCudaStream(qkv.device()));
        TORCH_CHECK(err == 0, "rope scatter kernel launch failed: CUDA error ", err);
      } else {
        kernels::RopeScatterOnHost(a);
      }
    };
  }
  return Decode(embed_.index_select(0, ids), rope, dst, cache, /*invariant=*/false, attend,
                fused_static_, scatter);
}

void CopyCachePrefix(KvCache& cache, int64_t from_slot, int64_t to_slot, int64_t len) {
  if (len <= 0 || from_slot == to_slot) return;
  for (size_t l = 0; l < cache.k.size(); ++l) {
    for (at::Tensor* t : {&cache.k[l], &cache.v[l]}) {
      (*t)[to_slot].narrow(0, 0, len).copy_((*t)[from_slot].narrow(0, 0, len));
    }
  }
}

void CacheMoves::Add(const KvCache& cache, int64_t slot, const std::vector<int64_t>& from_entries,
                     int64_t to_entry) {
  for (size_t i = 0; i < from_entries.size(); ++i) {
    from.push_back(slot * cache.capacity + from_entries[i]);
    to.push_back(slot * cache.capacity + to_entry + static_cast<int64_t>(i));
  }
}

void MoveCacheEntries(KvCache& cache, const CacheMoves& moves) {
  if (moves.from.empty()) return;
  const auto n = static_cast<int64_t>(moves.from.size());
  std::vector<int64_t> both(moves.from);
  both.insert(both.end(), moves.to.begin(), moves.to.end());
  at::Tensor idx = UploadLongs(both, cache.k[0].device());
  const at::Tensor from = idx.narrow(0, 0, n), to = idx.narrow(0, n, n);
  for (size_t l = 0; l < cache.k.size(); ++l) {
    for (at::Tensor* t : {&cache.k[l], &cache.v[l]}) {
      at::Tensor flat = t->flatten(0, 1);  // [slots * capacity, heads, head_dim], a view
      flat.index_copy_(0, to, flat.index_select(0, from));
    }
  }
}

}  // namespace imagegen
