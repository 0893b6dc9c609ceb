#include "engine/decoding/image_request.h"

#include <string>

#include "engine/model/gpt.h"

namespace imagegen {

namespace {

// `ids` lengthened to `len` by pad ids after its first token.
std::vector<int64_t> PadAfterFirst(const std::vector<int64_t>& ids, size_t len, int64_t pad) {
  if (ids.empty() || ids.size() >= len) return ids;
  std::vector<int64_t> out;
  out.reserve(len);
  out.push_back(ids[0]);
  out.insert(out.end(), len - ids.size(), pad);
  out.insert(out.end(), ids.begin() + 1, ids.end());
  return out;
}

// A prompt's (or negative prompt's) length and ids; errors name `field` (too long) or
// `field`_token_ids (an id out of range).
Status CheckPromptIds(const std::vector<int64_t>& ids, const GptConfig& cfg,
                      const std::string& field) {
  const auto n = static_cast<int64_t>(ids.size());
  if (n > cfg.max_prompt_len) {
    return FieldError(field, "has " + std::to_string(n) + " tokens; this model takes at most " +
                                 std::to_string(cfg.max_prompt_len));
  }
  for (int64_t id : ids) {
    if (id < 0 || id >= cfg.text_vocab_size) {
      return FieldError(field + "_token_ids", "id " + std::to_string(id) + " is not in [0, " +
                                                  std::to_string(cfg.text_vocab_size) + ")");
    }
  }
  return OkStatus();
}

}  // namespace

std::vector<int64_t> ConditionTokens(const ImageRequest& r, const GptConfig& cfg) {
  if (!cfg.prompted()) return {r.class_id};
  return PadAfterFirst(r.prompt, r.negative_prompt.size(), cfg.pad_id);
}

std::vector<int64_t> UnconditionalTokens(const ImageRequest& r, const GptConfig& cfg) {
  if (!cfg.prompted()) return {cfg.null_class()};
  if (!r.negative_prompt.empty()) {
    return PadAfterFirst(r.negative_prompt, r.prompt.size(), cfg.pad_id);
  }
  std::vector<int64_t> u = r.prompt;
  for (size_t i = 1; i + 1 < u.size(); ++i) u[i] = cfg.pad_id;
  return u;
}

bool SharesPrefill(const ImageRequest& a, const ImageRequest& b, const GptConfig& cfg) {
  return a.sampling.uses_cfg() == b.sampling.uses_cfg() &&
         ConditionTokens(a, cfg) == ConditionTokens(b, cfg) &&
         (!a.sampling.uses_cfg() || UnconditionalTokens(a, cfg) == UnconditionalTokens(b, cfg));
}

Status ValidateSampledRequest(const ImageRequest& r, const GptConfig& cfg) {
  if (cfg.prompted()) {
    if (r.prompt.empty()) {
      return FieldError("prompt", "this model draws from a prompt; none was given");
    }
    RETURN_IF_ERROR(CheckPromptIds(r.prompt, cfg, "prompt"));
    if (!r.negative_prompt.empty()) {
      if (!r.sampling.uses_cfg()) {
        return FieldError("negative_prompt",
                          "takes effect through guidance only: set cfg_scale > 1");
      }
      RETURN_IF_ERROR(CheckPromptIds(r.negative_prompt, cfg, "negative_prompt"));
    }
  } else {
    if (!r.negative_prompt.empty()) {
      return FieldError("negative_prompt", "this model is class-conditional; it takes no prompt");
    }
    if (!r.prompt.empty()) {
      return FieldError("prompt", "this model is class-conditional; set class_id, not a prompt");
    }
    if (r.class_id < 0 || r.class_id >= cfg.num_classes) {
      return FieldError("class_id", "must be in [0, " + std::to_string(cfg.num_classes) + ")");
    }
  }
  RETURN_IF_ERROR(ValidateSampling(r.sampling, cfg.vocab_size));
  if (r.sampling.uses_cfg() && !cfg.prompted() && !cfg.has_null_class()) {
    return FieldError("cfg_scale", "> 1 needs a model trained with a null class");
  }
  if (r.sampling.uses_cfg() && cfg.prompted() && cfg.pad_id < 0) {
    return FieldError("cfg_scale", "> 1 needs the model's pad_id (its config.json has none)");
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
        d.num_classes != c.num_classes || d.prompted() != c.prompted() ||
        d.text_vocab_size != c.text_vocab_size || d.max_prompt_len < c.max_prompt_len ||
        d.pad_id != c.pad_id || (r.sampling.uses_cfg() && !c.prompted() && !d.has_null_class())) {
      return FieldError("method",
                        "the draft model does not match the target's vocabulary, grid, classes "
                        "or prompts");
    }
  }
  return OkStatus();
}

}  // namespace imagegen
