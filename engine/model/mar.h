// MAR (Li et al. 2024; shared/docs/models.md 3): a bidirectional encoder/decoder over
// continuous tokens with a class buffer, and the DiffLoss head that samples each token from
// the decoder's output. Official tensor names, so converted checkpoints (tools/convert_mar.py)
// load as they are. The forward takes a ragged batch: rows may know different numbers of
// tokens (padded and masked inside the encoder), so requests at different steps share a call.
// MAR has no KV cache: every step re-encodes the known tokens. Immutable after Load; Forward
// and the head are thread-safe.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/model/diffusion_head.h"
#include "engine/model/weights.h"
#include "engine/util/status.h"

namespace imagegen {

struct MarConfig {
  int64_t img_size = 256, vae_stride = 16, patch_size = 1, vae_embed_dim = 16;
  int64_t class_num = 1000, buffer_size = 64;
  int64_t encoder_embed_dim = 768, encoder_depth = 12, encoder_num_heads = 12;
  int64_t decoder_embed_dim = 768, decoder_depth = 12, decoder_num_heads = 12;
  double mlp_ratio = 4.0;
  int64_t diffloss_d = 6, diffloss_w = 1024;
  std::string num_sampling_steps = "100";
  std::string vae;          // name of the KL autoencoder directory beside this one
  std::string draft_model;  // optional: a smaller MAR beside this one that drafts for it (cspd)
  std::vector<std::string> class_names;
  // Sampling defaults recommended for this model (config.json "sampling_defaults").
  int64_t default_num_iter = 64;
  double default_cfg_scale = 1.0, default_temperature = 1.0;
  bool default_cfg_linear = true;  // MAR's "linear" schedule; false: "constant"

  int64_t grid() const { return img_size / vae_stride / patch_size; }
  int64_t seq_len() const { return grid() * grid(); }
  int64_t token_dim() const { return vae_embed_dim * patch_size * patch_size; }
  // Label of the null (unconditional) condition: MAR's fake_latent, not a class_emb row.
  int64_t null_class() const { return class_num; }
  DiffusionHeadConfig head_config() const;
};

StatusOr<MarConfig> ParseMarConfig(const Json& json, const std::string& where);

class Mar {
 public:
  static StatusOr<std::unique_ptr<Mar>> Load(const std::string& dir, const LoadOptions& opts);
  const MarConfig& config() const { return cfg_; }
  const at::TensorOptions& options() const { return options_; }
  const DiffusionHead& head() const { return head_; }

  // tokens [B, S, C], known [B, S] bool (true: the token is given), labels [B] int64 in
  // [0, class_num], class_num meaning the null condition -> z [B, S, decoder_embed_dim], the
  // condition of each position's diffusion head.
  StatusOr<at::Tensor> Forward(const at::Tensor& tokens, const at::Tensor& known,
                               const at::Tensor& labels) const;

  // MAR's unpatchify: tokens [B, S, C] -> latents [B, vae_embed_dim, grid * p, grid * p].
  at::Tensor Unpatchify(const at::Tensor& tokens) const;

 private:
  struct Linear {
    at::Tensor w, b;
  };
  struct Norm {
    at::Tensor w, b;
  };
  struct Block {
    Norm norm1, norm2;
    Linear qkv, proj, fc1, fc2;
  };
  Mar() = default;
  static StatusOr<std::unique_ptr<Mar>> LoadImpl(const std::string& dir, const LoadOptions& opts);
  StatusOr<at::Tensor> ForwardImpl(const at::Tensor& tokens, const at::Tensor& known,
                                   const at::Tensor& labels) const;
  at::Tensor BlockForward(const at::Tensor& x, const Block& b, int64_t heads,
                          const at::Tensor& key_mask) const;

  MarConfig cfg_;
  at::TensorOptions options_;
  at::Tensor class_emb_, fake_latent_, enc_pos_, mask_token_, dec_pos_, diff_pos_;
  Linear z_proj_, decoder_embed_;
  Norm z_proj_ln_, encoder_norm_, decoder_norm_;
  std::vector<Block> encoder_, decoder_;
  DiffusionHead head_;
};

}  // namespace imagegen
