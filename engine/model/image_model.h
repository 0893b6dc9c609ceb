// An image model as served: a GPT directory in a models directory plus the VQ tokenizer its
// config.json names ("tokenizer"). Models are addressed by name, never by client paths.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/image/image.h"
#include "engine/model/gpt.h"
#include "engine/model/models_dir.h"
#include "engine/model/vq_decoder.h"

namespace imagegen {

struct ImageModel {
  std::string name;
  std::unique_ptr<Gpt> gpt;
  std::unique_ptr<VqDecoder> vq;
  std::unique_ptr<Gpt> draft;  // the config's "draft_model", when it names one
};

// Fails with INVALID_ARGUMENT for names that are not plain [A-Za-z0-9._-] (no paths).
Status ValidateModelName(const std::string& name);

// Loads the GPT, its tokenizer and (with `with_draft`) the draft GPT its config names, and
// checks that they fit together (codes, grid, classes).
StatusOr<ImageModel> LoadImageModel(const std::string& models_dir, const std::string& name,
                                    const LoadOptions& opts, bool with_draft = false);

// An id in [0, num_classes), else INVALID_ARGUMENT naming "class_id".
Status CheckClassId(const GptConfig& cfg, int64_t id);
// The id of an exact class name, else INVALID_ARGUMENT naming "class_name". A name that looks
// like a number is still a name (a model may call its classes "0".."9" in any order).
StatusOr<int64_t> ClassIdByName(const GptConfig& cfg, const std::string& name);
// For local tools' --class flags only: a class name, else a decimal id ("sneaker" or "7").
StatusOr<int64_t> ResolveClass(const GptConfig& cfg, const std::string& class_or_id);

// Tokens -> uint8 pixels [H, W, C] (grey or RGB as the tokenizer outputs), contiguous.
StatusOr<at::Tensor> TokensToPixels(const VqDecoder& vq, const std::vector<int32_t>& tokens);
// Several grids in one decoder call -> uint8 pixels [B, H, W, C].
StatusOr<at::Tensor> TokensToPixels(const VqDecoder& vq,
                                    const std::vector<std::vector<int32_t>>& grids);
// uint8 pixels [H, W, C] -> an Image (plain bytes, for encoding at the edge).
Image PixelsToImage(const at::Tensor& px);
// Both of the above.
StatusOr<Image> TokensToImage(const VqDecoder& vq, const std::vector<int32_t>& tokens);

}  // namespace imagegen
