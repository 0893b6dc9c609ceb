#include "server/daemon.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "engine/decoding/policy.h"
#include "server/process_metrics.h"

namespace imagegen::server {
namespace {

constexpr char kServiceName[] = "imagegen.v1.ImageGeneration";

// The failing check's probe (DaemonOptions::engine_probe_seconds). It reports once how it
// went: "ok" from its first step, before the engine publishes that the model's failed steps
// in a row are 0 again (so the "ok" is counted before health can turn SERVING), "failed" when
// it ended INTERNAL before a step (its step failed), "not_run" when it ended otherwise before a
// step (shut down, displaced). It cancels its request after that first step, and says when the
// request has left the engine.
class ProbeObserver : public RequestObserver {
 public:
  using Outcome = std::function<void(const std::string& outcome, const Status& status)>;
  ProbeObserver(Engine* engine, Outcome outcome, std::function<void()> left)
      : engine_(engine), outcome_(std::move(outcome)), left_(std::move(left)) {}
  void OnStep(const StepEvent& e) override {
    if (stepped_.exchange(true)) return;
    outcome_("ok", OkStatus());
    engine_->Cancel(e.request_id);  // the engine thread holds no lock of the engine's here
  }
  void OnComplete(RequestResult) override { Left(OkStatus()); }
  void OnError(const Status& s) override { Left(s); }

