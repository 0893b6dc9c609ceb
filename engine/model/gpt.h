// The LlamaGen class-conditional GPT (shared/docs/models.md section 1), or the image-generation
// path of Janus-Pro (section 4: a LLaMA language model fed prompt tokens then aligned image
// embeddings, with an MLP image head), with a forward pass over a ragged batch: many rows,
// each with its own KV-cache slot, committed length, new tokens at given positions and an
// optional mask among the new tokens.
//
// A Gpt is immutable after Load and may be shared; Forward mutates only the KvCache it is
// given, so concurrent Forward calls need distinct caches.
#pragma once

#include <ATen/Tensor.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "engine/model/amx_gemm.h"
#include "engine/model/norm_rope.h"
#include "engine/model/small_gemm.h"
#include "engine/model/weights.h"
#include "engine/util/status.h"

namespace imagegen {

// Which network a GptConfig describes.
enum class GptArch {
  // LlamaGen c2i: one class token, 2D RoPE (interleaved pairs), a linear head.
  kLlamaGen,
  // Janus-Pro generation: a prompt of text tokens (any length up to max_prompt_len), 1-D
  // rotate-half RoPE over the whole sequence, image inputs gen_aligner(gen_embed(id)), image
  // logits gen_head(norm(h)) (Linear, GELU, Linear). config.json "type": "janus-gen".
  kJanus,
};

struct GptConfig {
  GptArch arch = GptArch::kLlamaGen;
  int64_t dim = 768, n_layer = 12, n_head = 12;
  int64_t vocab_size = 16384, num_classes = 1000;
  int64_t block_size = 256;  // image tokens = grid^2
  int64_t cls_token_num = 1;
  int64_t multiple_of = 256;
  double ffn_dim_multiplier = 0;  // 0: unused (LlamaGen's None)
  double rope_base = 10000, norm_eps = 1e-5;
  double class_dropout_prob = 0.1;
  std::string tokenizer;    // name of the VQ model directory beside this one
  std::string draft_model;  // optional: a smaller GPT beside this one that drafts for it
  std::vector<std::string> class_names;
  // Sampling defaults recommended for this model (config.json "sampling_defaults").
  double default_cfg_scale = 1.0, default_temperature = 1.0, default_top_p = 1.0;
  int64_t default_top_k = 0;
  // Janus only.
  int64_t text_vocab_size = 0;    // prompt token ids lie in [0, text_vocab_size)
  int64_t max_prompt_len = 0;     // longest prompt (BOS to the image-start tag) in tokens
  int64_t intermediate_size = 0;  // the FFN width as the LLaMA config gives it
  int64_t gen_embed_dim = 0;      // gen_embed's width (the VQ code dimension, 8)
  int64_t head_hidden = 0;        // gen_head's hidden width (image_token_embed)
  int64_t pad_id = -1;            // replaces the prompt's inner tokens in the unconditional row
  std::string prompt_template;    // the chat template around a prompt ("{prompt}" marks it)
  std::string text_tokenizer;     // tokenizer.json beside config.json, for the server

