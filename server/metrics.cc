#include "server/metrics.h"

#include <prometheus/metric_family.h>

namespace imagegen::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

const Histogram::BucketBoundaries kLatency = {0.05, 0.1, 0.25, 0.5, 1,   2,  4,
                                              8,    15,  30,   60,  120, 300};
const Histogram::BucketBoundaries kQueue = {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1,
                                            2,     4,    8,    15,  30,   60};
const Histogram::BucketBoundaries kFirstToken = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                 0.5,   1,    2.5,   5,    10,  30};
const Histogram::BucketBoundaries kStep = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                           0.05,   0.1,   0.25,   0.5,   1};
const Histogram::BucketBoundaries kStepTokens = {1,   2,   4,   8,    16,   32,  64,
                                                 128, 256, 512, 1024, 2048, 4096};
const Histogram::BucketBoundaries kStepRequests = {1, 2, 4, 8, 16, 32, 64, 128};
const Histogram::BucketBoundaries kWindow = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256};
const Histogram::BucketBoundaries kCostRatio = {0.5, 0.67, 0.8, 0.9, 1, 1.11, 1.25, 1.5, 2, 3};
const Histogram::BucketBoundaries kAccepted = {1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64};
const Histogram::BucketBoundaries kNfe = {8,   16,  32,  48,  64,  96,  128,
                                          160, 196, 256, 384, 512, 1024};
const Histogram::BucketBoundaries kCompression = {1, 1.25, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12};