 private:
  void Left(const Status& s) {
    if (!stepped_) outcome_(s.code() == Code::kInternal ? "failed" : "not_run", s);
    left_();
  }
  Engine* const engine_;
  const Outcome outcome_;
  const std::function<void()> left_;
  std::atomic<bool> stepped_{false};
};

}  // namespace

Daemon::Daemon(const DaemonOptions& options, TokenAuth auth, TrustedProxies proxies,
               LogFormat format)
    : options_(options),
      auth_(auth),
      log_(std::make_unique<RequestLog>(format, options.log_fd)),
      service_(&metrics_, auth,
               ServiceOptions{options.default_method, options.encoder_threads,
                              std::chrono::milliseconds(options.stream_stall_ms),
                              ServiceOptions().max_request_bytes, options.max_images,
                              options.log_requests ? log_.get() : nullptr, std::move(proxies)}) {}

Daemon::~Daemon() { Stop(std::chrono::milliseconds(0)); }

StatusOr<std::unique_ptr<Daemon>> Daemon::Listen(const DaemonOptions& options) {
  TokenAuth auth;
  if (!options.token_file.empty()) {
    auto a = TokenAuth::FromFile(options.token_file);
    if (!a.ok()) return InvalidArgument("--token-file: " + a.status().message());
    auth = *a;
  }
  auto proxies = TrustedProxies::Parse(options.trusted_proxies);
  if (!proxies.ok()) return InvalidArgument("--trusted-proxies: " + proxies.status().message());
  if (options.encoder_threads < 1 || options.encoder_threads > 256) {
    return InvalidArgument("--encoder-threads: must be in [1, 256]");
  }
  if (options.max_images < 1 || options.max_images > 1024) {
    return InvalidArgument("--max-images: must be in [1, 1024]");
  }
  if (!(options.engine_stall_seconds >= 0)) {
    return InvalidArgument("--engine-stall-seconds: must be >= 0 (0: off)");
  }
  if (options.engine_failed_steps < 0) {
    return InvalidArgument("--engine-failed-steps: must be >= 0 (0: off)");
  }
  if (!(options.engine_probe_seconds >= 0)) {
    return InvalidArgument("--engine-probe-seconds: must be >= 0 (0: off)");
  }
  if (!(options.engine.fail_steps_for_seconds >= 0)) {
    return InvalidArgument("--inject-step-failures-seconds: must be >= 0 (0: off)");
  }
  if (options.stream_stall_ms < 100) {
    return InvalidArgument("--stream-stall-seconds: must be at least 0.1");
  }
  LogFormat format;
  if (!ParseLogFormat(options.log_format, &format)) {
    return InvalidArgument("--log-format: text or json, not '" + options.log_format + "'");
  }
  if (!(options.log_stats_seconds >= 0)) {
    return InvalidArgument("--log-stats-seconds: must be >= 0 (0: no stats lines)");
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return InvalidArgument("--tls-cert and --tls-key go together");
  }
  if (options.tls_poll_seconds < 0 || options.tls_poll_seconds > 86400) {
    return InvalidArgument("--tls-poll-seconds: must be 0 (only on SIGHUP) or in [1, 86400]");
  }
  // Checked here (GnuTLS, server/tls.h), naming the flag: gRPC checks the PEMs only when the
  // port is added and says "cannot listen".
  std::shared_ptr<const ServerCertificate> certificate;
  std::string client_ca;
  std::unique_ptr<CertificateMirror> mirror;
  if (!options.tls_cert.empty()) {
    auto read = ServerCertificate::Read(options.tls_cert, options.tls_key);
    if (!read.ok()) return read.status();
    certificate = *read;
    if (!options.tls_client_ca.empty()) {
      auto ca = ReadTlsFile("--tls-client-ca", options.tls_client_ca);
      if (!ca.ok()) return ca.status();
      RETURN_IF_ERROR(CheckCaBundle(*ca));
      // libmicrohttpd asks for a client certificate but leaves checking it to the
      // application (GnuTLS calls this does not make): the HTTP API would serve anyone.
      if (!options.http_listen.empty()) {
        return InvalidArgument(
            "--http-listen: the HTTP API cannot require client certificates (--tls-client-ca); "
            "leave it off, or serve it behind a proxy that checks them");
      }
      client_ca = *std::move(ca);
    }
    // gRPC serves what its file watcher reads from the mirror (checked copies, server/tls.h),
    // every second, from the next handshake on (the client CA too).
    auto made = CertificateMirror::Create(*certificate, client_ca);
    if (!made.ok()) return made.status();
    mirror = std::move(made).value();
    namespace ex = grpc::experimental;
    auto provider = std::make_shared<ex::FileWatcherCertificateProvider>(
        mirror->key_path(), mirror->cert_path(), client_ca.empty() ? "" : mirror->ca_path(), 1);
    ex::TlsServerCredentialsOptions o(provider);
    o.watch_identity_key_cert_pairs();
    if (!client_ca.empty()) {
      o.watch_root_certs();
      o.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    } else {
      o.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    }
    creds = ex::TlsServerCredentials(o);
  } else if (!options.tls_client_ca.empty()) {
    return InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key");
  }

  std::unique_ptr<Daemon> d(new Daemon(options, auth, std::move(*proxies), format));
  d->tls_ = !options.tls_cert.empty();
  d->certificate_ = certificate;
  d->client_ca_ = client_ca;
  d->mirror_ = std::move(mirror);
  if (d->mirror_ != nullptr) {
    for (const std::string& dir : d->mirror_->abandoned_removed()) {
      d->log_->Message("removed the TLS mirror of a daemon that is gone: " + dir);
    }
  }
  if (certificate != nullptr) d->metrics_.OnTlsCertificate(certificate->not_after());
  if (!options.metrics_listen.empty()) {
    auto started = MetricsHttpServer::Start(
        options.metrics_listen,
        {d->metrics_.registry(), d->metrics_.engine_gauges(), std::make_shared<ProcessMetrics>()});
    if (!started.ok()) {
      return Status(started.status().code(), "--metrics-listen: " + started.status().message());
    }
    d->exposer_ = std::move(started).value();
  }
  if (!options.http_listen.empty()) {
    auto started = HttpApi::Start(options.http_listen, &d->service_, certificate);
    if (!started.ok()) {
      return Status(started.status().code(), "--http-listen: " + started.status().message());
    }
    d->http_ = std::move(started).value();
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, creds, &d->port_);
  // gRPC sets SO_REUSEPORT by default: a second daemon would bind the same port, report ready
  // and take part of the connections. One daemon per port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(&d->service_);
  grpc::ResourceQuota quota("imagegen");
  quota.SetMaxThreads(static_cast<int>(options.max_threads));
  builder.SetResourceQuota(quota);
  d->server_ = builder.BuildAndStart();
  if (!d->server_ || d->port_ == 0) {
    return Unavailable(
        "cannot listen on " + options.listen +
        (d->tls_ ? " (or --tls-cert and --tls-key are not a certificate and its key)" : ""));
  }
  grpc::HealthCheckServiceInterface* health = d->server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, false);
  if (certificate != nullptr) d->tls_watch_ = std::thread([p = d.get()] { p->WatchCertificate(); });
  return d;
}

void Daemon::CheckCertificateNow() {
  {
    std::lock_guard<std::mutex> l(stats_mu_);
    tls_check_now_ = true;
  }
  stats_cv_.notify_all();
}

