#include "engine/model/vq_decoder.h"

#include <ATen/ATen.h>

// The complete Json type: ReadModelConfig returns one by value (json.h only declares it).
#include <nlohmann/json.hpp>

namespace imagegen {

StatusOr<VqConfig> ParseVqConfig(const Json& json, const std::string& where) {
  JsonFields f(json, where);
  VqConfig c;
  ASSIGN_OR_RETURN(std::string type, f.String("type", "llamagen-vq"));
  if (type != "llamagen-vq") {
    return FailedPrecondition(where + ": 'type' is \"" + type + "\", expected \"llamagen-vq\"");
  }
  ASSIGN_OR_RETURN(c.codebook_size, f.Int("codebook_size"));
  ASSIGN_OR_RETURN(c.codebook_embed_dim, f.Int("codebook_embed_dim"));
  ASSIGN_OR_RETURN(c.codebook_l2_norm, f.Bool("codebook_l2_norm", true));
  ASSIGN_OR_RETURN(c.z_channels, f.Int("z_channels"));
  ASSIGN_OR_RETURN(c.ch, f.Int("ch"));
  ASSIGN_OR_RETURN(c.ch_mult, f.IntList("ch_mult"));
  ASSIGN_OR_RETURN(c.num_res_blocks, f.Int("num_res_blocks"));
  ASSIGN_OR_RETURN(c.out_channels, f.Int("out_channels", 3));
  ASSIGN_OR_RETURN(c.num_groups, f.Int("num_groups", 32));
  ASSIGN_OR_RETURN(c.image_size, f.Int("image_size"));
  if (c.codebook_size <= 0 || c.codebook_embed_dim <= 0 || c.codebook_size > (1 << 22) ||
      c.codebook_embed_dim > 4096) {
    return FailedPrecondition(where + ": VQ codebook sizes must be positive and in range");
  }
  RETURN_IF_ERROR(CheckConvDecoderSpec(c.decoder_spec(), c.image_size, where));
  return c;
}

ConvDecoderSpec VqConfig::decoder_spec() const {
  ConvDecoderSpec s;
  s.naming = ConvDecoderSpec::Naming::kLlamaGen;
  s.z_channels = z_channels;
  s.ch = ch;
  s.ch_mult = ch_mult;
  s.num_res_blocks = num_res_blocks;
  s.out_channels = out_channels;
  s.num_groups = num_groups;
  s.attn_at_lowest_level = true;
  return s;
}

StatusOr<std::unique_ptr<VqDecoder>> VqDecoder::Load(const std::string& dir,
                                                     const LoadOptions& load_opts) {
  try {
    return LoadImpl(dir, load_opts);
  } catch (const c10::Error& e) {
    return ResourceExhausted(
        dir + ": loading failed in LibTorch (out of memory?): " + e.what_without_backtrace());
  }
}

StatusOr<std::unique_ptr<VqDecoder>> VqDecoder::LoadImpl(const std::string& dir,
                                                         const LoadOptions& load_opts) {
  ASSIGN_OR_RETURN(Json json, ReadModelConfig(dir));
  ASSIGN_OR_RETURN(VqConfig cfg, ParseVqConfig(json, dir + "/config.json"));
  ASSIGN_OR_RETURN(auto store, WeightStore::Open(dir));
  LoadOptions opts = load_opts;
  opts.dtype = at::kFloat;  // the VQ never runs in reduced precision (models.md 2)
  std::unique_ptr<VqDecoder> m(new VqDecoder());
  m->cfg_ = cfg;
  m->opts_ = opts;
  ASSIGN_OR_RETURN(at::Tensor cb, store->Take("quantize.embedding.weight",
                                              {cfg.codebook_size, cfg.codebook_embed_dim}, opts));
  if (cfg.codebook_l2_norm) {
    cb = cb / cb.norm(2, {1}, /*keepdim=*/true).clamp_min(1e-12);
  }
  m->codebook_ = cb;
  ASSIGN_OR_RETURN(
      m->post_quant_w_,
      store->Take("post_quant_conv.weight", {cfg.z_channels, cfg.codebook_embed_dim, 1, 1}, opts));
  ASSIGN_OR_RETURN(m->post_quant_b_, store->Take("post_quant_conv.bias", {cfg.z_channels}, opts));
  ASSIGN_OR_RETURN(m->decoder_, ConvDecoder::Load(*store, cfg.decoder_spec(), opts));
  // The encoder side is for training and tooling; the decoder ignores it.
  RETURN_IF_ERROR(store->Finish({"encoder.", "quant_conv.", "quantize.codebook_used"}));
  return m;
}

StatusOr<at::Tensor> VqDecoder::Decode(const at::Tensor& ids_in) const {
  try {
    return DecodeImpl(ids_in);
  } catch (const c10::Error& e) {
    return Internal(std::string("VQ decode failed in LibTorch: ") + e.what_without_backtrace());
  }
}

StatusOr<at::Tensor> VqDecoder::DecodeImpl(const at::Tensor& ids_in) const {
  const int64_t g = cfg_.grid();
  if (ids_in.dim() != 2 || ids_in.size(1) != g * g) {
    return InvalidArgument("VQ decode: ids must be [batch, " + std::to_string(g * g) + "]");
  }
  at::Tensor ids = ids_in.to(opts_.device, at::kLong);
  if (ids.numel() > 0 &&
      (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= cfg_.codebook_size)) {
    return InvalidArgument("VQ decode: token id outside the codebook");
  }
  const int64_t b = ids.size(0);
  at::Tensor z = codebook_.index_select(0, ids.reshape({-1}))
                     .reshape({b, g, g, cfg_.codebook_embed_dim})
                     .permute({0, 3, 1, 2});
  return decoder_.Forward(at::conv2d(z, post_quant_w_, post_quant_b_));
}

at::Tensor ImageToUint8(const at::Tensor& image) {
  return at::clamp(image.to(at::kFloat) * 127.5 + 128.0, 0, 255)
      .to(at::kByte)
      .permute({0, 2, 3, 1})
      .contiguous()
      .to(at::kCPU);
}

}  // namespace imagegen
