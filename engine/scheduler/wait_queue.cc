#include "engine/scheduler/wait_queue.h"

#include <algorithm>
#include <tuple>

namespace imagegen {

std::optional<std::vector<Shed>> Displace(WaitCensus census, const WaitClass& arriving, int64_t n,
                                          int64_t room, bool fair) {
  std::vector<Shed> shed;
  int64_t& mine = census[arriving];
  mine += std::max<int64_t>(room, 0);  // the arrivals that fit come first
  for (int64_t k = std::max<int64_t>(room, 0); k < n; ++k) {
    // The worst class: the highest priority value, then the most requests waiting.
    const WaitCensus::value_type* worst = nullptr;
    for (const auto& e : census) {
      if (e.second <= 0) continue;
      if (worst == nullptr || e.first.first > worst->first.first ||
          (e.first.first == worst->first.first && e.second > worst->second)) {
        worst = &e;
      }
    }
    if (worst == nullptr) return std::nullopt;
    Shed s{worst->first, ShedReason::kPriority};
    if (worst->first.first > arriving.first) {
      s.reason = ShedReason::kPriority;
    } else if (fair && worst->first.first == arriving.first && worst->first != arriving &&
               worst->second >= mine + 2) {
      s.reason = ShedReason::kFairShare;
    } else {
      return std::nullopt;
    }
    census[s.victim] -= 1;
    mine += 1;
    shed.push_back(std::move(s));
  }
  return shed;
}

Job* WaitQueue::Next(const Running& running) const {
  Job* best = nullptr;
  std::tuple<int32_t, int64_t> best_key;
  for (const auto& j : jobs_) {
    int64_t load = 0;
    if (fair_ && running.groups.count(j->group) == 0) {
      auto it = running.per_client.find(j->params.client);
      if (it != running.per_client.end()) load = it->second;
    }
    const std::tuple<int32_t, int64_t> key{j->params.priority, load};
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
