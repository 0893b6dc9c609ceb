#include "engine/model/kl_decoder.h"

#include <ATen/ATen.h>

#include <cmath>

// The complete Json type: ReadModelConfig returns one by value (json.h only declares it).
#include <nlohmann/json.hpp>

namespace imagegen {

ConvDecoderSpec KlConfig::decoder_spec() const {
  ConvDecoderSpec s;
  s.naming = ConvDecoderSpec::Naming::kLdm;
  s.z_channels = z_channels;
  s.ch = ch;
  s.ch_mult = ch_mult;
  s.num_res_blocks = num_res_blocks;
  s.out_channels = out_ch;
  s.num_groups = num_groups;
  s.attn_at_lowest_level = false;
  return s;
}

StatusOr<KlConfig> ParseKlConfig(const Json& json, const std::string& where) {
  JsonFields f(json, where);
  KlConfig c;
  ASSIGN_OR_RETURN(std::string type, f.String("type"));
  if (type != "kl-autoencoder") {
    return FailedPrecondition(where + ": 'type' is \"" + type + "\", expected \"kl-autoencoder\"");
  }
  ASSIGN_OR_RETURN(c.embed_dim, f.Int("embed_dim"));
  ASSIGN_OR_RETURN(c.z_channels, f.Int("z_channels"));
  ASSIGN_OR_RETURN(c.ch, f.Int("ch"));
  ASSIGN_OR_RETURN(c.ch_mult, f.IntList("ch_mult"));
  ASSIGN_OR_RETURN(c.num_res_blocks, f.Int("num_res_blocks"));
  ASSIGN_OR_RETURN(c.out_ch, f.Int("out_ch", 3));
  ASSIGN_OR_RETURN(c.resolution, f.Int("resolution"));
  ASSIGN_OR_RETURN(c.num_groups, f.Int("num_groups", 32));
  ASSIGN_OR_RETURN(c.latent_scale, f.Number("latent_scale"));
  if (c.embed_dim <= 0 || c.embed_dim > 4096) {
    return FailedPrecondition(where + ": 'embed_dim' must be in [1, 4096]");
  }
  if (!std::isfinite(c.latent_scale) || c.latent_scale <= 0) {
    return FailedPrecondition(where + ": 'latent_scale' must be a positive number");
  }
  RETURN_IF_ERROR(CheckConvDecoderSpec(c.decoder_spec(), c.resolution, where));
  return c;
}

StatusOr<std::unique_ptr<KlDecoder>> KlDecoder::Load(const std::string& dir,
                                                     const LoadOptions& load_opts) {
  try {
    return LoadImpl(dir, load_opts);
  } catch (const c10::Error& e) {
    return ResourceExhausted(
        dir + ": loading failed in LibTorch (out of memory?): " + e.what_without_backtrace());
  }
}

StatusOr<std::unique_ptr<KlDecoder>> KlDecoder::LoadImpl(const std::string& dir,
                                                         const LoadOptions& load_opts) {
  ASSIGN_OR_RETURN(Json json, ReadModelConfig(dir));
  ASSIGN_OR_RETURN(KlConfig cfg, ParseKlConfig(json, dir + "/config.json"));
  ASSIGN_OR_RETURN(auto store, WeightStore::Open(dir));
  LoadOptions opts = load_opts;
  opts.dtype = at::kFloat;  // the image decoder never runs in reduced precision
  std::unique_ptr<KlDecoder> m(new KlDecoder());
  m->cfg_ = cfg;
  m->opts_ = opts;
  ASSIGN_OR_RETURN(m->post_quant_w_, store->Take("post_quant_conv.weight",
                                                 {cfg.z_channels, cfg.embed_dim, 1, 1}, opts));
  ASSIGN_OR_RETURN(m->post_quant_b_, store->Take("post_quant_conv.bias", {cfg.z_channels}, opts));
  ASSIGN_OR_RETURN(m->decoder_, ConvDecoder::Load(*store, cfg.decoder_spec(), opts));
  // The encoder side is for training and tooling; the decoder ignores it.
  RETURN_IF_ERROR(store->Finish({"encoder.", "quant_conv.", "loss."}));
  return m;
}

StatusOr<at::Tensor> KlDecoder::Decode(const at::Tensor& latents) const {
  const int64_t g = cfg_.grid();
  if (latents.dim() != 4 || latents.size(1) != cfg_.embed_dim || latents.size(2) != g ||
      latents.size(3) != g) {
    return InvalidArgument("KL decode: latents must be [batch, " + std::to_string(cfg_.embed_dim) +
                           ", " + std::to_string(g) + ", " + std::to_string(g) + "]");
  }
  try {
    const at::Tensor z = latents.to(opts_.device, at::kFloat) / cfg_.latent_scale;
    return decoder_.Forward(at::conv2d(z, post_quant_w_, post_quant_b_));
  } catch (const c10::Error& e) {
    return Internal(std::string("KL decode failed in LibTorch: ") + e.what_without_backtrace());
  }
}

}  // namespace imagegen