// The engine's load, read when Prometheus scrapes.
class EngineGauges : public prometheus::Collectable {
 public:
  void Set(const Engine* e) { engine_.store(e); }
  void SetDraining() { draining_.store(true); }

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::ClientMetric;
    using prometheus::MetricFamily;
    using prometheus::MetricType;
    const Engine* e = engine_.load();
    MetricFamily ready{"imagegen_ready",
                       "1 when the models are loaded and the server accepts requests",
                       MetricType::Gauge,
                       {}};
    ClientMetric r;
    r.gauge.value = e != nullptr && !draining_.load() ? 1 : 0;
    ready.metric.push_back(r);
    std::vector<MetricFamily> out = {ready};
    if (e == nullptr) return out;
    MetricFamily queued{
        "imagegen_queue_depth", "Requests waiting for a KV-cache slot", MetricType::Gauge, {}};
    MetricFamily active{
        "imagegen_active_requests", "Requests holding KV-cache slots", MetricType::Gauge, {}};
    MetricFamily used{"imagegen_kv_cache_slots_in_use",
                      "KV-cache slots taken (a request with guidance takes two)",
                      MetricType::Gauge,
                      {}};
    MetricFamily total{
        "imagegen_kv_cache_slots", "KV-cache slots allocated", MetricType::Gauge, {}};
    for (const ModelLoad& l : e->Stats().models) {
      auto add = [&](MetricFamily& f, double v) {
        ClientMetric m;
        m.label.push_back({"model", l.model});
        m.gauge.value = v;
        f.metric.push_back(m);
      };
      add(queued, static_cast<double>(l.queued));
      add(active, static_cast<double>(l.active));
      add(used, static_cast<double>(l.slots_used));
      add(total, static_cast<double>(l.slots_total));
    }
    out.push_back(queued);
    out.push_back(active);
    out.push_back(used);
    out.push_back(total);
    MetricFamily shed{"imagegen_queue_shed_total",
                      "Waiting requests that gave up their place in a full queue to an arrival "
                      "of higher priority or of a client with fewer requests waiting "
                      "(docs/serving.md, Admission); they end RESOURCE_EXHAUSTED",
                      MetricType::Counter,
                      {}};
    MetricFamily preempted{"imagegen_preemptions_total",
                           "Times a running request gave up its KV slots to a more urgent one "
                           "(--preemption); it waits again and recomputes its entries",
                           MetricType::Counter,
                           {}};
    const EngineStats es = e->Stats();
    ClientMetric c;
    c.counter.value = static_cast<double>(es.shed);
    shed.metric.push_back(c);
    out.push_back(shed);
    c.counter.value = static_cast<double>(es.preempted);
    preempted.metric.push_back(c);
    out.push_back(preempted);
    if (es.cpu_threads_max > 0) {
      MetricFamily threads{"imagegen_engine_cpu_threads",
                           "The engine thread's LibTorch intra-op threads now; below "
                           "imagegen_engine_cpu_threads_max while --adaptive-cpu-threads has "
                           "lowered them (other busy work on the daemon's cores)",
                           MetricType::Gauge,
                           {}};
      MetricFamily most{"imagegen_engine_cpu_threads_max",
                        "The engine thread's intra-op threads at start (--cpu-threads)",
                        MetricType::Gauge,
                        {}};
      MetricFamily changes{"imagegen_engine_cpu_thread_changes_total",
                           "Times --adaptive-cpu-threads changed the engine thread's intra-op "
                           "threads: down (its run-queue wait reached a fifth of its step time, "
                           "or a try above did not hold) or up (a try)",
                           MetricType::Counter,
                           {}};
      ClientMetric g;
      g.gauge.value = static_cast<double>(es.cpu_threads);
      threads.metric.push_back(g);
      g.gauge.value = static_cast<double>(es.cpu_threads_max);
      most.metric.push_back(g);
      for (const auto& [direction, n] :
           {std::pair<const char*, int64_t>{"down", es.cpu_threads_lowered},
            {"up", es.cpu_threads_raised}}) {
        ClientMetric m;
        m.label.push_back({"direction", direction});
        m.counter.value = static_cast<double>(n);
        changes.metric.push_back(m);
      }
      out.push_back(threads);
      out.push_back(most);
      out.push_back(changes);
    }
    MetricFamily waiting{"imagegen_engine_stalled_seconds",
                         "Seconds the engine's work has waited on its thread without it moving "
                         "(engine: no round finished; decoder: no image decoded); 0 while the "
                         "thread has no work. Above --engine-stall-seconds health is NOT_SERVING",
                         MetricType::Gauge,
                         {}};
    const EngineProgress p = e->Progress();
    for (const auto& [thread, seconds] :
         {std::pair<const char*, double>{"engine", p.engine_seconds},
          {"decoder", p.decoder_seconds}}) {
      ClientMetric m;
      m.label.push_back({"thread", thread});
      m.gauge.value = seconds;
      waiting.metric.push_back(m);
    }
    out.push_back(waiting);
    MetricFamily failing{"imagegen_engine_failed_steps_in_a_row",
                         "Steps of the model that failed (their requests ended INTERNAL) since "
                         "its last step that did not; at --engine-failed-steps health is "
                         "NOT_SERVING",
                         MetricType::Gauge,
                         {}};
    for (const ModelLoad& l : es.models) {
      ClientMetric m;
      m.label.push_back({"model", l.model});
      m.gauge.value = static_cast<double>(l.failed_steps_in_a_row);
      failing.metric.push_back(m);
    }
    out.push_back(failing);
    return out;
  }

 private:
  std::atomic<const Engine*> engine_{nullptr};
  std::atomic<bool> draining_{false};
};

}  // namespace