void Daemon::WatchCertificate() {
  std::string last_error;  // logged once until it changes
  std::unique_lock<std::mutex> l(stats_mu_);
  for (;;) {
    auto woken = [&] { return stats_stop_ || tls_check_now_; };
    if (options_.tls_poll_seconds > 0) {
      stats_cv_.wait_for(l, std::chrono::seconds(options_.tls_poll_seconds), woken);
    } else {
      stats_cv_.wait(l, woken);
    }
    if (stats_stop_) break;
    const bool hup = tls_check_now_;
    tls_check_now_ = false;
    l.unlock();
    StatusOr<std::string> cert = ReadTlsFile("--tls-cert", options_.tls_cert);
    StatusOr<std::string> key = ReadTlsFile("--tls-key", options_.tls_key);
    StatusOr<std::string> ca = options_.tls_client_ca.empty()
                                   ? StatusOr<std::string>(std::string())
                                   : ReadTlsFile("--tls-client-ca", options_.tls_client_ca);
    const bool same = cert.ok() && key.ok() && ca.ok() && *cert == certificate_->cert_pem() &&
                      *key == certificate_->key_pem() && *ca == client_ca_;
    if (same) {
      if (hup) log_->Message("SIGHUP: the TLS files are as served");
      last_error.clear();
    } else {
      // A pair that is not a certificate and its key (or a CA bundle that does not parse)
      // is refused: both ports keep serving the last good one.
      Status st = !cert.ok() ? cert.status() : !key.ok() ? key.status() : ca.status();
      std::shared_ptr<const ServerCertificate> next;
      if (st.ok()) {
        auto parsed = ServerCertificate::Parse(*cert, *key);
        st = parsed.status();
        if (parsed.ok()) next = *parsed;
      }
      if (st.ok() && !ca->empty()) st = CheckCaBundle(*ca);
      if (st.ok()) st = mirror_->Publish(*next, *ca);
      if (st.ok()) {
        certificate_ = next;
        client_ca_ = *ca;
        if (http_ != nullptr) http_->SetCertificate(certificate_);
        metrics_.OnTlsReload(true);
        metrics_.OnTlsCertificate(certificate_->not_after());
        log_->Message(std::string(hup ? "SIGHUP: " : "") + "TLS certificate read again: " +
                      certificate_->subject() + ", valid until " + certificate_->not_after_text());
        last_error.clear();
      } else {
        metrics_.OnTlsReload(false);
        if (hup || st.message() != last_error) {
          log_->Message(std::string(hup ? "SIGHUP: " : "") +
                        "the TLS files changed, but the certificate served stays: " + st.message());
        }
        last_error = st.message();
      }
    }
    l.lock();
  }
}

Status Daemon::Load(const EngineStarter& starter, const std::function<void()>& before_serving) {
  if (engine_ != nullptr || stopped_) return FailedPrecondition("Load: called twice or after Stop");
  auto started = starter(options_.engine, &metrics_);
  if (!started.ok()) return started.status();
  std::unique_ptr<Engine> engine = std::move(started).value();
  // The default applies to discrete-token models (continuous ones default to mar).
  bool default_ok = true;
  for (const ModelInfo& m : engine->Models()) {
    if (m.continuous) continue;
    default_ok = false;
    for (const auto& meth : m.methods) default_ok |= meth == options_.default_method;
    if (default_ok) break;
  }
  if (!default_ok) {
    return FieldError("--default-method",
                      "'" + options_.default_method + "' is not served by the first model");
  }
  if (before_serving) before_serving();
  engine_ = std::move(engine);
  RETURN_IF_ERROR(service_.SetEngine(engine_.get()));
  metrics_.SetEngine(engine_.get());
  server_->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  if (options_.log_stats_seconds > 0) stats_ = std::thread([this] { ReportStats(); });
  if (options_.engine_stall_seconds > 0 || options_.engine_failed_steps > 0) {
    progress_ = std::thread([this] { WatchProgress(); });
  }
  return OkStatus();
}

