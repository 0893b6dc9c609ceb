// imagegen-server: the gRPC daemon. Serves ImageGeneration, grpc.health.v1.Health and server
// reflection on --listen, and Prometheus metrics on --metrics-listen.
//
// Start-up: the port opens at once with health "" SERVING (alive) and
// "imagegen.v1.ImageGeneration" NOT_SERVING; once the models are loaded the service turns
// SERVING (ready). SIGTERM or SIGINT: both turn NOT_SERVING, new calls get UNAVAILABLE, calls
// in flight get --grace-seconds to finish, then the process exits 0. A second signal exits at
// once with status 1.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/flags/usage.h>
#include <absl/strings/str_format.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <thread>

#include "engine/model/models_dir.h"
#include "engine/scheduler/engine.h"
#include "engine/util/read_file.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC address (host:port; port 0 picks a free one, see --port-file)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics address (host:port); empty: no metrics endpoint");
ABSL_FLAG(std::string, models_dir, "",
          "directory of model directories (default: $IMAGEGEN_MODELS_DIR, else the bundled models)");
ABSL_FLAG(std::vector<std::string>, models, {"fmnist-gpt"}, "models to load (comma-separated)");
ABSL_FLAG(std::string, device, "cpu", "cpu, cuda or cuda:N");
ABSL_FLAG(std::string, dtype, "fp32", "fp32, bf16 or fp16");
ABSL_FLAG(std::string, default_method, "scd-mc",
          "decoding method of requests that name none (lossless: ar, sjd, scd-mc, scd-gs, sjd-pac, "
          "pac-gumbel, sd)");