  bool prompted() const { return arch == GptArch::kJanus; }
  int64_t head_dim() const { return dim / n_head; }
  int64_t ffn_hidden() const;
  int64_t grid() const;
  // Label of the null (unconditional) class; exists only if class_dropout_prob > 0.
  int64_t null_class() const { return num_classes; }
  bool has_null_class() const { return class_dropout_prob > 0; }
  // Condition positions a sequence may have: the class token(s), or the longest prompt.
  int64_t prefix_capacity() const { return prompted() ? max_prompt_len : cls_token_num; }
  // Ids a condition token may take: class labels (and the null class), or text token ids.
  int64_t condition_ids() const {
    return prompted() ? text_vocab_size : num_classes + (has_null_class() ? 1 : 0);
  }
  // Longest sequence: condition + image tokens (the last image token is never fed).
  int64_t seq_len() const { return prefix_capacity() + block_size; }
};

StatusOr<GptConfig> ParseGptConfig(const Json& json, const std::string& where);

class ForwardGraphs;  // engine/model/cuda_graphs.h

// Per-slot key/value storage for every layer: [slots, capacity, heads, head_dim].
struct KvCache {
  std::vector<at::Tensor> k, v;
  int64_t slots = 0, capacity = 0;
  // A slot past `slots` that static-shape forwards write their padding tokens to (-1: none;
  // Gpt::NewCache(..., scratch_slot = true) adds it).
  int64_t scratch = -1;
  // CUDA graphs captured against this cache's tensors (ForwardOptions::cuda_graphs).
  std::shared_ptr<ForwardGraphs> graphs;
};

// One row of a ragged batch. New token i is written to cache index cache_len + i and sits at
// sequence position positions[i] (the RoPE index). A position below the row's prefix means a
// condition token: a class label (null_class() for the unconditional row) or a prompt token
// id; image token k (from 0) of the row sits at position prefix + k.
struct BatchRow {
  int64_t slot = 0;
  // Condition positions of this row's sequence; -1: the config's cls_token_num (LlamaGen).
  // Prompted models need it set (the prompt's length).
  int64_t prefix = -1;
  int64_t cache_len = 0;  // committed entries every new token attends to
  std::vector<int64_t> tokens;
  std::vector<int64_t> positions;
  // Optional n x n row-major: mask[i * n + j] != 0 lets new token i attend new token j.
  // Empty means causal among the new tokens (j <= i).
  std::vector<uint8_t> mask;
  // Batch-invariant forwards only: adjacent rows with the same group >= 0 (a request's
  // conditional and unconditional rows) share one attention call and must have the same
  // number of tokens and cache_len; a row with group -1 has a call of its own.
  int64_t group = -1;
};

struct ForwardOptions {
  // Every row's logits are bit-identical whatever else is in the batch (same device and
  // build), so a request's image does not depend on its neighbours. Linear layers never run
  // on fewer than kInvariantMinRows rows (BLAS libraries switch to other kernels for tiny
  // matrices, and those round differently), and attention runs once per row group, so that no
  // row's queries or keys are padded to another row's length. Off: one attention call for the
  // whole batch, padded to its longest row (evaluation), except where RowAttention takes every
  // row (LoadOptions::row_attention: the CPU in fp32), which is faster for either mode.
  bool batch_invariant = false;
  // Graph-ready: the forward's every tensor shape depends only on the batch's bucket
  // (StaticShape: token, row, width and mask-pair counts rounded up to powers of two), its
  // inputs come in one upload of a fixed layout, and attention runs over each slot's whole
  // capacity (masked) in one call, so that one bucket's forward can be captured as a CUDA graph
  // and replayed for any batch of that bucket (cuda_graphs). Needs a cache with a scratch slot.
  // Overrides batch_invariant; a row's logits equal the other modes' within rounding, not bit
  // for bit.
  bool static_shapes = false;
  // static_shapes, with each bucket's forward captured once as a CUDA graph and replayed
  // (CUDA devices in builds that link LibTorch's CUDA libraries; elsewhere the static forward
  // runs eagerly).
  bool cuda_graphs = false;
};

// Rows below which a batch-invariant forward pads its linear layers (see ForwardOptions).
inline constexpr int64_t kInvariantMinRows = 16;

// The bucket of a static-shape forward (ForwardOptions::static_shapes).
struct StaticShape {
  int64_t tokens = 0, rows = 0, width = 0, pairs = 0;
  // The bucket of a batch of `tokens` tokens in `rows` rows, the widest row `width` tokens
  // long, with `pairs` own-mask pairs: each rounded up to a power of two, tokens to at least
  // kInvariantMinRows (the linear layers then never see the tiny matrices whose BLAS kernels
  // round differently), pairs 0 staying 0.
  static StaticShape Of(int64_t tokens, int64_t rows, int64_t width, int64_t pairs) {
    auto pow2 = [](int64_t n) {
      int64_t p = 1;
      while (p < n) p *= 2;
      return p;
    };
    return {pow2(std::max(tokens, kInvariantMinRows)), pow2(rows), pow2(width),
            pairs == 0 ? 0 : pow2(pairs)};
  }
  bool operator==(const StaticShape& o) const {
    return tokens == o.tokens && rows == o.rows && width == o.width && pairs == o.pairs;
  }
  bool operator<(const StaticShape& o) const {  // an order, for sets and maps of buckets
    return std::tie(tokens, rows, width, pairs) < std::tie(o.tokens, o.rows, o.width, o.pairs);
  }
  // Length of the int64 upload: ids, positions, cache indices and query indices per token,
  // slot, cache length, token count and own-mask flag per row, then the mask pairs.
  int64_t upload_size() const { return 4 * tokens + 4 * rows + pairs; }
};

// IMAGEGEN_SDPA_BOOL_MASK=1 in the environment: the static forward gives attention its boolean
// mask, which SDPA turns into an additive bias in every layer, instead of that bias built once
// (Gpt::StaticForward). The same values either way; for the A/B of the kernels it saves
// (bench/gpu/graphs_lease.sh's profile step).
bool StaticBoolMask();

class Gpt {
 public:
  static StatusOr<std::unique_ptr<Gpt>> Load(const std::string& dir, const LoadOptions& opts);
  // A model from already-shaped weights (tests); names as in LlamaGen's state_dict.
  static StatusOr<std::unique_ptr<Gpt>> FromStore(const GptConfig& cfg, WeightStore& store,
                                                  const LoadOptions& opts);