std::string PositionLabel(int64_t d) {
  if (d <= 8) return std::to_string(d);
  if (d <= 16) return "9-16";
  if (d <= 32) return "17-32";
  if (d <= 64) return "33-64";
  if (d <= 128) return "65-128";
  return "129+";
}

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      gauges_(std::make_shared<EngineGauges>()),
      requests_(BuildCounter()
                    .Name("imagegen_requests_total")
                    .Help("Generate calls and HTTP image generations by outcome (ok, "
                          "invalid_argument, not_found, "
                          "resource_exhausted, unavailable, cancelled, deadline_exceeded, "
                          "unauthenticated, permission_denied, aborted (a stream whose client "
                          "stopped reading), "
                          "internal)")
                    .Register(*registry_)),
      key_requests_(BuildCounter()
                        .Name("imagegen_key_requests_total")
                        .Help("Calls of each named API key by outcome (as "
                              "imagegen_requests_total)")
                        .Register(*registry_)),
      key_images_(BuildCounter()
                      .Name("imagegen_key_images_total")
                      .Help("Images sent to each named API key's callers")
                      .Register(*registry_)),
      key_tokens_(BuildCounter()
                      .Name("imagegen_key_image_tokens_total")
                      .Help("Image tokens of the images sent to each named API key's callers")
                      .Register(*registry_)),
      key_nfe_(BuildCounter()
                   .Name("imagegen_key_target_forwards_total")
                   .Help("Target-model forward passes (NFE) of the images sent to each named "
                         "API key's callers: the compute they used")
                   .Register(*registry_)),
      drafted_(BuildCounter()
                   .Name("imagegen_draft_tokens_total")
                   .Help("Draft tokens verified against the target (before each step's first "
                         "rejection); acceptance rate = accepted / draft")
                   .Register(*registry_)),
      accepted_(BuildCounter()
                    .Name("imagegen_accepted_tokens_total")
                    .Help("Draft tokens accepted")
                    .Register(*registry_)),
      drafted_pos_(BuildCounter()
                       .Name("imagegen_draft_tokens_by_position_total")
                       .Help("Draft tokens verified, by position in the step's accepted path "
                             "(1 = the first draft after the last committed token)")
                       .Register(*registry_)),
      accepted_pos_(BuildCounter()
                        .Name("imagegen_accepted_tokens_by_position_total")
                        .Help("Draft tokens accepted, by position in the step's accepted path")
                        .Register(*registry_)),
      nfe_(BuildCounter()
               .Name("imagegen_target_forwards_total")
               .Help("Target-model forward passes (NFE; a CFG pair counts once); NFE per image "
                     "= this / imagegen_images_total")
               .Register(*registry_)),
      draft_forwards_(BuildCounter()
                          .Name("imagegen_draft_model_forwards_total")
                          .Help("Draft-model forward passes (not included in NFE)")
                          .Register(*registry_)),
      images_(BuildCounter()
                  .Name("imagegen_images_total")
                  .Help("Images generated")
                  .Register(*registry_)),
      steps_(BuildCounter()
                 .Name("imagegen_engine_steps_total")
                 .Help("Engine steps (one target forward for all active requests of a model)")
                 .Register(*registry_)),
      accepted_length_(BuildHistogram()
                           .Name("imagegen_accepted_length_tokens")
                           .Help("Tokens a request committed in one step (accepted drafts + 1)")
                           .Register(*registry_)),
      nfe_per_image_(BuildHistogram()
                         .Name("imagegen_nfe_per_image")
                         .Help("Target-model forward passes per image")
                         .Register(*registry_)),
      compression_(BuildHistogram()
                       .Name("imagegen_step_compression_ratio")
                       .Help("Image tokens / NFE per image (1 for autoregressive decoding)")
                       .Register(*registry_)),
      first_token_(BuildHistogram()
                       .Name("imagegen_time_to_first_token_seconds")
                       .Help("Arrival to the first committed token")
                       .Register(*registry_)),
      latency_(
          BuildHistogram()
              .Name("imagegen_request_duration_seconds")
              .Help("Arrival to an image's response (a stream's final message for it), per image "
                    "sent")
              .Register(*registry_)),
      queue_time_(BuildHistogram()
                      .Name("imagegen_request_queue_seconds")
                      .Help("Time waiting for a KV-cache slot")
                      .Register(*registry_)),
      generation_(BuildHistogram()
                      .Name("imagegen_request_generation_seconds")
                      .Help("First engine step to the last token")
                      .Register(*registry_)),
      decode_(BuildHistogram()
                  .Name("imagegen_request_decode_seconds")
                  .Help("Last token to the decoded image: the wait for the decoder (the decode "
                        "thread's queue) and the VQ decode itself; images that are not decoded "
                        "are not counted")
                  .Register(*registry_)),
      step_duration_(BuildHistogram()
                         .Name("imagegen_step_duration_seconds")
                         .Help("One engine step: drafting, target forward, verification, events")
                         .Register(*registry_)),
      step_tokens_(BuildHistogram()
                       .Name("imagegen_step_tokens")
                       .Help("Tokens fed to the target model in one step (CFG rows included)")
                       .Register(*registry_)),
      step_requests_(BuildHistogram()
                         .Name("imagegen_step_requests")
                         .Help("Requests sharing one step")
                         .Register(*registry_)),
      window_(BuildHistogram()
                  .Name("imagegen_request_window_tokens")
                  .Help("Nodes one request fed the target in one step: the window its method "
                        "wanted, or what the window control granted")
                  .Register(*registry_)),
      step_cost_ratio_(BuildHistogram()
                           .Name("imagegen_step_cost_ratio")
                           .Help("Measured over predicted time of a step (the step-cost model "
                                 "of the goodput controller; 1 = exact)")
                           .Register(*registry_)),
      step_predicted_(BuildCounter()
                          .Name("imagegen_step_predicted_seconds_total")
                          .Help("Step time the step-cost model predicted, for the steps it "
                                "predicted")
                          .Register(*registry_)),
      step_measured_(BuildCounter()
                         .Name("imagegen_step_measured_seconds_total")
                         .Help("Measured time of the same steps (the batch step alone)")
                         .Register(*registry_)),
      cpu_wait_(BuildCounter()
                    .Name("imagegen_engine_cpu_wait_seconds_total")
                    .Help("Seconds the engine thread waited, runnable, for a CPU during the "
                          "model's steps (Linux schedstat): other work on the daemon's cores. "
                          "Over imagegen_step_duration_seconds_sum, the share of step time lost")
                    .Register(*registry_)),
      expected_tokens_(BuildCounter()
                           .Name("imagegen_controller_expected_tokens_total")
                           .Help("Image tokens the goodput controller expected its steps to "
                                 "commit")
                           .Register(*registry_)),
      realised_tokens_(BuildCounter()
                           .Name("imagegen_controller_committed_tokens_total")
                           .Help("Image tokens those steps committed")
                           .Register(*registry_)),
      window_limited_(BuildCounter()
                          .Name("imagegen_steps_window_limited_total")
                          .Help("Steps in which some request was granted less than its "
                                "whole window (by the controller or the token budget)")
                          .Register(*registry_)),
      graph_captures_(BuildCounter()
                          .Name("imagegen_cuda_graph_captures_total")
                          .Help("CUDA graphs captured (a shape bucket's first forward; one-off, "
                                "tens of replays' time; the step-cost model counts such a step as "
                                "at most 2x its prediction)")
                          .Register(*registry_)),
      graph_capture_failures_(BuildCounter()
                                  .Name("imagegen_cuda_graph_capture_failures_total")
                                  .Help("CUDA graph captures that failed: the step went on with "
                                        "its eager forward, and that shape bucket runs without a "
                                        "graph from then on (slower); the log says why")
                                  .Register(*registry_)),
      info_(BuildGauge()
                .Name("imagegen_build_info")
                .Help("Always 1; the version in a label")
                .Register(*registry_)),
      calls_opened_(BuildCounter()
                        .Name("imagegen_calls_opened_total")
                        .Help("Generate and GenerateStream calls and HTTP image generations "
                              "begun; opened - closed = calls open now (equal once every call "
                              "is done)")
                        .Register(*registry_)
                        .Add({})),
      calls_closed_(BuildCounter()
                        .Name("imagegen_calls_closed_total")
                        .Help("Generate and GenerateStream calls that gRPC is done with, and "
                              "HTTP image generations whose connection is done")
                        .Register(*registry_)
                        .Add({})),
      call_retries_(BuildCounter()
                        .Name("imagegen_call_retries_total")
                        .Help("Calls that arrived as a gRPC client's retry of a failed attempt "
                              "(grpc-previous-rpc-attempts > 0): work another replica, or this "
                              "one, could not do")
                        .Register(*registry_)
                        .Add({})),
      stream_stalls_(BuildCounter()
                         .Name("imagegen_stream_stalls_total")
                         .Help("Streams ended because their client read nothing for the stall "
                               "limit (--stream-stall-seconds)")
                         .Register(*registry_)
                         .Add({})),
      engine_unhealthy_(BuildCounter()
                            .Name("imagegen_engine_unhealthy_total")
                            .Help("Times health turned NOT_SERVING for the engine, by reason: "
                                  "stalled (its work waited --engine-stall-seconds on a thread "
                                  "that did not move), failing (--engine-failed-steps steps of "
                                  "a model failed in a row)")
                            .Register(*registry_)),
      engine_probes_(BuildCounter()
                         .Name("imagegen_engine_probes_total")
                         .Help("Probes of a failing model (--engine-probe-seconds: one step of "
                               "an AR request while health is NOT_SERVING for failing steps), "
                               "by outcome: ok (the step succeeded), failed, not_run")
                         .Register(*registry_)),
      tls_not_after_(BuildGauge()
                         .Name("imagegen_tls_certificate_expiration_timestamp_seconds")
                         .Help("End of validity (notAfter, Unix seconds) of the first "
                               "certificate of the --tls-cert chain served; absent without TLS")
                         .Register(*registry_)),
      tls_reloads_(BuildCounter()
                       .Name("imagegen_tls_certificate_reloads_total")
                       .Help("Reads of changed --tls-cert, --tls-key or --tls-client-ca "
                             "files (checked every --tls-poll-seconds and on SIGHUP), by "
                             "outcome: ok (served from then on), error (refused: not a "
                             "certificate and its key, or a CA bundle that does not parse; the "
                             "last good one stays, and the read is tried again each poll)")
                       .Register(*registry_)) {
  info_.Add({{"version", "0.1.0"}}).Set(1);
  for (const char* reason : {"stalled", "failing"}) engine_unhealthy_.Add({{"reason", reason}});
}