void Daemon::WatchProgress() {
  const double stall = options_.engine_stall_seconds;
  const int64_t failures = options_.engine_failed_steps;
  const double every = stall > 0 ? std::clamp(stall / 4, 0.01, 1.0) : 1.0;
  const auto period = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(every));
  const auto probe_every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options_.engine_probe_seconds));
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  std::string unhealthy;                             // the reason in force; empty: healthy
  std::chrono::steady_clock::time_point last_probe;  // or since failing, when none since
  std::unique_lock<std::mutex> l(stats_mu_);
  while (!stats_cv_.wait_for(l, period, [&] { return stats_stop_; })) {
    l.unlock();
    const EngineProgress p = engine_->Progress();
    const auto now = std::chrono::steady_clock::now();
    std::string reason;
    char what[512];
    if (stall > 0 && p.seconds() > stall) {
      reason = "stalled";
      std::snprintf(what, sizeof what,
                    "the %s thread has not moved for %.1f s with work waiting on it", p.thread(),
                    p.seconds());
    } else if (failures > 0 && p.failed_steps >= failures) {
      reason = "failing";
      std::snprintf(what, sizeof what, "the last %lld steps of model %s failed (%s)",
                    static_cast<long long>(p.failed_steps), p.failed_model.c_str(),
                    p.last_error.substr(0, 300).c_str());
    }
    if (!reason.empty() || reason != unhealthy) {
      // New calls are refused while the engine cannot serve them: all while it is stalled; the
      // failing model's while it is failing, when the probe is there to find out that its steps
      // work again (without probes a call's step is the only way back, so calls are taken).
      EngineHealth h;
      h.reason = reason;
      h.model = reason == "failing" ? p.failed_model : "";
      h.what = reason.empty() ? "" : what;
      h.refuse = reason == "stalled" || (reason == "failing" && options_.engine_probe_seconds > 0);
      h.retry_seconds = reason == "failing" ? options_.engine_probe_seconds : every;
      service_.SetUnhealthy(std::move(h));
    }
    if (reason != unhealthy) {
      if (!reason.empty()) {
        metrics_.OnEngineUnhealthy(reason);
        const bool probed = options_.engine_probe_seconds > 0;
        char every_probe[32];
        std::snprintf(every_probe, sizeof every_probe, "%g", options_.engine_probe_seconds);
        log_->Message("engine " + reason + ": " + what + "; health NOT_SERVING" +
                      (reason == "stalled" ? " and new calls refused until it moves"
                       : probed            ? " and calls of model " + p.failed_model +
                                      " refused until a step of it succeeds (a probe step every " +
                                      every_probe + " s)"
                                : " until it steps without failing"));
      } else {
        log_->Message("engine healthy again (was " + unhealthy + "); health SERVING");
      }
      health->SetServingStatus("", reason.empty());
      health->SetServingStatus(kServiceName, reason.empty());
      unhealthy = reason;
      last_probe = now;
    }
    // A failing engine out of the endpoints gets no calls whose steps could succeed: it
    // tries a step of its own now and then.
    if (reason == "failing" && options_.engine_probe_seconds > 0 && !probing_ &&
        now - last_probe >= probe_every) {
      Probe(p.failed_model);
      last_probe = now;
    }
    l.lock();
  }
}

bool Daemon::Probe(const std::string& model) {
  const ModelInfo* info = nullptr;
  for (const ModelInfo& m : engine_->Models()) {
    if (m.name == model) info = &m;
  }
  if (info == nullptr) return false;
  GenerateParams p;
  p.model = model;
  p.policy = *PolicyFromPreset(info->continuous ? "mar" : "ar");
  if (info->prompted) {
    p.prompt_token_ids = {0};
  } else {
    p.class_id = 0;
  }
  p.seed = 0;
  p.decode_image = false;
  p.client = "imagegen-health-probe";
  auto outcome = [this, model](const std::string& how, const Status& st) {
    metrics_.OnEngineProbe(model, how);
    log_->Message("engine probe of model " + model + ": " +
                  (how == "ok"       ? std::string("its step succeeded")
                   : how == "failed" ? "its step failed (" + st.message().substr(0, 300) + ")"
                                     : "not run (" + st.message().substr(0, 300) + ")"));
  };
  probing_ = true;
  StatusOr<int64_t> id = engine_->Submit(
      std::move(p),
      std::make_shared<ProbeObserver>(engine_.get(), outcome, [this] { probing_ = false; }));
  if (!id.ok()) {
    outcome("not_run", id.status());
    probing_ = false;
  }
  return id.ok();
}

