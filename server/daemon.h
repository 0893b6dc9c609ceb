// The daemon's life cycle, without its flags and signals (those stay in server/main.cc): open
// the ports, load the models, drain and stop. Serves ImageGeneration, grpc.health.v1.Health and
// server reflection on `listen`, and Prometheus metrics on `metrics_listen`.
//
// Start-up is two steps so that callers (and tests, in-process) see the states between them:
// Listen() opens the port with health "" SERVING (alive) and "imagegen.v1.ImageGeneration"
// NOT_SERVING, and ImageGeneration calls get UNAVAILABLE "models are loading"; Load() starts
// the engine with the starter it is given (production: Engine::Start) and then turns the
// service SERVING (ready). While the engine's work waits longer than engine_stall_seconds on one
// of its threads, or engine_failed_steps of a model's steps have failed in a row, both turn
// NOT_SERVING (a liveness probe restarts the process; traffic goes elsewhere), and SERVING again
// when it moves or a step succeeds. Stop() drains: every service NOT_SERVING, new calls
// UNAVAILABLE, requests in flight get the grace period, then the server closes.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "engine/scheduler/engine.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/http_api.h"
#include "server/metrics_http.h"
#include "server/request_log.h"
#include "server/service.h"
#include "server/tls.h"

namespace imagegen::server {

struct DaemonOptions {
  std::string listen = "127.0.0.1:50051";  // host:port; port 0 picks a free one
  std::string metrics_listen;              // host:port; empty: no /metrics endpoint
  std::string http_listen;                 // host:port; empty: no HTTP API (OpenAI Images)
  std::string tls_cert, tls_key;           // PEM files; both or neither (TLS)
  std::string tls_client_ca;               // PEM CA bundle: clients must present a certificate
  // Every this many seconds (and on CheckCertificateNow) the TLS files are read again and, when
  // changed and good, served from the next handshake on (server/tls.h); 0: only on
  // CheckCertificateNow. At most 86400.
  int64_t tls_poll_seconds = 10;
  std::string token_file;                 // the API keys (auth.h); empty: no auth
  std::string trusted_proxies;            // addresses and CIDR ranges (forwarded.h)
  std::string default_method = "scd-mc";  // of requests that name none
  int64_t max_threads = 512;              // gRPC's threads (calls do not hold one each)
  int encoder_threads = 2;                // PNG encoding and response building
  int64_t stream_stall_ms = 30000;        // a stream whose client reads nothing this long ends
  int max_images = 16;                    // GenerateRequest.n at most
  // A wedged engine (Engine::Progress: its work has waited this long on the engine or decode
  // thread) turns health "" and the service NOT_SERVING, and HTTP /health/live 503, until it
  // moves again; 0: off. Longer than any step or decoder call the models can legitimately take.
  double engine_stall_seconds = 60;
  // An engine that moves but fails every step (a sticky device error: Engine::Progress's
  // failed_steps) turns them NOT_SERVING too once this many steps of one model failed in a
  // row, until one succeeds; 0: off.
  int64_t engine_failed_steps = 5;
  // While the failing check holds health NOT_SERVING, a probe every this many seconds: one
  // step of an AR request of the failing model, cancelled once it has stepped, so that an
  // engine that readiness took out of the endpoints (and that gets no traffic to succeed on)
  // finds out that its steps succeed again, and a transient run of failures does not end in a
  // restart. 0: no probes (only real calls' steps turn it back).
  double engine_probe_seconds = 10;
  // The log on stderr (server/request_log.h): a line per generation call, and a stats line per
  // busy model every `log_stats_seconds` (0: none).
  bool log_requests = true;
  std::string log_format = "text";  // text or json
  double log_stats_seconds = 10;
  int log_fd = 2;  // where the log goes (tests)
  EngineOptions engine;
};

// Makes the engine (loading its models); `listener` outlives the engine. Production passes
// Engine::Start.
using EngineStarter = std::function<StatusOr<std::unique_ptr<Engine>>(const EngineOptions&,
                                                                      EngineListener* listener)>;

class Daemon {
 public:
  // Reads the TLS and token files and opens the gRPC port and /metrics. INVALID_ARGUMENT for
  // options that do not go together or files that cannot be read, UNAVAILABLE for an address
  // that cannot be bound.
  static StatusOr<std::unique_ptr<Daemon>> Listen(const DaemonOptions& options);
  ~Daemon();  // Stop() with no grace unless stopped already

