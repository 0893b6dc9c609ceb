#include "engine/scheduler/wait_queue.h"

#include <algorithm>
#include <tuple>

namespace imagegen {

namespace {

// The class of `tenant` at `priority` with the most waiting, other than
// `except` (null if none waits).
const WaitCensus::value_type* MostQueuedClient(const WaitCensus& census, int32_t priority,
                                               const std::string& tenant, const WaitClass* except) {
  const WaitCensus::value_type* worst = nullptr;
  for (const auto& e : census) {
    if (e.second <= 0 || e.first.priority != priority || e.first.tenant != tenant) continue;
    if (except != nullptr && e.first == *except) continue;
    if (worst == nullptr || e.second > worst->second) worst = &e;
  }
  return worst;
}

}  // namespace

std::optional<std::vector<Shed>> Displace(WaitCensus census, const WaitClass& arriving, int64_t n,
                                          int64_t room, bool fair) {
  std::vector<Shed> shed;
  census[arriving] += std::max<int64_t>(room, 0);  // the arrivals that fit come first
  for (int64_t k = std::max<int64_t>(room, 0); k < n; ++k) {
    // Requests waiting per (priority, tenant).
    std::map<std::pair<int32_t, std::string>, int64_t> tenants;
    for (const auto& e : census) {
      if (e.second > 0) tenants[{e.first.priority, e.first.tenant}] += e.second;
    }
    // The worst tenant: the highest priority value, then the most requests waiting.
    const std::pair<const std::pair<int32_t, std::string>, int64_t>* worst = nullptr;
    for (const auto& e : tenants) {
      if (worst == nullptr || e.first.first > worst->first.first ||
          (e.first.first == worst->first.first && e.second > worst->second)) {
        worst = &e;
      }
    }
    if (worst == nullptr) return std::nullopt;
    // Its client with the most waiting.
    const WaitClass worst_client =
        MostQueuedClient(census, worst->first.first, worst->first.second, nullptr)->first;
    std::optional<Shed> s;
    if (worst->first.first > arriving.priority) {
      s = Shed{worst_client, ShedReason::kPriority};
    } else if (fair && worst->first.first == arriving.priority) {
      const auto mine_t = tenants.find({arriving.priority, arriving.tenant});
      const int64_t mine_tenant = mine_t == tenants.end() ? 0 : mine_t->second;
      if (worst->first.second != arriving.tenant && worst->second >= mine_tenant + 2) {
        s = Shed{worst_client, ShedReason::kFairShare};
      } else {
        // Within the arrival's tenant: its client with the most waiting.
        const auto* w = MostQueuedClient(census, arriving.priority, arriving.tenant, &arriving);
        if (w != nullptr && w->second >= census[arriving] + 2) {
          s = Shed{w->first, ShedReason::kFairShare};
        }
      }
    }
    if (!s.has_value()) return std::nullopt;
    census[s->victim] -= 1;
    census[arriving] += 1;
    shed.push_back(std::move(*s));
  }
  return shed;
}

Job* WaitQueue::Next(const Running& running) const {
  Job* best = nullptr;
  std::tuple<int32_t, int64_t, int64_t> best_key;
  for (const auto& j : jobs_) {
    int64_t tenant_load = 0, client_load = 0;
    if (fair_ && running.groups.count(j->group) == 0) {
      auto t = running.per_tenant.find(j->params.tenant);
      if (t != running.per_tenant.end()) tenant_load = t->second;
      auto c = running.per_client.find({j->params.tenant, j->params.client});
      if (c != running.per_client.end()) client_load = c->second;
    }
    const std::tuple<int32_t, int64_t, int64_t> key{j->params.priority, tenant_load, client_load};
    if (best == nullptr || key < best_key) {  // strict: the oldest of equals stays
      best = j.get();
      best_key = key;
    }
  }
  return best;
}

std::unique_ptr<Job> WaitQueue::Take(const Job* job) {
  for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
    if (it->get() == job) {
      std::unique_ptr<Job> j = std::move(*it);
      jobs_.erase(it);
      return j;
    }
  }
  return nullptr;
}

std::unique_ptr<Job> WaitQueue::TakeNewest(const WaitClass& cls) {
  for (auto it = jobs_.rbegin(); it != jobs_.rend(); ++it) {
    if (ClassOf((*it)->params) == cls) return Take(it->get());
  }
  return nullptr;
}

WaitCensus WaitQueue::Census() const {
  WaitCensus c;
  for (const auto& j : jobs_) c[ClassOf(j->params)] += 1;
  return c;
}

std::vector<std::unique_ptr<Job>> WaitQueue::TakeAll() {
  std::vector<std::unique_ptr<Job>> all;
  all.swap(jobs_);
  return all;
}

}  // namespace imagegen