void Metrics::OnTlsCertificate(int64_t not_after) {
  tls_not_after_.Add({}).Set(static_cast<double>(not_after));
  tls_reloads_.Add({{"outcome", "ok"}});
  tls_reloads_.Add({{"outcome", "error"}});
}

void Metrics::OnTlsReload(bool ok) {
  tls_reloads_.Add({{"outcome", ok ? "ok" : "error"}}).Increment();
}

void Metrics::OnCallOpened(bool retry) {
  calls_opened_.Increment();
  if (retry) call_retries_.Increment();
}
void Metrics::OnCallClosed() { calls_closed_.Increment(); }
void Metrics::OnStreamStalled() { stream_stalls_.Increment(); }
void Metrics::OnEngineUnhealthy(const std::string& reason) {
  engine_unhealthy_.Add({{"reason", reason}}).Increment();
}
void Metrics::OnEngineProbe(const std::string& model, const std::string& outcome) {
  engine_probes_.Add({{"model", ModelLabel(model)}, {"outcome", outcome}}).Increment();
}

void Metrics::SetEngine(const Engine* engine) {
  {
    std::lock_guard<std::mutex> l(mu_);
    for (const ModelInfo& m : engine->Models()) models_.push_back(m.name);
  }
  for (const ModelInfo& m : engine->Models()) {
    // From 0: the alert on it (deploy/prometheus-rules.yml) must see a series that exists
    // before its first failure.
    graph_capture_failures_.Add({{"model", m.name}});
    for (const char* outcome : {"ok", "failed"}) {
      engine_probes_.Add({{"model", m.name}, {"outcome", outcome}});
    }
  }
  static_cast<EngineGauges*>(gauges_.get())->Set(engine);
}

