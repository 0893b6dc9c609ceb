// Prometheus metrics of the daemon (DESIGN.md "Metrics", docs/serving.md section 2): names
// prefixed imagegen_, base units, counters ending in _total, labels model and method only,
// with bounded values (loaded model names; preset names, "custom" or "unknown"; a fixed set of
// outcomes and window positions); the imagegen_key_* counters (usage per API key) are labelled
// by key, the names in the key file (bounded by it). Engine gauges (queue, active requests, KV
// slots) are read from Engine::Stats() at scrape time. Thread-safe.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/scheduler/engine.h"
#include "server/request_log.h"

namespace imagegen::server {

// The label value for a window position (1-based draft depth): "1".."8", then power-of-two
// ranges "9-16", "17-32", "33-64", "65-128", "129+".
std::string PositionLabel(int64_t depth);

class Metrics : public EngineListener {
 public:
  Metrics();

  // Served at /metrics: the registry's metrics and the engine gauges.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  std::shared_ptr<prometheus::Collectable> engine_gauges() const { return gauges_; }

  // Starts reporting the engine's gauges (null before the models are loaded).
  void SetEngine(const Engine* engine);
  void SetDraining();

  // Engine thread: one model step.
  void OnStep(const StepSample& sample) override;
  void OnWarmupStep(const StepSample& sample) override;  // counts its capture failures
  // Engine thread: one step of one request.
  void OnRequestStep(const std::string& model, const std::string& method, const StepEvent& e);
  // A call ended. `outcome`: ok, invalid_argument, not_found, resource_exhausted, unavailable,
  // cancelled, deadline_exceeded, unauthenticated, permission_denied, aborted,
  // internal.
  void OnRequestEnd(const std::string& model, const std::string& method,
                    const std::string& outcome);
  // An image was sent to its client (a call has n of them), `total_seconds` after the call
  // arrived.
  void OnImage(const std::string& model, const std::string& method, const RequestResult& result,
               double total_seconds);

  // Usage per named API key (server/auth.h; `key` empty: not counted): a call's outcome, and an
  // image sent with its tokens and target forwards.
  void OnKeyRequestEnd(const std::string& key, const std::string& outcome);
  void OnKeyImage(const std::string& key, const RequestResult& result);

  // Call accounting: a call is opened when it arrives and closed when gRPC is done with it.
  // `retry`: the call is a client's retry of an attempt that failed (grpc-previous-rpc-attempts).
  void OnCallOpened(bool retry = false);
  void OnCallClosed();
  // A stream was ended because its client stopped reading.
  void OnStreamStalled();
  // The daemon's health watch declared the engine unhealthy: "stalled" or "failing".
  void OnEngineUnhealthy(const std::string& reason);
  // A probe of a failing model ended (DaemonOptions::engine_probe_seconds): "ok" (its step
  // succeeded), "failed" (its step failed) or "not_run" (it ended before a step: queue full,
  // shutting down).
  void OnEngineProbe(const std::string& model, const std::string& outcome);

  // TLS (server/tls.h): the served certificate's end of validity (Unix seconds), and a read of
  // changed certificate files that replaced it (`ok`) or was refused (the one served stays).
  void OnTlsCertificate(int64_t not_after);
  void OnTlsReload(bool ok);

  // Mean seconds of a recent image's generation (for RetryInfo), 1 s before any.
  double RecentGenerationSeconds() const;

  // Per model since the start (what the log's periodic stats line reports per interval).
  std::map<std::string, WorkTotals> Totals() const;

 private:
  struct PerMethod {
    prometheus::Counter *drafted, *accepted, *nfe, *draft_forwards, *images;
    prometheus::Histogram *accepted_length, *nfe_per_image, *compression, *first_token, *latency,
        *queue_time, *generation, *decode, *window;
    std::map<std::string, prometheus::Counter*> drafted_at, accepted_at;
  };
  PerMethod& For(const std::string& model, const std::string& method);
  std::string ModelLabel(const std::string& model) const;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> gauges_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Counter>& key_requests_;
  prometheus::Family<prometheus::Counter>& key_images_;
  prometheus::Family<prometheus::Counter>& key_tokens_;
  prometheus::Family<prometheus::Counter>& key_nfe_;
  prometheus::Family<prometheus::Counter>& drafted_;
  prometheus::Family<prometheus::Counter>& accepted_;
  prometheus::Family<prometheus::Counter>& drafted_pos_;
  prometheus::Family<prometheus::Counter>& accepted_pos_;
  prometheus::Family<prometheus::Counter>& nfe_;
  prometheus::Family<prometheus::Counter>& draft_forwards_;
  prometheus::Family<prometheus::Counter>& images_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Histogram>& accepted_length_;
  prometheus::Family<prometheus::Histogram>& nfe_per_image_;
  prometheus::Family<prometheus::Histogram>& compression_;
  prometheus::Family<prometheus::Histogram>& first_token_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Histogram>& queue_time_;
  prometheus::Family<prometheus::Histogram>& generation_;
  prometheus::Family<prometheus::Histogram>& decode_;
  prometheus::Family<prometheus::Histogram>& step_duration_;
  prometheus::Family<prometheus::Histogram>& step_tokens_;
  prometheus::Family<prometheus::Histogram>& step_requests_;
  prometheus::Family<prometheus::Histogram>& window_;
  prometheus::Family<prometheus::Histogram>& step_cost_ratio_;
  prometheus::Family<prometheus::Counter>& step_predicted_;
  prometheus::Family<prometheus::Counter>& step_measured_;
  prometheus::Family<prometheus::Counter>& cpu_wait_;
  prometheus::Family<prometheus::Counter>& expected_tokens_;
  prometheus::Family<prometheus::Counter>& realised_tokens_;
  prometheus::Family<prometheus::Counter>& window_limited_;
  prometheus::Family<prometheus::Counter>& graph_captures_;
  prometheus::Family<prometheus::Counter>& graph_capture_failures_;
  prometheus::Family<prometheus::Gauge>& info_;
  prometheus::Counter& calls_opened_;
  prometheus::Counter& calls_closed_;
  prometheus::Counter& call_retries_;
  prometheus::Counter& stream_stalls_;
  prometheus::Family<prometheus::Counter>& engine_unhealthy_;
  prometheus::Family<prometheus::Counter>& engine_probes_;
  prometheus::Family<prometheus::Gauge>& tls_not_after_;
  prometheus::Family<prometheus::Counter>& tls_reloads_;

  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, PerMethod> per_method_;
  std::vector<std::string> models_;  // loaded model names (label values)
  double recent_generation_ = 1.0;
  mutable std::mutex totals_mu_;
  std::map<std::string, WorkTotals> totals_;
};

}  // namespace imagegen::server
