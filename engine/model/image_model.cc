#include "engine/model/image_model.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>

#ifndef IMAGEGEN_SOURCE_MODELS_DIR
#define IMAGEGEN_SOURCE_MODELS_DIR "models"
#endif

namespace imagegen {

Status ValidateModelName(const std::string& name) {
  if (name.empty() || name.size() > 128 || name[0] == '.') {
    return FieldError("model", "name must be 1-128 characters and not start with '.'");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return FieldError("model", "name may hold only letters, digits, '.', '_', '-'");
  }
  return OkStatus();
}

StatusOr<ImageModel> LoadImageModel(const std::string& models_dir, const std::string& name,
                                    const LoadOptions& opts, bool with_draft) {
  RETURN_IF_ERROR(ValidateModelName(name));
  const std::string dir = (std::filesystem::path(models_dir) / name).string();
  if (!std::filesystem::is_directory(dir)) {
    return NotFound("model '" + name + "' not found in " + models_dir);
  }
  ImageModel m;
  m.name = name;
  ASSIGN_OR_RETURN(m.gpt, Gpt::Load(dir, opts));
  const GptConfig& cfg = m.gpt->config();
  if (cfg.tokenizer.empty()) {
    return FailedPrecondition(dir + "/config.json: 'tokenizer' must name the VQ model directory");
  }
  RETURN_IF_ERROR(ValidateModelName(cfg.tokenizer));
  ASSIGN_OR_RETURN(
      m.vq, VqDecoder::Load((std::filesystem::path(models_dir) / cfg.tokenizer).string(), opts));
  const VqConfig& vc = m.vq->config();
  if (vc.codebook_size != cfg.vocab_size || vc.grid() * vc.grid() != cfg.block_size) {
    return FailedPrecondition(
        "model '" + name + "': tokenizer '" + cfg.tokenizer + "' has " +
        std::to_string(vc.codebook_size) + " codes on a " + std::to_string(vc.grid()) + "x" +
        std::to_string(vc.grid()) + " grid, but the GPT expects vocab_size " +
        std::to_string(cfg.vocab_size) + " and block_size " + std::to_string(cfg.block_size));
  }
  if (with_draft && !cfg.draft_model.empty()) {
    RETURN_IF_ERROR(ValidateModelName(cfg.draft_model));
    ASSIGN_OR_RETURN(
        m.draft, Gpt::Load((std::filesystem::path(models_dir) / cfg.draft_model).string(), opts));
    const GptConfig& d = m.draft->config();
    if (d.vocab_size != cfg.vocab_size || d.block_size != cfg.block_size ||
        d.num_classes != cfg.num_classes || d.has_null_class() != cfg.has_null_class()) {
      return FailedPrecondition("model '" + name + "': draft model '" + cfg.draft_model +
                                "' differs from it in vocabulary, grid, classes or null class");
    }
  }
  return m;
}

namespace {

// The model's class names for an error message, at most 20 of them.
std::string ClassNameList(const GptConfig& cfg) {
  std::string names;
  for (size_t i = 0; i < cfg.class_names.size() && i < 20; ++i) {
    names += (i ? ", " : "") + cfg.class_names[i];
  }
  if (cfg.class_names.size() > 20) names += ", ...";
  return names;
}

}  // namespace

Status CheckClassId(const GptConfig& cfg, int64_t id) {
  if (id < 0 || id >= cfg.num_classes) {
    return FieldError("class_id", "must be in [0, " + std::to_string(cfg.num_classes) + ")");
  }
  return OkStatus();
}

StatusOr<int64_t> ClassIdByName(const GptConfig& cfg, const std::string& name) {
  for (size_t i = 0; i < cfg.class_names.size(); ++i) {
    if (cfg.class_names[i] == name) return static_cast<int64_t>(i);
  }
  if (cfg.class_names.empty()) {
    return FieldError("class_name", "this model has no class names; set class_id");
  }
  return FieldError("class_name", Quoted(name) + " is not one of this model's classes (" +
                                      ClassNameList(cfg) + "); ids go in class_id");
}

StatusOr<int64_t> ResolveClass(const GptConfig& cfg, const std::string& s) {
  if (StatusOr<int64_t> byname = ClassIdByName(cfg, s); byname.ok()) return byname;
  if (!s.empty() && s.size() < 10 && s.find_first_not_of("0123456789") == std::string::npos) {
    const int64_t id = std::stoll(s);
    if (id < cfg.num_classes) return id;
  }
  return FieldError("class", Quoted(s) + " is neither an id in [0, " +
                                 std::to_string(cfg.num_classes) + ") nor a class name" +
                                 (cfg.class_names.empty() ? "" : " (" + ClassNameList(cfg) + ")"));
}

StatusOr<at::Tensor> TokensToPixels(const VqDecoder& vq, const std::vector<int32_t>& tokens) {
  at::Tensor ids = at::tensor(tokens).to(at::kLong).unsqueeze(0);
  ASSIGN_OR_RETURN(at::Tensor img, vq.Decode(ids));
  return ImageToUint8(img)[0].contiguous();  // [H, W, C]
}

StatusOr<at::Tensor> TokensToPixels(const VqDecoder& vq,
                                    const std::vector<std::vector<int32_t>>& grids) {
  std::vector<at::Tensor> rows;
  for (const auto& g : grids) rows.push_back(at::tensor(g).to(at::kLong));
  ASSIGN_OR_RETURN(at::Tensor img, vq.Decode(at::stack(rows)));
  return ImageToUint8(img).contiguous();  // [B, H, W, C]
}

Image PixelsToImage(const at::Tensor& px) {
  at::Tensor c = px.to(at::kCPU).contiguous();
  Image img;
  img.height = c.size(0);
  img.width = c.size(1);
  img.channels = c.size(2);
  img.pixels.assign(reinterpret_cast<const char*>(c.data_ptr<uint8_t>()),
                    static_cast<size_t>(c.numel()));
  return img;
}

StatusOr<Image> TokensToImage(const VqDecoder& vq, const std::vector<int32_t>& tokens) {
  ASSIGN_OR_RETURN(at::Tensor px, TokensToPixels(vq, tokens));
  return PixelsToImage(px);
}

std::string DefaultModelsDir() {
  if (const char* env = std::getenv("IMAGEGEN_MODELS_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
  return IMAGEGEN_SOURCE_MODELS_DIR;
}

}  // namespace imagegen