  // A model of `cfg`'s shape with random weights (normal, std 0.02; norms 1), for benchmarks
  // of shapes no checkpoint is at hand for (GPT-B/L/XL). Deterministic in `seed`.
  static std::unique_ptr<Gpt> Random(const GptConfig& cfg, const LoadOptions& opts, uint64_t seed);

  // Bytes of the weights a forward reads (all of them but the unused embedding rows).
  int64_t weight_bytes() const;

  const GptConfig& config() const { return cfg_; }
  const LoadOptions& options() const { return opts_; }
  // Whether the static-shape forward runs the fused layer (LoadOptions::fused_static_forward).
  bool fused_static() const { return fused_static_; }
  // Whether the fused layer's rotary embedding and writes run as one kernel
  // (LoadOptions::rope_scatter).
  bool rope_scatter() const { return rope_scatter_; }
  // Whether the batch-invariant forward's attention runs through RowAttention
  // (LoadOptions::row_attention).
  bool row_attention() const { return row_attention_; }
  // Linear layers whose few-row products run SmallRowsLinear's kernel (LoadOptions::
  // small_rows_gemm), of those it was tried on (0 of 0: not tried).
  int64_t small_rows_linears() const { return small_rows_ok_; }
  int64_t small_rows_tried() const { return small_rows_total_; }
  // The fewest and the most rows those kernels take (SmallRowsLinear::max_rows; 0 with none).
  int64_t small_rows_min() const { return small_rows_min_; }
  int64_t small_rows_max() const { return small_rows_max_; }
  // The kernel takes every row count of every linear layer, never the BLAS
  // (LoadOptions::engine_linear, where it applies).
  bool engine_linear() const { return engine_linear_; }
  // The linear weights' bytes (the products' weights: those SmallRowsLinear and AmxBf16Linear
  // pack).
  int64_t linear_weight_bytes() const { return linear_bytes_; }
  // The few-row kernel would run here but was not tried: the linear weights are over
  // kSmallGemmMaxWeightBytes (and engine_linear was not asked for), so few-row products pad.
  bool small_rows_over_size() const { return small_rows_over_size_; }
  // Linear layers whose products run in bf16 on the AMX tiles (LoadOptions::bf16_matmul), of
  // those it was asked for (0 of 0: not asked).
  int64_t bf16_matmul_linears() const { return amx_ok_; }
  int64_t bf16_matmul_tried() const { return amx_total_; }
  // Whether the reference layer's RMSNorm and its rotary embedding run as one kernel each
  // (LoadOptions::fused_norm_rope; engine/model/norm_rope.h).
  bool norm_kernel() const { return row_norm_.ok(); }
  bool rope_kernel() const { return rope_rows_; }

