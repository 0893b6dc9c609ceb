// The LlamaGen VQ image decoder (shared/docs/models.md section 2): token ids -> codebook
// vectors (L2-normalised at load) -> post_quant_conv -> Decoder -> pixels in about [-1, 1].
// Channels, levels, groups and image size come from config.json, so the bundled small
// tokenizer and the official VQ-16 share this code. Always runs in float32. Immutable after
// Load; Decode is thread-safe.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/model/conv_decoder.h"
#include "engine/model/weights.h"
#include "engine/util/status.h"

namespace imagegen {

struct VqConfig {
  int64_t codebook_size = 16384, codebook_embed_dim = 8;
  bool codebook_l2_norm = true;
  int64_t z_channels = 256, ch = 128;
  std::vector<int64_t> ch_mult = {1, 1, 2, 2, 4};
  int64_t num_res_blocks = 2;  // encoder's; the decoder has one more per level
  int64_t out_channels = 3, num_groups = 32, image_size = 256;

  int64_t grid() const { return image_size >> (ch_mult.size() - 1); }
  ConvDecoderSpec decoder_spec() const;
};

StatusOr<VqConfig> ParseVqConfig(const Json& json, const std::string& where);

class VqDecoder {
 public:
  static StatusOr<std::unique_ptr<VqDecoder>> Load(const std::string& dir, const LoadOptions& opts);
  const VqConfig& config() const { return cfg_; }

  // ids [B, grid^2] (any integer dtype, any device) -> float32 [B, out_channels, H, W].
  StatusOr<at::Tensor> Decode(const at::Tensor& ids) const;

 private:
  VqDecoder() = default;
  static StatusOr<std::unique_ptr<VqDecoder>> LoadImpl(const std::string& dir,
                                                       const LoadOptions& opts);
  StatusOr<at::Tensor> DecodeImpl(const at::Tensor& ids) const;

  VqConfig cfg_;
  LoadOptions opts_;
  at::Tensor codebook_;  // [codebook_size, embed_dim], normalised if configured
  at::Tensor post_quant_w_, post_quant_b_;
  ConvDecoder decoder_;
};

// LlamaGen's eval conversion: clamp(127.5 x + 128, 0, 255) truncated, as [B, H, W, C] uint8 on
// the CPU.
at::Tensor ImageToUint8(const at::Tensor& image);

}  // namespace imagegen