void Metrics::SetDraining() { static_cast<EngineGauges*>(gauges_.get())->SetDraining(); }

std::string Metrics::ModelLabel(const std::string& model) const {
  std::lock_guard<std::mutex> l(mu_);
  if (model.empty()) return models_.empty() ? "unknown" : models_[0];
  for (const auto& m : models_) {
    if (m == model) return m;
  }
  return "unknown";
}

Metrics::PerMethod& Metrics::For(const std::string& model, const std::string& method) {
  std::lock_guard<std::mutex> l(mu_);
  auto key = std::make_pair(model, method);
  auto it = per_method_.find(key);
  if (it != per_method_.end()) return it->second;
  const prometheus::Labels lb = {{"model", model}, {"method", method}};
  PerMethod p;
  p.drafted = &drafted_.Add(lb);
  p.accepted = &accepted_.Add(lb);
  p.nfe = &nfe_.Add(lb);
  p.draft_forwards = &draft_forwards_.Add(lb);
  p.images = &images_.Add(lb);
  p.accepted_length = &accepted_length_.Add(lb, kAccepted);
  p.nfe_per_image = &nfe_per_image_.Add(lb, kNfe);
  p.compression = &compression_.Add(lb, kCompression);
  p.first_token = &first_token_.Add(lb, kFirstToken);
  p.latency = &latency_.Add(lb, kLatency);
  p.queue_time = &queue_time_.Add(lb, kQueue);
  p.generation = &generation_.Add(lb, kLatency);
  p.decode = &decode_.Add(lb, kStep);
  p.window = &window_.Add(lb, kWindow);
  return per_method_.emplace(key, std::move(p)).first->second;
}

