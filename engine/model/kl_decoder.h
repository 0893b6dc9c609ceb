// The decoder of LDM's KL autoencoder as MAR uses it (shared/docs/models.md 3.6): latents
// divided by the latent scale -> post_quant_conv -> the shared convolutional decoder (LDM
// names, attention in the middle only) -> pixels in about [-1, 1]. Sizes come from
// config.json, so MAR's KL-16 and the bundled small autoencoder share this code. Always runs in
// float32. Immutable after Load; Decode is thread-safe.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/model/conv_decoder.h"
#include "engine/model/weights.h"
#include "engine/util/status.h"

namespace imagegen {

struct KlConfig {
  int64_t embed_dim = 16, z_channels = 16, ch = 128;
  std::vector<int64_t> ch_mult = {1, 1, 2, 2, 4};
  int64_t num_res_blocks = 2, out_ch = 3, resolution = 256, num_groups = 32;
  double latent_scale = 0.2325;  // tokens = posterior * scale; decoding divides it out

  int64_t grid() const { return resolution >> (ch_mult.size() - 1); }
  ConvDecoderSpec decoder_spec() const;
};

StatusOr<KlConfig> ParseKlConfig(const Json& json, const std::string& where);

class KlDecoder {
 public:
  static StatusOr<std::unique_ptr<KlDecoder>> Load(const std::string& dir, const LoadOptions& opts);
  const KlConfig& config() const { return cfg_; }

  // latents [B, embed_dim, grid, grid] (scaled, as MAR samples them; any float dtype and
  // device) -> float32 [B, out_ch, resolution, resolution].
  StatusOr<at::Tensor> Decode(const at::Tensor& latents) const;

 private:
  KlDecoder() = default;
  static StatusOr<std::unique_ptr<KlDecoder>> LoadImpl(const std::string& dir,
                                                       const LoadOptions& opts);

  KlConfig cfg_;
  LoadOptions opts_;
  at::Tensor post_quant_w_, post_quant_b_;
  ConvDecoder decoder_;
};

}  // namespace imagegen
