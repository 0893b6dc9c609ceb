#include "engine/decoding/image_request.h"

#include <string>

#include "engine/model/gpt.h"

namespace imagegen {

Status ValidateSampledRequest(const ImageRequest& r, const GptConfig& cfg) {
  if (r.class_id < 0 || r.class_id >= cfg.num_classes) {
    return FieldError("class_id", "must be in [0, " + std::to_string(cfg.num_classes) + ")");
  }
  RETURN_IF_ERROR(ValidateSampling(r.sampling, cfg.vocab_size));
  if (r.sampling.uses_cfg() && !cfg.has_null_class()) {
    return FieldError("cfg_scale", "> 1 needs a model trained with a null class");
  }
  return OkStatus();
}

Status ValidateImageRequest(const ImageRequest& r, const Gpt& target, const Gpt* draft) {
  const GptConfig& c = target.config();
  RETURN_IF_ERROR(ValidateSampledRequest(r, c));
  RETURN_IF_ERROR(ValidatePolicy(r.policy, c.block_size, draft != nullptr));
  if (r.policy.draft == DraftSource::kDraftModel) {
    const GptConfig& d = draft->config();
    if (d.vocab_size != c.vocab_size || d.block_size != c.block_size ||
        d.num_classes != c.num_classes || (r.sampling.uses_cfg() && !d.has_null_class())) {
      return FieldError("method",
                        "the draft model does not match the target's vocabulary, grid or classes");
    }
  }
  return OkStatus();
}

}  // namespace imagegen