void Metrics::OnWarmupStep(const StepSample& s) {
  if (s.graph_capture_failures > 0) {
    graph_capture_failures_.Add({{"model", s.model}})
        .Increment(static_cast<double>(s.graph_capture_failures));
  }
}

void Metrics::OnStep(const StepSample& s) {
  const prometheus::Labels lb = {{"model", s.model}};
  steps_.Add(lb).Increment();
  step_duration_.Add(lb, kStep).Observe(s.seconds);
  step_tokens_.Add(lb, kStepTokens).Observe(static_cast<double>(s.tokens));
  step_requests_.Add(lb, kStepRequests).Observe(static_cast<double>(s.requests));
  if (s.budget_limited) window_limited_.Add(lb).Increment();
  if (s.graph_captures > 0) {
    graph_captures_.Add(lb).Increment(static_cast<double>(s.graph_captures));
  }
  OnWarmupStep(s);  // its capture failures
  if (s.predicted_seconds > 0) {
    step_cost_ratio_.Add(lb, kCostRatio).Observe(s.step_seconds / s.predicted_seconds);
    step_predicted_.Add(lb).Increment(s.predicted_seconds);
    step_measured_.Add(lb).Increment(s.step_seconds);
  }
  if (s.cpu_wait_seconds >= 0) cpu_wait_.Add(lb).Increment(s.cpu_wait_seconds);
  if (s.expected_committed > 0) {
    expected_tokens_.Add(lb).Increment(s.expected_committed);
    realised_tokens_.Add(lb).Increment(static_cast<double>(s.committed));
  }
  std::lock_guard<std::mutex> l(totals_mu_);
  WorkTotals& t = totals_[s.model];
  t.steps += 1;
  t.committed += s.committed;
  t.step_seconds += s.seconds;
  if (s.cpu_wait_seconds >= 0) {
    t.cpu_wait_steps += 1;
    t.cpu_wait_seconds += s.cpu_wait_seconds;
    t.cpu_wait_step_seconds += s.seconds;
  }
}

