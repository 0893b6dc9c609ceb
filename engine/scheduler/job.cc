#include "engine/scheduler/job.h"

namespace imagegen {

RequestResult FinishedResult(const Job& j, const std::string& model, int64_t grid,
                             const RequestCounters& counters,
                             const std::vector<int32_t>& step_tokens,
                             const std::vector<int64_t>& verified_at_depth,
                             const std::vector<int64_t>& accepted_at_depth,
                             Clock::time_point t_end) {
  const auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  RequestResult res;
  res.request_id = j.id;
  res.model = model;
  res.class_id = j.request.class_id;
  res.prompt_tokens = static_cast<int64_t>(j.request.prompt.size());
  res.seed = j.request.seed;
  res.policy = j.request.policy;
  res.sampling = j.request.sampling;
  res.grid = grid;
  RequestStats& st = res.stats;
  st.counters = counters;
  st.acceptance_rate = counters.drafts_verified > 0
                           ? static_cast<double>(counters.drafts_accepted) /
                                 static_cast<double>(counters.drafts_verified)
                           : 0;
  st.step_compression =
      counters.nfe > 0 ? static_cast<double>(counters.tokens) / static_cast<double>(counters.nfe)
                       : 0;
  st.mean_accepted_length = st.step_compression;
  for (int32_t k : step_tokens) {
    if (static_cast<int64_t>(st.accepted_length_histogram.size()) <= k) {
      st.accepted_length_histogram.resize(static_cast<size_t>(k) + 1, 0);
    }
    st.accepted_length_histogram[static_cast<size_t>(k)] += 1;
  }
  st.verified_at_depth = verified_at_depth;
  st.accepted_at_depth = accepted_at_depth;
  st.queue_seconds = seconds(j.submitted, j.started);
  st.generation_seconds = seconds(j.started, t_end);
  st.first_token_seconds = seconds(j.submitted, j.first_token);
  return res;
}

}  // namespace imagegen