ABSL_FLAG(int64_t, max_queue, 256, "requests waiting per model before RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_slots, 64, "KV-cache slots per model (a request with guidance takes 2)");
ABSL_FLAG(int64_t, kv_cache_mb, 256, "KV-cache memory per model, MiB (caps the slots)");
ABSL_FLAG(int64_t, max_tokens_per_step, -1,
          "target-forward tokens per engine step; windows shrink under load (0: no budget, "
          "-1: 256 on the CPU, 2048 on CUDA)");
ABSL_FLAG(bool, batch_invariant, true,
          "a request's image does not depend on the requests beside it (costs some throughput)");
ABSL_FLAG(int64_t, cpu_threads, 0, "LibTorch intra-op threads of the engine (0: default)");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain (enables TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)");
ABSL_FLAG(std::string, token_file, "",
          "file holding a bearer token that ImageGeneration calls must send "
          "(authorization: Bearer <token>)");
ABSL_FLAG(double, grace_seconds, 30, "on SIGTERM/SIGINT, time for calls in flight to finish");
ABSL_FLAG(int64_t, max_threads, 512, "gRPC handler threads (one per call in flight)");
ABSL_FLAG(std::string, port_file, "",
          "write the bound ports to this file once listening: \"<grpc> <metrics>\"");

namespace {

constexpr char kServiceName[] = "imagegen.v1.ImageGeneration";

void Log(const std::string& msg) { std::fprintf(stderr, "imagegen-server: %s\n", msg.c_str()); }

// TLS material: the server does not start without it.
std::string ReadFileOrExit(const std::string& flag, const std::string& path) {
  imagegen::StatusOr<std::string> data = imagegen::ReadFile(path);
  if (!data.ok()) {
    Log("--" + flag + ": " + data.status().message());
    std::exit(2);
  }
  return std::move(data).value();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("imagegen-server [--listen HOST:PORT] [--models a,b] ...");
  // Flags may be spelled with dashes (--metrics-listen) or underscores (--metrics_listen).
  std::vector<std::string> args(argv, argv + argc);
  std::vector<char*> argp;
  for (std::string& a : args) {
    if (a.rfind("--", 0) == 0) {
      const size_t end = std::min(a.find('='), a.size());
      std::replace(a.begin() + 2, a.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
    }
    argp.push_back(a.data());
  }
  absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  using namespace imagegen;

  // Every thread started from here on inherits the blocked signals; main waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  server::TokenAuth auth;
  if (!absl::GetFlag(FLAGS_token_file).empty()) {
    auto a = server::TokenAuth::FromFile(absl::GetFlag(FLAGS_token_file));
    if (!a.ok()) {
      Log("--token-file: " + a.status().message());
      return 2;
    }
    auth = *a;
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  const std::string cert = absl::GetFlag(FLAGS_tls_cert), key = absl::GetFlag(FLAGS_tls_key);
  if (cert.empty() != key.empty()) {
    Log("--tls-cert and --tls-key go together");
    return 2;
  }
  if (!cert.empty()) {
    grpc::SslServerCredentialsOptions o;
    o.pem_key_cert_pairs.push_back(
        {ReadFileOrExit("tls-key", key), ReadFileOrExit("tls-cert", cert)});
    if (!absl::GetFlag(FLAGS_tls_client_ca).empty()) {
      o.pem_root_certs = ReadFileOrExit("tls-client-ca", absl::GetFlag(FLAGS_tls_client_ca));
      o.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    creds = grpc::SslServerCredentials(o);
  } else if (!absl::GetFlag(FLAGS_tls_client_ca).empty()) {
    Log("--tls-client-ca needs --tls-cert and --tls-key");
    return 2;
  }

  server::Metrics metrics;
  std::unique_ptr<server::MetricsHttpServer> exposer;
  if (const std::string m = absl::GetFlag(FLAGS_metrics_listen); !m.empty()) {
    auto started = server::MetricsHttpServer::Start(m, {metrics.registry(), metrics.engine_gauges()});
    if (!started.ok()) {
      Log("--metrics-listen: " + started.status().message());
      return 2;
    }
    exposer = std::move(started).value();
  }

  const std::string default_method = absl::GetFlag(FLAGS_default_method);
  server::ImageGenerationService service(&metrics, auth, default_method);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), creds, &port);
  builder.RegisterService(&service);
  grpc::ResourceQuota quota("imagegen");
  quota.SetMaxThreads(static_cast<int>(absl::GetFlag(FLAGS_max_threads)));
  builder.SetResourceQuota(quota);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    Log("cannot listen on " + absl::GetFlag(FLAGS_listen));
    return 2;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, false);
  Log("listening on port " + std::to_string(port) + (cert.empty() ? "" : " (TLS)") +
      (auth.enabled() ? " with bearer-token auth" : "") + "; loading models");
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    std::ofstream(pf + ".tmp") << port << " " << (exposer ? exposer->port() : 0) << "\n";
    std::rename((pf + ".tmp").c_str(), pf.c_str());
  }

  // Test hook: hold the not-yet-ready state for a while, so that tests can observe it.
  if (const char* d = std::getenv("IMAGEGEN_TEST_DELAY_LOAD_MS"); d != nullptr) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atol(d)));
  }
  EngineOptions eo;
  eo.models_dir = absl::GetFlag(FLAGS_models_dir).empty() ? DefaultModelsDir()
                                                          : absl::GetFlag(FLAGS_models_dir);
  eo.models = absl::GetFlag(FLAGS_models);
  eo.device = absl::GetFlag(FLAGS_device);
  eo.dtype = absl::GetFlag(FLAGS_dtype);
  eo.max_queue = absl::GetFlag(FLAGS_max_queue);
  eo.max_slots = absl::GetFlag(FLAGS_max_slots);
  eo.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_mb) << 20;
  eo.max_tokens_per_step = absl::GetFlag(FLAGS_max_tokens_per_step);
  eo.batch_invariant = absl::GetFlag(FLAGS_batch_invariant);
  eo.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  auto started = Engine::Start(eo, &metrics);
  if (!started.ok()) {
    Log("cannot start the engine: " + started.status().ToString());
    health->Shutdown();
    server->Shutdown(std::chrono::system_clock::now());
    return 1;
  }
  std::unique_ptr<Engine> engine = std::move(started).value();
  bool default_ok = false;
  for (const ModelInfo& m : engine->Models()) {
    for (const auto& meth : m.methods) default_ok |= meth == default_method;
  }
  if (!default_ok) {
    Log("--default-method '" + default_method + "' is not served by the first model");
    return 2;
  }
  metrics.SetEngine(engine.get());
  service.SetEngine(engine.get());
  health->SetServingStatus(kServiceName, true);
  std::string names;
  for (const ModelInfo& m : engine->Models()) {
    names += (names.empty() ? "" : ", ") + m.name + " (" + std::to_string(m.kv_slots) + " KV slots)";
  }
  Log("ready: " + names + " on " + eo.device + "; token budget " +
      std::to_string(engine->max_tokens_per_step()) + " per step; default method " + default_method +
      (exposer ? "; metrics on port " + std::to_string(exposer->port()) + " /metrics" : ""));

  int sig = 0;
  sigwait(&signals, &sig);
  Log(std::string("received ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT") + ", draining for up to " +
      absl::StrFormat("%g", absl::GetFlag(FLAGS_grace_seconds)) + " s");
  std::thread force([&] {
    int again = 0;
    sigwait(&signals, &again);
    Log("second signal: exiting now");
    std::_Exit(1);
  });
  force.detach();
  health->Shutdown();  // every service NOT_SERVING from now on
  service.SetDraining();
  metrics.SetDraining();
  const auto grace = std::chrono::milliseconds(
      static_cast<int64_t>(absl::GetFlag(FLAGS_grace_seconds) * 1000));
  engine->Shutdown(grace);  // running requests finish (or end UNAVAILABLE when time is up)
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const EngineStats st = engine->Stats();
  Log("stopped: " + std::to_string(st.completed) + " images, " + std::to_string(st.cancelled) +
      " cancelled, " + std::to_string(st.expired) + " expired, " + std::to_string(st.failed) +
      " failed");
  engine.reset();
  return 0;
}
