#include "engine/model/mar.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

// The complete Json type: ReadModelConfig returns one by value (json.h only declares it).
#include <nlohmann/json.hpp>

#include "engine/model/device.h"

namespace imagegen {

DiffusionHeadConfig MarConfig::head_config() const {
  DiffusionHeadConfig h;
  h.token_dim = token_dim();
  h.cond_dim = decoder_embed_dim;
  h.width = diffloss_w;
  h.depth = diffloss_d;
  h.sampling_steps = num_sampling_steps;
  return h;
}

StatusOr<MarConfig> ParseMarConfig(const Json& json, const std::string& where) {
  JsonFields f(json, where);
  MarConfig c;
  ASSIGN_OR_RETURN(std::string type, f.String("type"));
  if (type != "mar") {
    return FailedPrecondition(where + ": 'type' is \"" + type + "\", expected \"mar\"");
  }
  ASSIGN_OR_RETURN(c.img_size, f.Int("img_size"));
  ASSIGN_OR_RETURN(c.vae_stride, f.Int("vae_stride"));
  ASSIGN_OR_RETURN(c.patch_size, f.Int("patch_size", 1));
  ASSIGN_OR_RETURN(c.vae_embed_dim, f.Int("vae_embed_dim"));
  ASSIGN_OR_RETURN(c.class_num, f.Int("class_num"));
  ASSIGN_OR_RETURN(c.buffer_size, f.Int("buffer_size", 64));
  ASSIGN_OR_RETURN(c.encoder_embed_dim, f.Int("encoder_embed_dim"));
  ASSIGN_OR_RETURN(c.encoder_depth, f.Int("encoder_depth"));
  ASSIGN_OR_RETURN(c.encoder_num_heads, f.Int("encoder_num_heads"));
  ASSIGN_OR_RETURN(c.decoder_embed_dim, f.Int("decoder_embed_dim"));
  ASSIGN_OR_RETURN(c.decoder_depth, f.Int("decoder_depth"));
  ASSIGN_OR_RETURN(c.decoder_num_heads, f.Int("decoder_num_heads"));
  ASSIGN_OR_RETURN(c.mlp_ratio, f.Number("mlp_ratio", 4.0));
  ASSIGN_OR_RETURN(c.diffloss_d, f.Int("diffloss_d"));
  ASSIGN_OR_RETURN(c.diffloss_w, f.Int("diffloss_w"));
  ASSIGN_OR_RETURN(c.num_sampling_steps, f.String("num_sampling_steps", "100"));
  ASSIGN_OR_RETURN(c.vae, f.String("vae", ""));
  ASSIGN_OR_RETURN(c.draft_model, f.String("draft_model", ""));
  if (f.Find("class_names") != nullptr) {
    ASSIGN_OR_RETURN(c.class_names, f.StringList("class_names"));
  }
  auto bad = [&](const std::string& what) { return FailedPrecondition(where + ": " + what); };
  if (const Json* d = f.Find("sampling_defaults"); d != nullptr) {
    JsonFields sd(*d, where + ": sampling_defaults");
    ASSIGN_OR_RETURN(c.default_num_iter, sd.Int("num_iter", 64));
    ASSIGN_OR_RETURN(c.default_cfg_scale, sd.Number("cfg_scale", 1.0));
    ASSIGN_OR_RETURN(c.default_temperature, sd.Number("temperature", 1.0));
    ASSIGN_OR_RETURN(std::string schedule, sd.String("cfg_schedule", "linear"));
    if (schedule != "linear" && schedule != "constant") {
      return bad("sampling_defaults: 'cfg_schedule' must be \"linear\" or \"constant\"");
    }
    c.default_cfg_linear = schedule == "linear";
  }
  const int64_t sizes[] = {c.img_size,          c.vae_stride,    c.patch_size,
                           c.vae_embed_dim,     c.class_num,     c.buffer_size,
                           c.encoder_embed_dim, c.encoder_depth, c.encoder_num_heads,
                           c.decoder_embed_dim, c.decoder_depth, c.decoder_num_heads,
                           c.diffloss_d,        c.diffloss_w};
  for (int64_t s : sizes) {
    if (s <= 0) {
      return bad(
          "img_size, vae_stride, patch_size, vae_embed_dim, class_num, buffer_size, the "
          "encoder/decoder sizes and diffloss_d/w must be positive");
    }
  }
  if (c.img_size > 8192 || c.vae_embed_dim > 4096 || c.class_num > (1 << 22) ||
      c.buffer_size > 4096 || c.encoder_embed_dim > 65536 || c.decoder_embed_dim > 65536 ||
      c.encoder_depth > 1024 || c.decoder_depth > 1024 || c.diffloss_d > 1024 ||
      c.diffloss_w > 65536 || !(c.mlp_ratio > 0) || c.mlp_ratio > 64) {
    return bad("model sizes out of range");
  }
  if (c.img_size % (c.vae_stride * c.patch_size) != 0) {
    return bad("'img_size' must be a multiple of vae_stride * patch_size");
  }
  if (c.encoder_embed_dim % c.encoder_num_heads != 0 ||
      c.decoder_embed_dim % c.decoder_num_heads != 0) {
    return bad("the embedding widths must be multiples of their head counts");
  }
  if (!c.class_names.empty() && static_cast<int64_t>(c.class_names.size()) != c.class_num) {
    return bad("'class_names' has " + std::to_string(c.class_names.size()) +
               " entries but 'class_num' is " + std::to_string(c.class_num));
  }
  if (c.default_num_iter < 1 || c.default_num_iter > c.seq_len() || !(c.default_cfg_scale >= 1) ||
      c.default_cfg_scale > 100 || !(c.default_temperature > 0) || c.default_temperature > 100) {
    return bad(
        "sampling_defaults: num_iter in [1, seq_len], cfg_scale in [1, 100] and temperature in "
        "(0, 100] are required");
  }
  if (Status s = SpacedTimesteps(1000, c.num_sampling_steps, where).status(); !s.ok()) {
    return FailedPrecondition(s.message());
  }
  return c;
}

StatusOr<std::unique_ptr<Mar>> Mar::Load(const std::string& dir, const LoadOptions& opts) {
  try {
    return LoadImpl(dir, opts);
  } catch (const c10::Error& e) {
    return ResourceExhausted(
        dir + ": loading failed in LibTorch (out of memory?): " + e.what_without_backtrace());
  }
}

StatusOr<std::unique_ptr<Mar>> Mar::LoadImpl(const std::string& dir, const LoadOptions& opts) {
  PrepareAttention(opts.device);
  ASSIGN_OR_RETURN(Json json, ReadModelConfig(dir));
  ASSIGN_OR_RETURN(MarConfig cfg, ParseMarConfig(json, dir + "/config.json"));
  ASSIGN_OR_RETURN(auto store, WeightStore::Open(dir));
  std::unique_ptr<Mar> m(new Mar());
  m->cfg_ = cfg;
  m->options_ = at::TensorOptions().device(opts.device).dtype(opts.dtype);
  const int64_t de = cfg.encoder_embed_dim, dd = cfg.decoder_embed_dim, c = cfg.token_dim();
  const int64_t len = cfg.buffer_size + cfg.seq_len();
  auto lin = [&](const std::string& name, int64_t out, int64_t in, Linear& l) -> Status {
    ASSIGN_OR_RETURN(l.w, store->Take(name + ".weight", {out, in}, opts));
    ASSIGN_OR_RETURN(l.b, store->Take(name + ".bias", {out}, opts));
    return OkStatus();
  };
  auto norm = [&](const std::string& name, int64_t d, Norm& n) -> Status {
    ASSIGN_OR_RETURN(n.w, store->Take(name + ".weight", {d}, opts));
    ASSIGN_OR_RETURN(n.b, store->Take(name + ".bias", {d}, opts));
    return OkStatus();
  };
  auto blocks = [&](const std::string& prefix, int64_t depth, int64_t d,
                    std::vector<Block>& out) -> Status {
    const auto hidden = static_cast<int64_t>(static_cast<double>(d) * cfg.mlp_ratio);
    for (int64_t i = 0; i < depth; ++i) {
      const std::string p = prefix + std::to_string(i) + ".";
      Block b;
      RETURN_IF_ERROR(norm(p + "norm1", d, b.norm1));
      RETURN_IF_ERROR(lin(p + "attn.qkv", 3 * d, d, b.qkv));
      RETURN_IF_ERROR(lin(p + "attn.proj", d, d, b.proj));
      RETURN_IF_ERROR(norm(p + "norm2", d, b.norm2));
      RETURN_IF_ERROR(lin(p + "mlp.fc1", hidden, d, b.fc1));
      RETURN_IF_ERROR(lin(p + "mlp.fc2", d, hidden, b.fc2));
      out.push_back(std::move(b));
    }
    return OkStatus();
  };
  ASSIGN_OR_RETURN(m->class_emb_, store->Take("class_emb.weight", {cfg.class_num, de}, opts));
  ASSIGN_OR_RETURN(m->fake_latent_, store->Take("fake_latent", {1, de}, opts));
  RETURN_IF_ERROR(lin("z_proj", de, c, m->z_proj_));
  RETURN_IF_ERROR(norm("z_proj_ln", de, m->z_proj_ln_));
  ASSIGN_OR_RETURN(m->enc_pos_, store->Take("encoder_pos_embed_learned", {1, len, de}, opts));
  RETURN_IF_ERROR(blocks("encoder_blocks.", cfg.encoder_depth, de, m->encoder_));
  RETURN_IF_ERROR(norm("encoder_norm", de, m->encoder_norm_));
  RETURN_IF_ERROR(lin("decoder_embed", dd, de, m->decoder_embed_));
  ASSIGN_OR_RETURN(m->mask_token_, store->Take("mask_token", {1, 1, dd}, opts));
  ASSIGN_OR_RETURN(m->dec_pos_, store->Take("decoder_pos_embed_learned", {1, len, dd}, opts));
  RETURN_IF_ERROR(blocks("decoder_blocks.", cfg.decoder_depth, dd, m->decoder_));
  RETURN_IF_ERROR(norm("decoder_norm", dd, m->decoder_norm_));
  ASSIGN_OR_RETURN(m->diff_pos_,
                   store->Take("diffusion_pos_embed_learned", {1, cfg.seq_len(), dd}, opts));
  ASSIGN_OR_RETURN(m->head_, DiffusionHead::Load(*store, "diffloss.net.", cfg.head_config(), opts));
  RETURN_IF_ERROR(store->Finish({}));
  return m;
}

at::Tensor Mar::BlockForward(const at::Tensor& x, const Block& b, int64_t heads,
                             const at::Tensor& key_mask) const {
  const int64_t bsz = x.size(0), len = x.size(1), d = x.size(2), hd = d / heads;
  const at::Tensor h = at::layer_norm(x, {d}, b.norm1.w, b.norm1.b, 1e-6);
  const at::Tensor qkv =
      at::linear(h, b.qkv.w, b.qkv.b).reshape({bsz, len, 3, heads, hd}).permute({2, 0, 3, 1, 4});
  at::Tensor o = at::scaled_dot_product_attention(
      qkv[0], qkv[1], qkv[2],
      key_mask.defined() ? std::optional<at::Tensor>(key_mask) : std::nullopt);
  o = o.transpose(1, 2).reshape({bsz, len, d});
  at::Tensor y = x + at::linear(o, b.proj.w, b.proj.b);
  const at::Tensor u = at::layer_norm(y, {d}, b.norm2.w, b.norm2.b, 1e-6);
  return y + at::linear(at::gelu(at::linear(u, b.fc1.w, b.fc1.b)), b.fc2.w, b.fc2.b);
}

StatusOr<at::Tensor> Mar::Forward(const at::Tensor& tokens, const at::Tensor& known,
                                  const at::Tensor& labels) const {
  const int64_t s = cfg_.seq_len(), c = cfg_.token_dim();
  if (tokens.dim() != 3 || tokens.size(1) != s || tokens.size(2) != c || known.dim() != 2 ||
      known.size(0) != tokens.size(0) || known.size(1) != s || labels.dim() != 1 ||
      labels.size(0) != tokens.size(0)) {
    return InvalidArgument("MAR forward: tokens must be [B, " + std::to_string(s) + ", " +
                           std::to_string(c) + "], known [B, " + std::to_string(s) +
                           "] and labels [B]");
  }
  const at::Tensor lab = labels.to(at::kCPU, at::kLong);
  if (lab.numel() > 0 &&
      (lab.min().item<int64_t>() < 0 || lab.max().item<int64_t>() > cfg_.class_num)) {
    return InvalidArgument("MAR forward: label outside [0, class_num]");
  }
  try {
    return ForwardImpl(tokens, known, labels);
  } catch (const c10::Error& e) {
    return Internal(std::string("MAR forward failed in LibTorch: ") + e.what_without_backtrace());
  }
}

StatusOr<at::Tensor> Mar::ForwardImpl(const at::Tensor& tokens_in, const at::Tensor& known_in,
                                      const at::Tensor& labels_in) const {
  const auto dev = options_.device();
  const int64_t bsz = tokens_in.size(0), buf = cfg_.buffer_size, s = cfg_.seq_len();
  const int64_t de = cfg_.encoder_embed_dim, dd = cfg_.decoder_embed_dim, len = buf + s;
  const at::Tensor tokens = tokens_in.to(options_);
  const at::Tensor known = known_in.to(dev, at::kBool);
  const at::Tensor labels = labels_in.to(dev, at::kLong);

  // Encoder input: the buffer holds the condition (class embedding or fake_latent).
  const at::Tensor is_null = (labels == cfg_.class_num).unsqueeze(1);
  const at::Tensor cls =
      at::where(is_null, fake_latent_.expand({bsz, de}),
                class_emb_.index_select(0, labels.clamp_max(cfg_.class_num - 1)));
  at::Tensor x = at::cat(
      {cls.unsqueeze(1).expand({bsz, buf, de}), at::linear(tokens, z_proj_.w, z_proj_.b)}, 1);
  x = at::layer_norm(x + enc_pos_, {de}, z_proj_ln_.w, z_proj_ln_.b, 1e-6);

  // Keep the buffer and the known tokens, in position order, each row padded to the longest.
  const at::Tensor keep = at::cat({at::ones({bsz, buf}, known.options()), known}, 1);  // [B, len]
  const at::Tensor counts = keep.sum(1);
  const int64_t kept = counts.max().item<int64_t>();  // one host read per forward
  const at::Tensor pos = at::arange(len, at::TensorOptions().device(dev).dtype(at::kLong));
  const at::Tensor order = at::where(keep, pos.unsqueeze(0), pos.unsqueeze(0) + len)
                               .argsort(/*stable=*/true, /*dim=*/1)
                               .narrow(1, 0, kept);
  const at::Tensor valid = pos.narrow(0, 0, kept).unsqueeze(0) < counts.unsqueeze(1);  // [B, L]
  x = x.gather(1, order.unsqueeze(2).expand({bsz, kept, de}));
  // Padded keys are masked; padded queries compute garbage that is never read.
  const at::Tensor key_mask =
      kept == counts.min().item<int64_t>() ? at::Tensor() : valid.view({bsz, 1, 1, kept});
  for (const Block& b : encoder_) x = BlockForward(x, b, cfg_.encoder_num_heads, key_mask);
  x = at::layer_norm(x, {de}, encoder_norm_.w, encoder_norm_.b, 1e-6);

  // Decoder: mask tokens everywhere, the encoded tokens scattered back to their positions.
  at::Tensor y = at::linear(x, decoder_embed_.w, decoder_embed_.b);
  const at::Tensor mask_tok = mask_token_.expand({bsz, kept, dd});
  y = at::where(valid.unsqueeze(2), y, mask_tok);  // padding writes mask tokens, harmlessly
  at::Tensor full = mask_token_.expand({bsz, len, dd}).clone();
  full.scatter_(1, order.unsqueeze(2).expand({bsz, kept, dd}), y);
  at::Tensor h = full + dec_pos_;
  for (const Block& b : decoder_) h = BlockForward(h, b, cfg_.decoder_num_heads, at::Tensor());
  h = at::layer_norm(h, {dd}, decoder_norm_.w, decoder_norm_.b, 1e-6);
  return h.narrow(1, buf, s) + diff_pos_;
}

at::Tensor Mar::Unpatchify(const at::Tensor& tokens) const {
  const int64_t b = tokens.size(0), g = cfg_.grid(), p = cfg_.patch_size, c = cfg_.vae_embed_dim;
  return tokens.reshape({b, g, g, c, p, p})
      .permute({0, 3, 1, 4, 2, 5})
      .reshape({b, c, g * p, g * p});
}

}  // namespace imagegen
