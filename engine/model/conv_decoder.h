// The convolutional image decoder that LlamaGen's VQ tokenizer and LDM's KL autoencoder share
// (taming-transformers' Decoder): conv_in, a middle of ResNet block, attention, ResNet block,
// then one level per ch_mult entry from the lowest resolution up (num_res_blocks + 1 ResNet
// blocks, optional attention after each, nearest x2 upsampling and a conv between levels),
// GroupNorm (eps 1e-6), swish and conv_out. The two families name the same tensors
// differently; `naming` picks the map. Immutable after Load; Forward is thread-safe.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/model/weights.h"
#include "engine/util/status.h"

namespace imagegen {

struct ConvDecoderSpec {
  enum class Naming {
    kLlamaGen,  // decoder.mid.{0,1,2}, decoder.conv_blocks.{i}.res/attn/upsample (i = 0 lowest)
    kLdm,       // decoder.mid.{block_1,attn_1,block_2}, decoder.up.{level}.block/attn/upsample
  };
  Naming naming = Naming::kLlamaGen;
  int64_t z_channels = 256, ch = 128;
  std::vector<int64_t> ch_mult = {1, 1, 2, 2, 4};
  int64_t num_res_blocks = 2;  // the encoder's; every decoder level has one more
  int64_t out_channels = 3, num_groups = 32;
  bool attn_at_lowest_level = true;  // LlamaGen: yes; LDM kl16: attention in the middle only
};

class ConvDecoder {
 public:
  // Takes the tensors under "decoder." from `store`.
  static StatusOr<ConvDecoder> Load(WeightStore& store, const ConvDecoderSpec& spec,
                                    const LoadOptions& opts);
  // [B, z_channels, h, w] -> [B, out_channels, h * 2^(levels - 1), w * 2^(levels - 1)].
  at::Tensor Forward(const at::Tensor& z) const;

 private:
  struct Conv {
    at::Tensor w, b;
  };
  struct Norm {
    at::Tensor w, b;
  };
  struct Res {
    Norm norm1, norm2;
    Conv conv1, conv2, nin;  // nin defined only when channels change
  };
  struct Attn {
    Norm norm;
    Conv q, k, v, proj;
  };
  struct Level {
    std::vector<Res> res;
    std::vector<Attn> attn;
    Conv upsample;  // defined except at the last (highest-resolution) level
  };
  at::Tensor GroupNorm(const at::Tensor& x, const Norm& n) const;
  at::Tensor ResForward(const at::Tensor& x, const Res& r) const;
  at::Tensor AttnForward(const at::Tensor& x, const Attn& a) const;

  int64_t num_groups_ = 32;
  Conv conv_in_, conv_out_;
  Res mid_res0_, mid_res1_;
  Attn mid_attn_;
  std::vector<Level> levels_;
  Norm norm_out_;
};

// Config checks both families share: positive sizes, ch * ch_mult divisible by num_groups,
// image_size divisible by 2^(levels - 1); errors name `where` (the config file).
Status CheckConvDecoderSpec(const ConvDecoderSpec& s, int64_t image_size, const std::string& where);

}  // namespace imagegen
