// One image to draw: the condition, the seed and how to sample and decode it. The scheduler
// resolves a client's GenerateParams into this once; everything below it takes it as given.
// Plain data; thread-safe as values are.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/decoding/policy.h"
#include "engine/decoding/sampling_params.h"
#include "engine/util/status.h"

namespace imagegen {

class Gpt;
struct GptConfig;

struct ImageRequest {
  int64_t class_id = 0;  // class-conditional models
  // Prompted models (GptConfig::prompted): the prompt's token ids, BOS to the image-start tag,
  // as the model's tokenizer and template give them. The unconditional row's prompt is the
  // model's (UnconditionalPrompt).
  std::vector<int64_t> prompt;
  // With guidance: the unconditional row's prompt instead (a negative prompt); empty: the
  // model's.
  std::vector<int64_t> negative_prompt;
  uint64_t seed = 0;
  SamplingParams sampling;
  DecodingPolicy policy;  // ignored by ArGenerator (always plain AR)
};

// The condition tokens of the request's conditional and unconditional rows: {class_id} and
// {null class}, or the prompt and the model's unconditional prompt (Janus: the prompt with
// every token but the first and the last replaced by the pad id), of the same length. A
// negative prompt is the unconditional row's prompt; the shorter of it and the prompt gets
// pad ids after its first token (BOS), so that both rows have one length and the image tokens
// one set of positions.
std::vector<int64_t> ConditionTokens(const ImageRequest& r, const GptConfig& cfg);
std::vector<int64_t> UnconditionalTokens(const ImageRequest& r, const GptConfig& cfg);

// Whether b can copy a's prefilled KV prefix: the same CFG use and the same conditional and
// (with CFG) unconditional rows.
bool SharesPrefill(const ImageRequest& a, const ImageRequest& b, const GptConfig& cfg);

// The condition and sampling against one model; messages name the field ("class_id",
// "cfg_scale", ...).
Status ValidateSampledRequest(const ImageRequest& r, const GptConfig& cfg);

// All of the request against the target model and the draft model (null when none is loaded):
// condition, sampling and policy. Thread-safe (reads only the models' configs).
Status ValidateImageRequest(const ImageRequest& r, const Gpt& target, const Gpt* draft);

}  // namespace imagegen
