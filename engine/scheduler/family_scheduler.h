// What the engine thread asks of one model's scheduler, whatever the model family (discrete
// tokens: ModelScheduler; continuous tokens: MarScheduler). The engine thread owns every
// scheduler (not thread-safe).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <memory>
#include <stdexcept>
#include <unordered_set>

#include "engine/scheduler/engine.h"
#include "engine/scheduler/job.h"
#include "engine/scheduler/preview_budget.h"
#include "engine/scheduler/wait_queue.h"

namespace imagegen {

// One engine notice (a calibration not reused, the warm-up's figures), through
// EngineOptions::log when set, else on stderr.
inline void Notice(const EngineOptions& o, const std::string& msg) {
  if (o.log) {
    o.log(msg);
  } else {
    std::fprintf(stderr, "imagegen: %s\n", msg.c_str());
  }
}

// What a round ended, for EngineStats (completions, and failures to decode, are counted by the
// DecodeQueue instead).
struct Outcomes {
  int64_t cancelled = 0, expired = 0, failed = 0;
  int64_t shed = 0;       // gave up their place in a full queue (wait_queue.h, Displace)
  int64_t preempted = 0;  // running requests suspended for a more urgent one
};

class FamilyScheduler {
 public:
  explicit FamilyScheduler(const EngineOptions& opts)
      : waiting_(opts.admission == "fair"),
        previews_(opts.preview_share),
        fail_steps_(opts.fail_steps) {}
  virtual ~FamilyScheduler() = default;
  void Enqueue(std::unique_ptr<Job> job) { waiting_.Push(std::move(job)); }
  // The waiting requests by class (Engine::SubmitGroup weighs an arrival against them).
  WaitCensus census() const { return waiting_.Census(); }
  // Ends the newest waiting request of `cls` with `status`; false when none is waiting.
  bool Shed(const WaitClass& cls, const Status& status) {
    std::unique_ptr<Job> j = waiting_.TakeNewest(cls);
    if (!j) return false;
    Discard(*j);
    NotifyError(*j->observer, status);
    return true;
  }
  // One scheduling round: ends the cancelled and expired requests, admits what fits (in the
  // WaitQueue's order), and runs one step if a request is active. Returns whether a step ran.
  virtual bool Tick(const std::unordered_set<int64_t>& cancelled, Clock::time_point now,
                    Outcomes& out) = 0;
  // Ends every request, queued or active, with `status`.
  virtual void EndAll(const Status& status, Outcomes& out) = 0;
  int64_t queued() const { return waiting_.size(); }
  virtual int64_t active() const = 0;
  virtual int64_t slots_total() const = 0;
  virtual int64_t slots_used() const = 0;
  bool idle() const { return queued() == 0 && active() == 0; }
  // EngineOptions::fail_steps_for_seconds, from the next step on (after the warm-up).
  void ArmFailureDrill(double seconds) {
    drill_ = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }
  // Steps that failed since the last one that did not (ModelLoad::failed_steps_in_a_row).
  int64_t failed_steps_in_a_row() const { return failed_in_a_row_; }
  const std::string& last_step_error() const { return last_error_; }
  // The earliest deadline of any request (max() if none).
  virtual Clock::time_point next_deadline() const = 0;

 protected:
  // Frees what a waiting request still holds (a preempted request's suspended state).
  virtual void Discard(Job& job) {}
  // Of the active requests whose preview is due (indices, ascending), those the preview budget
  // allows after a step of `step_seconds`, longest-waiting first (`last_preview(i)`: when i's
  // last preview was served), returned ascending. After serving them, previews_.Spent.
  template <class LastPreview>
  std::vector<size_t> PreviewsThisStep(std::vector<size_t> due, double step_seconds,
                                       LastPreview last_preview) {
    const size_t n = previews_.Grant(due.size(), step_seconds);
    if (n == due.size()) return due;
    std::stable_sort(due.begin(), due.end(),
                     [&](size_t a, size_t b) { return last_preview(a) < last_preview(b); });
    due.resize(n);
    std::sort(due.begin(), due.end());
    return due;
  }
  // Inside a step's error handling, before its forward: throws while EngineOptions::fail_steps
  // is positive, and during the failure drill (ArmFailureDrill).
  void InjectFailure() {
    if (drill_ > Clock::duration::zero()) {
      const Clock::time_point now = Clock::now();
      if (drill_from_ == Clock::time_point()) drill_from_ = now;
      if (now - drill_from_ < drill_) {
        throw std::runtime_error(
            "injected step failure (failure drill, EngineOptions::fail_steps_for_seconds)");
      }
    }
    if (fail_steps_ == nullptr) return;
    int64_t n = fail_steps_->load();
    while (n > 0 && !fail_steps_->compare_exchange_weak(n, n - 1)) {
    }
    if (n > 0) throw std::runtime_error("injected step failure (EngineOptions::fail_steps)");
  }
  // A step's outcome, for failed_steps_in_a_row.
  void CountStep(const Status& st) {
    failed_in_a_row_ = st.ok() ? 0 : failed_in_a_row_ + 1;
    if (!st.ok()) last_error_ = st.message();
  }
  WaitQueue waiting_;
  PreviewBudget previews_;  // EngineOptions::preview_share

 private:
  std::shared_ptr<std::atomic<int64_t>> fail_steps_;
  Clock::duration drill_ = Clock::duration::zero();
  Clock::time_point drill_from_;  // the drill's first step; epoch until then
  int64_t failed_in_a_row_ = 0;
  std::string last_error_;
};

}  // namespace imagegen
