// What the engine thread asks of one model's scheduler, whatever the model family (discrete
// tokens: ModelScheduler; continuous tokens: MarScheduler). The engine thread owns every
// scheduler (not thread-safe).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <unordered_set>

#include "engine/scheduler/engine.h"
#include "engine/scheduler/job.h"

namespace imagegen {

struct Outcomes {
  int64_t completed = 0, cancelled = 0, expired = 0, failed = 0;
};

class FamilyScheduler {
 public:
  virtual ~FamilyScheduler() = default;
  virtual void Enqueue(std::unique_ptr<Job> job) = 0;
  // One scheduling round: ends the cancelled and expired requests, admits what fits (FIFO),
  // and runs one step if a request is active. Returns whether a step ran.
  virtual bool Tick(const std::unordered_set<int64_t>& cancelled, Clock::time_point now,
                    Outcomes& out) = 0;
  // Ends every request, queued or active, with `status`.
  virtual void EndAll(const Status& status, Outcomes& out) = 0;
  virtual int64_t queued() const = 0;
  virtual int64_t active() const = 0;
  virtual int64_t slots_total() const = 0;
  virtual int64_t slots_used() const = 0;
  bool idle() const { return queued() == 0 && active() == 0; }
  // The earliest deadline of any request (max() if none).
  virtual Clock::time_point next_deadline() const = 0;
};

}  // namespace imagegen