  // A cache with `slots` slots of seq_len() + extra entries each, zero-filled. Throws
  // c10::Error if the device is out of memory (callers size it from a memory budget).
  // With scratch_slot, one slot more, which static-shape forwards write their padding to.
  KvCache NewCache(int64_t slots, int64_t extra = 0, bool scratch_slot = false) const;

  // Logits [total new tokens, vocab] in float32, rows in batch order. Throws c10::Error only
  // on internal errors; inputs are validated and reported as a Status.
  // `device_tokens`, when defined, is an int64 tensor [total new tokens] on the model's device
  // that replaces the rows' token ids: drafts sampled on the device are fed back without a host
  // round trip. Image tokens there are not validated and the rows' token vectors only give the
  // lengths, except at positions below the row's prefix, where both hold the condition token
  // (the row's copy is validated).
  StatusOr<at::Tensor> Forward(const std::vector<BatchRow>& batch, KvCache& cache,
                               const at::Tensor& device_tokens = at::Tensor(),
                               ForwardOptions fopts = {}) const;

  // The two halves of a static-shape forward (ForwardOptions::static_shapes), which a CUDA
  // graph captures separately: the host half lays a validated batch out as StaticShape's
  // upload (ids are full ids without device tokens; with them, the condition tokens' offsets
  // into the embedding, added to the device tokens); the device half computes logits
  // [shape.tokens, vocab] from that upload (on the device) and the device tokens padded to
  // shape.tokens (undefined: none), writing the new keys and values into `cache`.
  StaticShape StaticBucket(const std::vector<BatchRow>& batch) const;
  std::vector<int64_t> StaticUpload(const std::vector<BatchRow>& batch, const KvCache& cache,
                                    const StaticShape& shape, bool device_tokens) const;
  at::Tensor StaticForward(const at::Tensor& upload, const at::Tensor& device_tokens,
                           const StaticShape& shape, KvCache& cache) const;

  // The token-embedding rows [vocab, dim] (GSD measures distances between them).
  at::Tensor token_embeddings() const { return embed_.narrow(0, 0, cfg_.vocab_size); }

 private:
  struct Layer {
    at::Tensor attention_norm, wqkv, wo, ffn_norm, w1, w2, w3;
    at::Tensor w13;  // [2 * hidden, dim]: w1 then w3, with w1 and w3 views of it (fused only)
    // The projections' few-row kernels (LoadOptions::small_rows_gemm).
    SmallRowsLinear small_wqkv, small_wo, small_w1, small_w2, small_w3;
    // Their bf16 products on the AMX tiles (LoadOptions::bf16_matmul), which replace both.
    AmxBf16Linear amx_wqkv, amx_wo, amx_w1, amx_w2, amx_w3;
  };
  // After the weights are in place: the layers' MLP weights as one tensor each
  // (LoadOptions::fused_static_forward), the few-row kernels (small_rows_gemm), the flags.
  void FuseMlpWeights();
  Gpt() = default;
  static StatusOr<std::unique_ptr<Gpt>> FromStoreImpl(const GptConfig& cfg, WeightStore& store,
                                                      const LoadOptions& opts);
  at::Tensor ForwardImpl(const std::vector<BatchRow>& batch, KvCache& cache,
                         const at::Tensor& device_tokens, bool invariant) const;
  // The layers and the head over embeddings x [T, D] at RoPE rows `rope`: each layer writes its
  // new keys and values to the cache at flat indices dst (slot * capacity + entry), then
  // attends through attend(layer, q) -> [T, D], which reads the keys and values from the cache.
  using Attend = std::function<at::Tensor(size_t, const at::Tensor&)>;
  // The fused layer's rotary embedding and writes in one kernel (LoadOptions::rope_scatter):
  // scatter(layer, qkv) writes the rotated queries where attend reads them, and the keys and
  // values to the cache; attend then gets an undefined q.
  using Scatter = std::function<void(size_t, const at::Tensor&)>;
  // `fused`: each layer through the fused kernels (LoadOptions::fused_static_forward), with
  // `scatter` where it is set.
  at::Tensor Decode(at::Tensor x, const at::Tensor& rope, const at::Tensor& dst, KvCache& cache,
                    bool invariant, const Attend& attend, bool fused = false,
                    const Scatter& scatter = nullptr) const;
  // The reference layer's RMSNorm (row_norm_'s kernel where it reproduces the ops).
  at::Tensor Norm(const at::Tensor& x, const at::Tensor& weight) const;
  Status Validate(const std::vector<BatchRow>& batch, const KvCache& cache,
                  bool check_tokens) const;
  at::Tensor RopeTable() const;  // float32 on CPU
  int64_t RowPrefix(const BatchRow& row) const {
    return row.prefix >= 0 ? row.prefix : cfg_.cls_token_num;
  }

