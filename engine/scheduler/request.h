// What the serving engine takes and gives per request: parameters, step events, results, and
// the observer that receives them. Plain data without LibTorch, so that the server (which must
// not mix LibTorch and protobuf headers) can use it. Thread-safe as plain values are.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/decoding/policy.h"
#include "engine/decoding/sampling_params.h"
#include "engine/image/image.h"
#include "engine/util/status.h"

namespace imagegen {

using Clock = std::chrono::steady_clock;

struct GenerateParams {
  std::string model;  // a loaded model's name; empty: the engine's first model
  // The class: exactly one of an id in [0, num_classes) or one of the model's class names.
  std::optional<int64_t> class_id;
  std::string class_name;
  // Prompted (text-to-image) models instead: the prompt as the model's token ids, template and
  // BOS included (the server tokenizes text with ModelInfo::text_tokenizer_path). Requests
  // with the same ids and CFG use that run at the same time share one prefill.
  std::vector<int64_t> prompt_token_ids;
  // Prompted models with guidance: the unconditional row's prompt, tokenized like
  // prompt_token_ids, instead of the model's unconditional prompt (a negative prompt). The
  // shorter of the two is padded with the model's pad id after its first token.
  std::vector<int64_t> negative_prompt_token_ids;
  std::optional<uint64_t> seed;  // absent: the engine draws one and reports it
  // Absent: the model's recommended values (config.json "sampling_defaults").
  std::optional<double> cfg_scale, temperature, top_p;
  std::optional<int64_t> top_k;
  std::optional<int64_t> cfg_interval;  // LlamaGen's (SamplingParams::cfg_interval); absent: -1
  DecodingPolicy policy;                // PolicyFromPreset(...) plus any explicit parts
  Clock::time_point deadline = Clock::time_point::max();
  bool stream_drafts = false;  // step events carry the drafts the next step will verify
  int64_t preview_every = 0;   // a preview image in every k-th step event; 0: none
  // Instead of preview_every: k previews over the image, preview j due once (j + 1) / (k + 1)
  // of its tokens are decided (the HTTP API's partial images). 0: none.
  int64_t previews = 0;
  bool decode_image = true;  // the result carries the decoded image (else tokens only)
  // Admission (wait_queue.h): a lower priority value is admitted first; within a priority the
  // tenant, then the client within it, with the fewest requests running goes first
  // (EngineOptions::admission "fair"), then the oldest request. A full queue gives up its
  // lowest-ranked waiting request to an arrival that ranks before it (RESOURCE_EXHAUSTED for
  // the request given up).
  int32_t priority = 0;
  std::string client;  // who asks (the server: the request's user, else the caller's address)
  std::string tenant;  // whose (the server: the API key's name; empty: one tenant for all)
};

// Counters of one request so far.
struct RequestCounters {
  int64_t nfe = 0;             // target forwards (a CFG pair once; the first forward counts)
  int64_t draft_forwards = 0;  // draft-model forwards (counted apart from NFE)
  int64_t drafts_verified = 0;
  int64_t drafts_accepted = 0;
  int64_t tokens = 0;  // committed image tokens
};

// One engine step of one request.
struct StepEvent {
  int64_t request_id = 0;
  int64_t step = 0;    // 1-based: this request's target forwards so far
  int64_t window = 0;  // tokens the request fed this step, after the token budget
  std::vector<int32_t> positions, tokens;  // committed this step (raster positions, ids)
  // This step alone: drafts tested before the first rejection and accepted, and for each
  // draft depth d (index d - 1) whether it was tested / accepted (for per-position metrics).
  int64_t verified = 0, accepted = 0;
  std::vector<int64_t> verified_at_depth, accepted_at_depth;
  std::vector<int32_t> draft_positions, draft_tokens;  // when stream_drafts
  RequestCounters totals;
  int64_t total_tokens = 0;  // tokens in the image
  Image preview;             // when due: the grid so far (undecided tokens dimmed)
};

struct RequestStats {
  RequestCounters counters;
  double acceptance_rate = 0;       // drafts accepted / drafts verified
  double step_compression = 0;      // image tokens / NFE
  double mean_accepted_length = 0;  // tokens committed per step
  // [k] = steps that committed k tokens (k >= 1).
  std::vector<int64_t> accepted_length_histogram;
  std::vector<int64_t> verified_at_depth, accepted_at_depth;
  double queue_seconds = 0;      // submission to the first step (a wait after a preemption counts
                                 // in generation_seconds)
  int64_t prefill_forwards = 0;  // forwards that fed prompt chunks (0: copied a sibling's)
  // Times the request gave up its KV slots to a more urgent one (EngineOptions::preemption);
  // each costs the forwards that recompute its entries (counted in prefill_forwards).
  int64_t preemptions = 0;
  double generation_seconds = 0;   // first step to the last token
  double first_token_seconds = 0;  // submission to the first committed token
  double decode_seconds = 0;       // decoding tokens into pixels (VQ)
  // Window control, over the request's steps: nodes fed per step on average; with the goodput
  // controller, the tokens it expected the request to commit (compare counters.tokens), and
  // the predicted and measured times of those steps.
  double mean_window = 0;
  // How much the window moved from one step to the next, on average (nodes): 0 for whole
  // windows until the image's last steps; a Jacobi window cut short loses the drafts its tail
  // was refining.
  double mean_window_change = 0;
  double expected_tokens = 0;
  double predicted_step_seconds = 0, measured_step_seconds = 0;
  // cspd (continuous tokens): residual proposals drawn for rejected drafts, and the rejected
  // drafts whose residual sampling hit its bound and took the fallback.
  int64_t residual_rounds = 0, residual_fallbacks = 0;
  // cspd: the mean over drafted tokens of the squared distance between the draft's token and
  // the token the target draws at the same position, in the same context, with the same noise
  // (the CSpD paper's Table 4, E||x^q - x^p||^2; what trajectory alignment shrinks).
  double draft_target_sq_dist = 0;
};

struct RequestResult {
  int64_t request_id = 0;
  std::string model;
  int64_t class_id = 0;       // class-conditional models
  int64_t prompt_tokens = 0;  // prompted models: the prompt's length in tokens
  uint64_t seed = 0;
  DecodingPolicy policy;
  SamplingParams sampling;
  std::vector<int32_t> tokens;  // grid x grid ids, raster order
  int64_t grid = 0;
  Image image;  // when decode_image
  RequestStats stats;
};

// Receives one request's events on the engine thread, in order: OnStep for every step, then
// exactly one of OnComplete / OnError. Implementations must return quickly (copy and hand
// off) and may call Engine::Cancel, but not Submit or Shutdown. They should not throw: an
// exception from one is caught and dropped where the engine calls it (the request goes on
// after OnStep; it is over after OnError or OnComplete), so that one observer cannot end the
// engine thread and every other request with it.
class RequestObserver {
 public:
  virtual ~RequestObserver() = default;
  virtual void OnStep(const StepEvent& event) {}
  virtual void OnComplete(RequestResult result) = 0;
  virtual void OnError(const Status& status) = 0;
};

// What a client can ask of a loaded model.
struct ModelInfo {
  std::string name;
  int64_t grid = 0;  // tokens per side
  int64_t vocab_size = 0, num_classes = 0;
  std::vector<std::string> class_names;
  int64_t image_width = 0, image_height = 0, channels = 0;
  std::string draft_model;           // empty: none (draft-model methods unavailable)
  std::vector<std::string> methods;  // presets this model can run
  SamplingParams sampling_defaults;
  int64_t max_window = 0;  // image tokens
  int64_t kv_slots = 0;    // KV-cache slots (a CFG request takes two)
  // Continuous-token models (MAR): tokens are token_dim-vectors, not ids (vocab_size 0);
  // kv_slots then counts forward rows; default_num_iter is mar's default iteration count.
  bool continuous = false;
  int64_t token_dim = 0, default_num_iter = 0;
  // Prompted (text-to-image) models: the condition is a prompt of at most max_prompt_len
  // token ids in [0, text_vocab_size) (num_classes 0); the template that wraps a user's text
  // ("{prompt}" marks it) and the tokenizer.json that turns it into ids (empty: ids only).
  bool prompted = false;
  int64_t max_prompt_len = 0, text_vocab_size = 0;
  std::string prompt_template, text_tokenizer_path;
};

}  // namespace imagegen
