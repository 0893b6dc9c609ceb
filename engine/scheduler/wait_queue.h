// A model's waiting requests and the order admission takes them in (docs/serving.md,
// "Admission"):
//   1. priority: a lower GenerateParams::priority first (vLLM's convention);
//   2. within a priority, with the fair admission (EngineOptions::admission "fair"), the
//      tenant (GenerateParams::tenant: the server's API key name) with the fewest requests
//      running first, then, within the tenant, the client (GenerateParams::client) with the
//      fewest running, so that a client who queues a hundred requests does not make a client
//      who queues one wait for all of them: each client with work waiting gets its turn as
//      slots free up, and a tenant's many clients count as one against other tenants;
//   3. then the oldest request.
// The requests of one Engine::SubmitGroup call (a client's n images) stay together: once one of
// them runs, the others count as their client's first (no running requests), so they follow it
// back to back and copy its prefill; one client can thus be ahead by at most one group.
// And what a full queue gives up for an arrival that ranks before something waiting (Displace):
// the newest request of the lowest priority's tenant, then client, with the most waiting.
// The engine thread owns a WaitQueue (not thread-safe); Displace is a pure function that
// Engine::SubmitGroup calls under its lock on a census of the queue.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/scheduler/job.h"

namespace imagegen {

// (priority, client, tenant): the requests a full queue weighs against each other. Without
// tenants (an empty tenant for all) the order is that of one tenant's clients.
struct WaitClass {
  WaitClass() = default;
  WaitClass(int32_t p, std::string c, std::string t = "")
      : priority(p), client(std::move(c)), tenant(std::move(t)) {}
  int32_t priority = 0;
  std::string client;
  std::string tenant;
  auto operator<=>(const WaitClass&) const = default;
  bool operator==(const WaitClass&) const = default;
};
// How many requests of each class are waiting.
using WaitCensus = std::map<WaitClass, int64_t>;

inline WaitClass ClassOf(const GenerateParams& p) { return {p.priority, p.client, p.tenant}; }

// Why a request gave up its place to an arrival.
enum class ShedReason { kPriority, kFairShare };

struct Shed {
  WaitClass victim;
  ShedReason reason = ShedReason::kPriority;
};

// For `n` arrivals of class `arriving` at a queue holding `census` that has room for
// `room` (< n) more: the waiting requests to give up, one per arrival beyond the room, or
// nullopt when not enough of them rank after the arrivals (the arrivals are refused). A
// request ranks after an arrival when its priority value is higher, or, with `fair`, when it
// has the same priority and its tenant has at least two more requests waiting (at that
// priority) than the arrival's tenant would have, or it has the arrival's tenant and its
// client has at least two more waiting than the arrival's client would have (so that giving
// one up never just swaps which tenant or client has more). Of those, the lowest priority's
// tenant with the most waiting gives up its client with the most waiting.
std::optional<std::vector<Shed>> Displace(WaitCensus census, const WaitClass& arriving, int64_t n,
                                          int64_t room, bool fair);

class WaitQueue {
 public:
  explicit WaitQueue(bool fair) : fair_(fair) {}

  // In id order (a preempted request comes back to its place among the others).
  void Push(std::unique_ptr<Job> job) {
    auto at =
        std::upper_bound(jobs_.begin(), jobs_.end(), job->id,
                         [](int64_t id, const std::unique_ptr<Job>& j) { return id < j->id; });
    jobs_.insert(at, std::move(job));
  }
  bool empty() const { return jobs_.empty(); }
  int64_t size() const { return static_cast<int64_t>(jobs_.size()); }

  // How many requests each tenant and each (tenant, client) has running, and the groups with
  // a request running.
  struct Running {
    std::map<std::string, int64_t> per_tenant;
    std::map<std::pair<std::string, std::string>, int64_t> per_client;  // (tenant, client)
    std::unordered_set<int64_t> groups;
    void Add(const Job& j) {
      per_tenant[j.params.tenant] += 1;
      per_client[{j.params.tenant, j.params.client}] += 1;
      groups.insert(j.group);
    }
    void Remove(const Job& j) {
      per_tenant[j.params.tenant] -= 1;
      per_client[{j.params.tenant, j.params.client}] -= 1;
    }
  };
  // The request admission takes next (null when the queue is empty). It stays next until
  // taken: admission never skips it for a later one that would fit (nothing is overtaken
  // within its rank, so nothing starves).
  Job* Next(const Running& running) const;
  std::unique_ptr<Job> Take(const Job* job);
  // The newest waiting request of `cls` (null if none).
  std::unique_ptr<Job> TakeNewest(const WaitClass& cls);

  WaitCensus Census() const;
  // In arrival order.
  const std::vector<std::unique_ptr<Job>>& jobs() const { return jobs_; }
  template <class Pred>
  void EraseIf(Pred pred) {
    std::erase_if(jobs_, [&](const std::unique_ptr<Job>& j) { return pred(*j); });
  }
  std::vector<std::unique_ptr<Job>> TakeAll();  // empties the queue

 private:
  bool fair_;
  std::vector<std::unique_ptr<Job>> jobs_;  // in arrival order (ids increase)
};

}  // namespace imagegen