void Metrics::OnRequestStep(const std::string& model, const std::string& method,
                            const StepEvent& e) {
  const std::string ml = ModelLabel(model);
  PerMethod& p = For(ml, method);
  p.nfe->Increment();
  p.accepted_length->Observe(static_cast<double>(e.positions.size()));
  p.window->Observe(static_cast<double>(e.window));
  if (e.verified > 0) p.drafted->Increment(static_cast<double>(e.verified));
  if (e.accepted > 0) p.accepted->Increment(static_cast<double>(e.accepted));
  {
    std::lock_guard<std::mutex> l(totals_mu_);
    WorkTotals& t = totals_[ml];
    t.request_forwards += 1;
    t.drafts_verified += e.verified;
    t.drafts_accepted += e.accepted;
  }
  for (size_t d = 0; d < e.verified_at_depth.size(); ++d) {
    const int64_t v = e.verified_at_depth[d];
    const int64_t a = d < e.accepted_at_depth.size() ? e.accepted_at_depth[d] : 0;
    if (v == 0 && a == 0) continue;
    const std::string pos = PositionLabel(static_cast<int64_t>(d) + 1);
    std::lock_guard<std::mutex> l(mu_);
    auto it = p.drafted_at.find(pos);
    if (it == p.drafted_at.end()) {
      const prometheus::Labels lb = {{"model", ml}, {"method", method}, {"position", pos}};
      it = p.drafted_at.emplace(pos, &drafted_pos_.Add(lb)).first;
      p.accepted_at.emplace(pos, &accepted_pos_.Add(lb));
    }
    if (v > 0) it->second->Increment(static_cast<double>(v));
    if (a > 0) p.accepted_at[pos]->Increment(static_cast<double>(a));
  }
}

void Metrics::OnRequestEnd(const std::string& model, const std::string& method,
                           const std::string& outcome) {
  requests_.Add({{"model", ModelLabel(model)}, {"method", method}, {"outcome", outcome}})
      .Increment();
}

void Metrics::OnKeyRequestEnd(const std::string& key, const std::string& outcome) {
  if (key.empty()) return;
  key_requests_.Add({{"key", key}, {"outcome", outcome}}).Increment();
}

void Metrics::OnKeyImage(const std::string& key, const RequestResult& r) {
  if (key.empty()) return;
  const RequestCounters& c = r.stats.counters;
  key_images_.Add({{"key", key}}).Increment();
  key_tokens_.Add({{"key", key}}).Increment(static_cast<double>(c.tokens));
  key_nfe_.Add({{"key", key}}).Increment(static_cast<double>(c.nfe));
}

void Metrics::OnImage(const std::string& model, const std::string& method, const RequestResult& r,
                      double total_seconds) {
  const std::string ml = ModelLabel(model);
  PerMethod& p = For(ml, method);
  const RequestStats& s = r.stats;
  p.images->Increment();
  p.draft_forwards->Increment(static_cast<double>(s.counters.draft_forwards));
  p.nfe_per_image->Observe(static_cast<double>(s.counters.nfe));
  p.compression->Observe(s.step_compression);
  p.first_token->Observe(s.first_token_seconds);
  p.latency->Observe(total_seconds);
  p.queue_time->Observe(s.queue_seconds);
  p.generation->Observe(s.generation_seconds);
  if (!r.image.pixels.empty()) p.decode->Observe(s.decode_seconds);
  {
    std::lock_guard<std::mutex> l(totals_mu_);
    totals_[ml].images += 1;
  }
  std::lock_guard<std::mutex> l(mu_);
  recent_generation_ = 0.8 * recent_generation_ + 0.2 * s.generation_seconds;
}

std::map<std::string, WorkTotals> Metrics::Totals() const {
  std::lock_guard<std::mutex> l(totals_mu_);
  return totals_;
}

double Metrics::RecentGenerationSeconds() const {
  std::lock_guard<std::mutex> l(mu_);
  return recent_generation_;
}

}  // namespace imagegen::server