  GptConfig cfg_;
  LoadOptions opts_;
  bool fused_static_ = false;
  bool rope_scatter_ = false;
  bool row_attention_ = false;
  int64_t small_rows_ok_ = 0, small_rows_total_ = 0, small_rows_min_ = 0, small_rows_max_ = 0;
  bool engine_linear_ = false;
  bool small_rows_over_size_ = false;
  int64_t linear_bytes_ = 0;
  RowNorm row_norm_;        // not ok: the ops (LoadOptions::fused_norm_rope)
  bool rope_rows_ = false;  // the rotary embedding through RopeRows
  // [vocab + condition_ids, dim]: image-token rows then condition rows (class labels, or text
  // tokens). Janus's image rows are gen_aligner(gen_embed(id)), computed once at load.
  at::Tensor embed_;
  // [seq_len, head_dim / 2, 2] float32 (cos, sin) by position: LlamaGen's 2D table (class rows
  // zero), applied to interleaved pairs; Janus's 1-D table, applied to the two halves.
  at::Tensor rope_;
  std::vector<Layer> layers_;
  at::Tensor norm_, output_;
  // Janus's gen_head: output_mlp_projector (head_w1, head_b1), GELU, vision_head.
  at::Tensor head_w1_, head_b1_, head_b2_;
  SmallRowsLinear small_output_, small_head_w1_;
  AmxBf16Linear amx_output_, amx_head_w1_;
  int64_t amx_ok_ = 0, amx_total_ = 0;
};

// Cache entries to move, each within its slot (as flat indices slot * capacity + entry): after
// a tree step each request's accepted path is made contiguous.
struct CacheMoves {
  std::vector<int64_t> from, to;
  // Entries `from_entries` of `slot` to entries to_entry, to_entry + 1, ...
  void Add(const KvCache& cache, int64_t slot, const std::vector<int64_t>& from_entries,
           int64_t to_entry);
};

// Makes every move (every layer, keys and values) in one upload and two launches per tensor,
// whatever the number of requests and slots: every entry is read before any is written.
void MoveCacheEntries(KvCache& cache, const CacheMoves& moves);

// Copies the first `len` cache entries of `from_slot` (every layer, keys and values) to
// `to_slot`: a prompt prefilled once serves several images.
void CopyCachePrefix(KvCache& cache, int64_t from_slot, int64_t to_slot, int64_t len);

// The 2D RoPE table of models.md 1.4, float32 on CPU.
at::Tensor RopeTable2d(int64_t grid, int64_t head_dim, double base, int64_t cls_token_num);

// Hugging Face LLaMA's 1-D RoPE table for positions [0, len), float32 on CPU: [len, hd/2, 2].
at::Tensor RopeTable1d(int64_t len, int64_t head_dim, double base);

}  // namespace imagegen