  int port() const { return port_; }
  int metrics_port() const { return exposer_ ? exposer_->port() : 0; }
  int http_port() const { return http_ ? http_->port() : 0; }
  bool tls() const { return tls_; }
  bool auth() const { return auth_.enabled(); }
  // Reads the key file again (SIGHUP): the new keys apply to calls that begin afterwards; on an
  // error the keys stay as they were. Returns how many keys there are.
  StatusOr<size_t> ReloadKeys() { return auth_.Reload(); }
  // Whether the key file changed since it was last read.
  bool KeysChanged() const { return auth_.Changed(); }
  // With TLS, has the TLS files checked now (SIGHUP) rather than at the next poll; their watch
  // logs what it found.
  void CheckCertificateNow();

  // Starts the engine with `starter` (blocking while the models load), checks that it serves
  // the default method (else INVALID_ARGUMENT with field() "--default-method"), and turns the
  // service SERVING. `before_serving`, when given, runs once the engine is up and checked, before
  // any call can reach it (the daemon's main switches its signal handling there: until then a
  // SIGTERM exits at once, since nothing can be in flight). Call once, after Listen.
  Status Load(const EngineStarter& starter, const std::function<void()>& before_serving = nullptr);

  // The engine's running line for the log: models, device, token budget, default method.
  std::string Describe() const;

  // Drains and stops (see above); idempotent. Returns the engine's final figures (zero if the
  // models were never loaded).
  EngineStats Stop(std::chrono::milliseconds grace);

  // The daemon's log (request and stats lines; main's own messages go through it too).
  RequestLog& log() { return *log_; }

 private:
  Daemon(const DaemonOptions& options, TokenAuth auth, TrustedProxies proxies, LogFormat format);
  void ReportStats();       // the stats thread's loop
  void WatchProgress();     // the health watch's loop (engine_stall_seconds, engine_failed_steps)
  void WatchCertificate();  // the TLS files' watch (tls_poll_seconds), for HTTPS and /metrics
  // Submits the failing check's probe of `model` (engine_probe_seconds); false when none went.
  bool Probe(const std::string& model);

  const DaemonOptions options_;
  const TokenAuth auth_;
  bool tls_ = false;
  // What both ports serve (gRPC through the mirror); after Listen, only the TLS watch's thread
  // replaces them.
  std::shared_ptr<const ServerCertificate> certificate_;
  std::string client_ca_;
  std::unique_ptr<CertificateMirror> mirror_;
  bool tls_check_now_ = false;       // under stats_mu_
  std::unique_ptr<RequestLog> log_;  // destroyed last: what is queued is written
  // A probe is in the engine (Probe; its observer clears it, so it outlives the engine).
  std::atomic<bool> probing_{false};
  // Destroyed bottom-up, after Stop(): the (stopped) HTTP API and /metrics first (its gauges
  // read the engine), then the engine, the (stopped) gRPC server, the service, and the metrics
  // the engine reported to.
  Metrics metrics_;
  ImageGenerationService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<MetricsHttpServer> exposer_;
  std::unique_ptr<HttpApi> http_;
  int port_ = 0;
  bool stopped_ = false;
  EngineStats final_stats_;
  std::mutex stats_mu_;
  std::condition_variable stats_cv_;
  bool stats_stop_ = false;  // ends the three threads
  std::thread stats_, progress_, tls_watch_;
};

}  // namespace imagegen::server
