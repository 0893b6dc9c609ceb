// A continuous-token model as served: a MAR directory in a models directory, the KL
// autoencoder its config.json names ("vae") and, optionally, the smaller MAR that drafts for it
// ("draft_model"). Models are addressed by name, never by client paths.
#pragma once

#include <memory>
#include <string>

#include "engine/image/image.h"
#include "engine/model/kl_decoder.h"
#include "engine/model/mar.h"

namespace imagegen {

struct MarModel {
  std::string name;
  std::unique_ptr<Mar> mar;
  std::unique_ptr<KlDecoder> vae;
  std::unique_ptr<Mar> draft;  // the config's "draft_model", when it names one
};

// The "type" in <models_dir>/<name>/config.json: "llamagen-gpt" when absent, "mar", ...
StatusOr<std::string> ModelType(const std::string& models_dir, const std::string& name);

// Loads the MAR, its autoencoder and (with `with_draft`) its draft, and checks that they fit
// together (latent grid and channels; the draft's sequence, token size and classes).
StatusOr<MarModel> LoadMarModel(const std::string& models_dir, const std::string& name,
                                const LoadOptions& opts, bool with_draft = false);

// An id in [0, class_num), else INVALID_ARGUMENT naming "class_id"; a class name, else one
// naming "class_name".
Status CheckMarClassId(const MarConfig& cfg, int64_t id);
StatusOr<int64_t> MarClassIdByName(const MarConfig& cfg, const std::string& name);

// Tokens [B, S, C] -> uint8 pixels [B, H, W, channels] on the CPU.
StatusOr<at::Tensor> LatentsToPixels(const MarModel& m, const at::Tensor& tokens);

}  // namespace imagegen
