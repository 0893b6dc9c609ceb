// The scheduler of one continuous-token model (MAR): a waiting queue, admission up to `slots`
// concurrent rows, and a step that co-batches every active request, whatever its method:
//   mar   one MAR iteration (the tokens its cosine schedule reveals) in the shared target forward
//   cspd  (seed 000, Algorithm 1) a pre-fill of target-only tokens, then per step: gamma draft
//         forwards (one token each, batched across requests), one target forward whose rows
//         hold every request's verification contexts, the acceptance rule (cspd_rule.h) and
//         the residual sampler; the first rejected token is replaced and the rest dropped, or,
//         when all pass, the target's own next token is added (the bonus token).
// MAR has no KV cache: a slot is a forward row (two with CFG); every step re-encodes the known
// tokens. A request's noise (its order and every token's trajectory) is keyed by its seed and
// positions, so its draws do not depend on the batch; its image may still differ by rounding
// alongside others (the forward is not batch-invariant, docs/continuous.md).
// The engine thread owns it (not thread-safe).
#pragma once

#include <memory>
#include <unordered_set>
#include <vector>

#include "engine/model/mar_model.h"
#include "engine/scheduler/decode_queue.h"
#include "engine/scheduler/engine.h"
#include "engine/scheduler/family_scheduler.h"

namespace imagegen {

// The forward rows one step of a request takes: 1 for mar, window + 1 verification contexts for
// cspd (1 with verified_context), twice with guidance (cfg_scale != 1). Admission and Submit's
// check (Engine) both count with it.
int64_t MarStepRows(const DecodingPolicy& policy, double cfg_scale);

class MarScheduler : public FamilyScheduler {
 public:
  // `model`, `opts`, `decoder` and `listener` (may be null) must outlive the scheduler.
  // Finished images are decoded, and their requests completed, through `decoder`.
  MarScheduler(const MarModel& model, int64_t slots, const EngineOptions& opts,
               DecodeQueue& decoder, EngineListener* listener);
  ~MarScheduler() override;

  bool Tick(const std::unordered_set<int64_t>& cancelled, Clock::time_point now,
            Outcomes& out) override;
  void EndAll(const Status& status, Outcomes& out) override;
  int64_t active() const override { return static_cast<int64_t>(active_.size()); }
  int64_t slots_total() const override { return slots_; }
  int64_t slots_used() const override { return used_; }
  Clock::time_point next_deadline() const override;

 private:
  struct Active;
  void Admit(Outcomes& out);
  Status StepImpl();
  void Step(Outcomes& out);
  StepEvent Event(Active& a);
  void AddPreviews(const std::vector<size_t>& due, std::vector<StepEvent>& events);
  void Finish(Active& a);
  void End(Active& a, const Status& status);

  const MarModel& model_;
  const EngineOptions& opts_;
  DecodeQueue& decoder_;
  EngineListener* listener_;
  int64_t slots_, used_ = 0;
  std::vector<std::unique_ptr<Active>> active_;  // in admission order
};

}  // namespace imagegen
