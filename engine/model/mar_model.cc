#include "engine/model/mar_model.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "engine/model/image_model.h"
#include "engine/model/vq_decoder.h"

// The complete Json type: ReadModelConfig returns one by value (json.h only declares it).
#include <nlohmann/json.hpp>

namespace imagegen {

StatusOr<std::string> ModelType(const std::string& models_dir, const std::string& name) {
  RETURN_IF_ERROR(ValidateModelName(name));
  const std::string dir = (std::filesystem::path(models_dir) / name).string();
  if (!std::filesystem::is_directory(dir)) {
    return NotFound("model '" + name + "' not found in " + models_dir);
  }
  ASSIGN_OR_RETURN(Json json, ReadModelConfig(dir));
  JsonFields f(json, dir + "/config.json");
  return f.String("type", "llamagen-gpt");
}

StatusOr<MarModel> LoadMarModel(const std::string& models_dir, const std::string& name,
                                const LoadOptions& opts, bool with_draft) {
  RETURN_IF_ERROR(ValidateModelName(name));
  const auto path = [&](const std::string& n) {
    return (std::filesystem::path(models_dir) / n).string();
  };
  MarModel m;
  m.name = name;
  ASSIGN_OR_RETURN(m.mar, Mar::Load(path(name), opts));
  const MarConfig& cfg = m.mar->config();
  if (cfg.vae.empty()) {
    return FailedPrecondition(path(name) +
                              "/config.json: 'vae' must name the KL autoencoder directory");
  }
  RETURN_IF_ERROR(ValidateModelName(cfg.vae));
  ASSIGN_OR_RETURN(m.vae, KlDecoder::Load(path(cfg.vae), opts));
  const KlConfig& kc = m.vae->config();
  if (kc.embed_dim != cfg.vae_embed_dim || kc.grid() != cfg.grid() * cfg.patch_size) {
    return FailedPrecondition(
        "model '" + name + "': autoencoder '" + cfg.vae + "' has " + std::to_string(kc.embed_dim) +
        " channels on a " + std::to_string(kc.grid()) + "-wide latent grid, but the MAR expects " +
        std::to_string(cfg.vae_embed_dim) + " on " + std::to_string(cfg.grid() * cfg.patch_size));
  }
  if (with_draft && !cfg.draft_model.empty()) {
    RETURN_IF_ERROR(ValidateModelName(cfg.draft_model));
    ASSIGN_OR_RETURN(m.draft, Mar::Load(path(cfg.draft_model), opts));
    const MarConfig& d = m.draft->config();
    if (d.seq_len() != cfg.seq_len() || d.token_dim() != cfg.token_dim() ||
        d.class_num != cfg.class_num || d.patch_size != cfg.patch_size) {
      return FailedPrecondition("model '" + name + "': draft model '" + cfg.draft_model +
                                "' differs from it in tokens, token size or classes");
    }
  }
  return m;
}

Status CheckMarClassId(const MarConfig& cfg, int64_t id) {
  if (id < 0 || id >= cfg.class_num) {
    return FieldError("class_id", "must be in [0, " + std::to_string(cfg.class_num) + "), got " +
                                      std::to_string(id));
  }
  return OkStatus();
}

StatusOr<int64_t> MarClassIdByName(const MarConfig& cfg, const std::string& name) {
  for (size_t i = 0; i < cfg.class_names.size(); ++i) {
    if (cfg.class_names[i] == name) return static_cast<int64_t>(i);
  }
  std::string names;
  for (size_t i = 0; i < cfg.class_names.size() && i < 20; ++i) {
    names += (i ? ", " : "") + cfg.class_names[i];
  }
  return FieldError("class_name", "unknown class " + Quoted(name) +
                                      (names.empty() ? " (the model has no class names)"
                                                     : " (one of: " + names + ")"));
}

StatusOr<at::Tensor> LatentsToPixels(const MarModel& m, const at::Tensor& tokens) {
  ASSIGN_OR_RETURN(at::Tensor img, m.vae->Decode(m.mar->Unpatchify(tokens)));
  // clamp(127.5 x + 128) truncated: the same integers as MAR's round((x + 1) / 2 * 255).
  return ImageToUint8(img);
}

}  // namespace imagegen