void Daemon::ReportStats() {
  using Steady = std::chrono::steady_clock;
  const auto interval = std::chrono::duration_cast<Steady::duration>(
      std::chrono::duration<double>(options_.log_stats_seconds));
  std::map<std::string, WorkTotals> last = metrics_.Totals();
  auto last_time = Steady::now();
  std::map<std::string, Steady::time_point> warned;  // the last CPU-wait warning per model
  std::unique_lock<std::mutex> l(stats_mu_);
  while (!stats_cv_.wait_for(l, interval, [&] { return stats_stop_; })) {
    l.unlock();
    const auto now = Steady::now();
    const std::map<std::string, WorkTotals> totals = metrics_.Totals();
    const EngineStats es = engine_->Stats();
    for (const ModelLoad& m : es.models) {
      const WorkTotals& a = last[m.model];
      const auto b = totals.find(m.model);
      StatsRecord r;
      r.model = m.model;
      r.interval_seconds = std::chrono::duration<double>(now - last_time).count();
      r.running = m.active;
      r.queued = m.queued;
      r.slots_used = m.slots_used;
      r.slots_total = m.slots_total;
      r.cpu_threads = es.cpu_threads;
      r.cpu_threads_max = es.cpu_threads_max;
      r.work = (b == totals.end() ? a : b->second) - a;
      // Quiet models say nothing: a line per interval only while there is work.
      if (r.work.steps > 0 || r.work.images > 0 || r.running > 0 || r.queued > 0) {
        log_->Stats(r);
      }
      if (const std::optional<std::string> w = CpuWaitWarning(r)) {
        const auto at = warned.find(m.model);
        if (at == warned.end() || now - at->second >= std::chrono::minutes(10)) {
          log_->Message(*w);
          warned[m.model] = now;
        }
      }
    }
    last = totals;
    last_time = now;
    l.lock();
  }
}

std::string Daemon::Describe() const {
  if (engine_ == nullptr) return "no models loaded";
  std::string names;
  for (const ModelInfo& m : engine_->Models()) {
    names +=
        (names.empty() ? "" : ", ") + m.name + " (" + std::to_string(m.kv_slots) + " KV slots)";
  }
  const std::string& policy = options_.engine.window_policy;
  const int64_t tokens = engine_->max_tokens_per_step();
  std::string windows = "windows: " + policy;
  if (policy == "goodput") {
    char bound[32];
    std::snprintf(bound, sizeof bound, "%.2f", 1 + options_.engine.max_slowdown);
    const int64_t lone = engine_->lone_request_max_window();
    windows += std::string(" (fairness bound ") + bound + "x, ceiling " +
               (tokens > 0 ? std::to_string(tokens) : "none") + " tokens per step" +
               (!options_.engine.lone_request_full_window ? ", a request alone planned"
                : lone > 0 ? ", a request alone at most " + std::to_string(lone) + " nodes"
                : lone == kLoneWindowFromCalibration
                    ? ", a request alone at most the nodes its step-cost calibration makes fastest"
                    : "") +
               ")";
  } else if (policy == "budget") {
    windows += " " + (tokens > 0 ? std::to_string(tokens) : "none") + " tokens per step";
  }
  return names + " on " + options_.engine.device + "; " + windows + "; default method " +
         options_.default_method +
         (engine_->decode_thread() ? "; images decoded on their own thread" : "") +
         (engine_->decode_batch() > 1
              ? "; up to " + std::to_string(engine_->decode_batch()) + " images a decoder call"
              : "");
}

EngineStats Daemon::Stop(std::chrono::milliseconds grace) {
  if (stopped_ || server_ == nullptr) return final_stats_;
  stopped_ = true;
  {
    std::lock_guard<std::mutex> l(stats_mu_);
    stats_stop_ = true;
  }
  stats_cv_.notify_all();
  if (stats_.joinable()) stats_.join();
  if (tls_watch_.joinable()) tls_watch_.join();
  if (progress_.joinable()) progress_.join();    // before the drain's NOT_SERVING, not after
  server_->GetHealthCheckService()->Shutdown();  // every service NOT_SERVING from now on
  service_.SetDraining();
  metrics_.SetDraining();
  // One deadline for the whole drain: running requests finish (or end UNAVAILABLE when time is
  // up), then calls still open (a stream whose client stopped reading, a health watch) are
  // cancelled when the grace has passed (it was 5 s after it). The handlers get at most half
  // a second more to send the status the engine ended their requests with.
  const auto deadline = std::chrono::system_clock::now() + grace;
  if (engine_ != nullptr) engine_->Shutdown(grace);
  const auto answer_by =
      std::max(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  // With a client still connected, gRPC's Shutdown takes a few seconds more even when no call
  // is open (4-5 s measured with a 30 s grace): its graceful GOAWAY, while which a call still
  // arriving gets our UNAVAILABLE (retryable) instead of being cut. Closing at once when no
  // generation call was open was tried: tests/deploy/replicas.py then lost a call (CANCELLED,
  // not retried on another replica). So the drain keeps it.
  server_->Shutdown(answer_by);
  if (http_ != nullptr) http_->Stop(answer_by);  // answers what the engine ended, then closes
  if (engine_ != nullptr) final_stats_ = engine_->Stats();
  return final_stats_;
}

}  // namespace imagegen::server
