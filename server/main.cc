// imagegen-server: the gRPC daemon. Serves ImageGeneration, grpc.health.v1.Health and server
// reflection on --listen, and Prometheus metrics on --metrics-listen.
//
// Start-up: the port opens at once with health "" SERVING (alive) and
// "imagegen.v1.ImageGeneration" NOT_SERVING; once the models are loaded the service turns
// SERVING (ready). SIGTERM or SIGINT: both turn NOT_SERVING, new calls get UNAVAILABLE, calls
// in flight get --grace-seconds to finish, then the process exits 0. A second signal exits at
// once with status 1 (SIGHUP does not count). SIGHUP reads the --token-file again (key rotation
// without a restart), and so does a change of the file (--token-file-poll-seconds); the TLS
// files likewise (certificate rotation, --tls-poll-seconds; server/tls.h).
#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/flags/usage.h>
#include <absl/flags/usage_config.h>
#include <absl/strings/match.h>
#include <absl/strings/numbers.h>
#include <absl/strings/str_format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "engine/model/models_dir.h"
#include "engine/util/read_file.h"
#include "engine/scheduler/engine.h"
#include "server/daemon.h"
#include "server/tls.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC address (host:port; port 0 picks a free one, see --port-file)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics address (host:port); empty: no metrics endpoint");
ABSL_FLAG(
    std::string, models_dir, "",
    "directory of model directories (default: $IMAGEGEN_MODELS_DIR, else the bundled models)");
ABSL_FLAG(std::vector<std::string>, models, (std::vector<std::string>{"fmnist-gpt", "fmnist-t2i"}),
          "models to load (comma-separated)");
ABSL_FLAG(std::string, device, "cpu", "cpu, cuda or cuda:N");
ABSL_FLAG(std::string, dtype, "auto", "auto (bf16 on CUDA, fp32 on the CPU), fp32, bf16 or fp16");
ABSL_FLAG(std::string, default_method, "scd-mc",
          "decoding method of requests that name none (lossless: ar, sjd, scd-mc, scd-gs, sjd-pac, "
          "pac-gumbel, sd)");
ABSL_FLAG(int64_t, max_queue, 256, "requests waiting per model before RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, admission, "fair",
          "the order waiting requests are admitted in: fair (priority, then the user with the "
          "fewest requests running, then the oldest; a full queue gives up the newest request of "
          "the user with the most waiting to another user's) or fifo (priority, then the oldest)");
ABSL_FLAG(bool, preemption, true,
          "when a more urgent request (lower priority value) finds no free KV slot, running "
          "requests of a less urgent priority give up theirs and resume later, recomputing their "
          "KV entries (discrete-token models; lossless methods stay lossless)");
ABSL_FLAG(int64_t, max_slots, 64, "KV-cache slots per model (a request with guidance takes 2)");
ABSL_FLAG(int64_t, kv_cache_mb, 0,
          "KV-cache memory per model, MiB (caps the slots); 0: by device, 256 MiB on the CPU and "
          "on a GPU half the memory left after the model's weights, shared by the models still "
          "to load");
ABSL_FLAG(std::string, window_policy, "goodput",
          "how each step's windows are chosen: goodput (maximise expected tokens per second from "
          "a calibrated step-cost model and learned acceptance), budget (the fixed "
          "--max-tokens-per-step), full (every request its whole window)");
ABSL_FLAG(double, max_slowdown, 0.25,
          "goodput fairness bound: no request's expected time per token may exceed (1 + this) "
          "times what it would be if every request in the step fed one token");
ABSL_FLAG(double, window_stickiness, 0,
          "goodput hysteresis: the previous step's windows are kept while their expected "
          "goodput is within this fraction of the best plan's, e.g. 0.05 (0: re-plan every "
          "step)");
ABSL_FLAG(double, explore_budget, 0.02,
          "goodput: the controller's exploring steps (one planned step in 16 takes windows twice "
          "as wide, so that the step-cost model measures wider steps) may cost at most this "
          "fraction of the step time, as predicted (0: never explore; 1: every 16th step)");
ABSL_FLAG(double, min_speculation_gain, 0.03,
          "goodput: a plan that speculates is taken only when predicted at least this fraction "
          "faster than plain AR for every request (0: any predicted gain)");
ABSL_FLAG(bool, lone_request_full_window, true,
          "goodput: a request alone gets its whole window (at most --lone_request_max_window), "
          "so that what a seed draws alone does not depend on the learned commits or the online "
          "step cost; false plans it at its fastest window");
ABSL_FLAG(int64_t, lone_request_max_window, -1,
          "goodput, with --lone_request_full_window: a request alone gets its whole window but at "
          "most this many nodes (-2: the window the step-cost calibration makes fastest for "
          "its method, fixed at start; -1: by device, -2 on the CPU and none on CUDA; 0: none)");
ABSL_FLAG(double, step_cost_spot_check, 3,
          "goodput: a cached step-cost calibration is measured again when one request's steps "
          "at start run more than this factor faster than it predicts (slower: kept, with a "
          "notice); 0: a cached calibration is used as it is");
ABSL_FLAG(int64_t, max_tokens_per_step, -1,
          "forward tokens per engine step (CFG rows count). With --window-policy=budget the "
          "budget (-1: 256 on the CPU, 2048 on CUDA); with goodput a memory ceiling (-1: 4096); "
          "0: none");
ABSL_FLAG(int64_t, prefill_tokens_per_step, 64,
          "prompt tokens (text-to-image models) and a preempted request's recomputed entries "
          "prefilled per engine step, over all prefilling requests (CFG rows count), beside the "
          "decoding requests' windows");
ABSL_FLAG(std::string, cache_dir, "",
          "where the step-cost calibration (and on the CPU the few-row kernel's timed rows) "
          "is kept between starts (default: "
          "$XDG_CACHE_HOME/imagegen, else $HOME/.cache/imagegen; 'none': not kept)");
ABSL_FLAG(bool, batch_invariant, true,
          "a request's image does not depend on the requests beside it (costs some throughput)");
ABSL_FLAG(bool, cuda_graphs, true,
          "on CUDA devices, run the model forwards at static shapes, each shape bucket captured "
          "once as a CUDA graph and replayed (5-9x the served throughput of the eager forward on "
          "an H200); no effect on the CPU. Overrides --batch_invariant: logits then equal the "
          "eager forward's within rounding; --cuda_graphs=false for images that are bit for bit "
          "independent of the requests beside them");
ABSL_FLAG(bool, row_attention, true,
          "on the CPU in fp32: every row attends through one kernel call a layer instead of one "
          "SDPA call per request (1.4-1.5x faster forwards at 16 one-token requests on 2 cores) "
          "or, with --batch_invariant=false, one padded SDPA call; false for the SDPA calls (A/B "
          "comparisons; images then round differently)");
ABSL_FLAG(bool, small_rows_gemm, true,
          "with --batch_invariant on the CPU in fp32: linear layers of fewer than 16 rows run a "
          "kernel that rounds them as the BLAS rounds 16 or more (checked per weight at load) "
          "instead of the BLAS on the rows padded to 16 (the same images; about 0.6x the "
          "forward's time for one request's two rows on 2 cores), and of more rows up to where "
          "the kernel was timed faster than the BLAS at load; false for the padded products "
          "(A/B comparisons)");
ABSL_FLAG(int64_t, small_rows_gemm_rows, 0,
          "the most rows of a linear layer the --small_rows_gemm kernel takes: 0 for what its "
          "timing against the BLAS at load chose (at most 256); more for that many; -1 for "
          "fewer than 16 only (the same images at any count)");
ABSL_FLAG(std::string, cpu_linear, "blas",
          "the CPU's fp32 linear products: blas (the BLAS, with the --small_rows_gemm kernel "
          "where it reproduces the BLAS's bits) or engine (the engine's kernel on every row count "
          "and any model size, never the BLAS: batch-invariant without padding a request's few "
          "rows to 16, about 3x faster one-request steps on models over 512 MB of weights; other "
          "images for a seed than blas draws, by fp32 rounding; a second copy of the weights)");
ABSL_FLAG(std::string, matmul_precision, "highest",
          "the fp32 products' precision, as PyTorch names it: highest (fp32) or medium (on the "
          "CPU in fp32, every linear layer of the GPT models in bf16 on the AMX tiles, sums in "
          "fp32: faster steps, other images than fp32's, still batch-invariant; where the CPU has "
          "no AMX the daemon says so at start and keeps fp32)");
ABSL_FLAG(bool, fused_norm_rope, true,
          "on the CPU in fp32: the forward's RMSNorm and rotary embedding run as one kernel each "
          "that computes the same bits as the ATen ops (checked at load; the ops are kept where "
          "the check fails) instead of about six and ten ops; false for the ops (A/B "
          "comparisons)");
ABSL_FLAG(bool, fused_verify, true,
          "verify windows (chains and trees of up to 8 branches, GSD's clusters) in one fused pass "
          "per step: one kernel "
          "on CUDA, the same arithmetic on the host on the CPU; and on CUDA compute the final "
          "distributions (CFG, temperature, top-k, softmax) in one kernel where no request uses "
          "top-p; false: the eager verification and distributions");
ABSL_FLAG(int32_t, decode_thread, -1,
          "decode finished images, and complete their requests, on a thread with its own CUDA "
          "stream so that decoding overlaps the next step: 1 on, 0 on the engine thread, -1 "
          "by device (on for CUDA, off on the CPU)");
ABSL_FLAG(int64_t, decode_batch, -1,
          "the most finished images decoded in one decoder call (those finished in one step, "
          "and those queued for the decode thread): -1 by forward (16 with CUDA graphs, whose "
          "pixels are within rounding of one-at-a-time decoding's; 1 with the batch-invariant "
          "forward), 1 one at a time, at most 256");
ABSL_FLAG(int32_t, warmup, -1,
          "before reporting ready, run --warmup_methods at each of --warmup_concurrency "
          "(requests at a time) on each model, so that clients meet CUDA graphs already "
          "captured and a decoder already warm: 1 on, 0 off, -1 with CUDA graphs (on for CUDA "
          "devices, off on the CPU)");
ABSL_FLAG(std::vector<std::string>, warmup_methods,
          (std::vector<std::string>{"ar", "sjd", "scd-mc", "sjd-pac"}),
          "the methods the warm-up runs (those a model does not serve are skipped)");
ABSL_FLAG(std::vector<std::string>, warmup_concurrency,
          (std::vector<std::string>{"1", "2", "4", "8", "16"}),
          "the loads the warm-up runs, in requests at a time (at most half a model's KV slots)");
ABSL_FLAG(int64_t, cpu_threads, 0,
          "LibTorch intra-op threads of the engine (0: LibTorch's count, capped by the cgroup's "
          "CPU quota)");
ABSL_FLAG(int32_t, adaptive_cpu_threads, -1,
          "on the CPU, halve the engine's intra-op threads while its thread waits for a CPU a "
          "fifth of its step time (other busy work on its cores) and try them again later; only "
          "thread counts whose outputs match the engine's own bit for bit, checked at start. -1: "
          "on for the CPU; 0 off; 1 on");
ABSL_FLAG(double, preview_share, 0.05,
          "share of the engine's time that preview decoding may take (due previews wait their "
          "turn beyond it); 0: no limit");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain (enables TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)");
ABSL_FLAG(int64_t, tls_poll_seconds, 10,
          "how often to check whether the --tls-cert, --tls-key or --tls-client-ca files "
          "changed (as on SIGHUP): a renewed certificate (cert-manager, a mounted Secret) that "
          "is a certificate and its key is served from the next handshake on, without a "
          "restart, and a broken one is refused (the last good one stays); 0 (only on SIGHUP) "
          "or 1 to 86400");
ABSL_FLAG(std::string, token_file, "",
          "API keys: a file of lines '<token> [name=<name>] [priority=<n>] [max_in_flight=<n>]' "
          "(or one token); calls must send one (authorization: Bearer <token>); a name makes the "
          "key's callers one fair-share tenant, a priority is its requests' default and most "
          "urgent, max_in_flight caps its images queued or running; read again when it changes "
          "(--token-file-poll-seconds) and on SIGHUP");
ABSL_FLAG(double, token_file_poll_seconds, 10,
          "how often to check whether --token-file changed (it is then read again, as on "
          "SIGHUP): 0 (only on SIGHUP) or 0.05 to 86400");
ABSL_FLAG(std::string, trusted_proxies, "",
          "comma-separated addresses and CIDR ranges of proxies whose X-Forwarded-For names the "
          "caller (HTTP header or gRPC metadata); empty: the peer is the caller");
ABSL_FLAG(double, grace_seconds, 30, "on SIGTERM/SIGINT, time for calls in flight to finish");
ABSL_FLAG(int64_t, max_threads, 512,
          "gRPC's threads (calls run on gRPC's callback API and do not hold a thread each)");
ABSL_FLAG(int32_t, encoder_threads, 2,
          "threads that encode PNGs and build responses (never the engine thread)");
ABSL_FLAG(double, stream_stall_seconds, 30,
          "a GenerateStream whose client takes no message for this long is ended (ABORTED) and "
          "its request cancelled");
ABSL_FLAG(double, engine_stall_seconds, 60,
          "liveness beyond \"the process answers\": when the engine's work has waited this long "
          "on its engine or decode thread (no step finished, no image decoded), health \"\" "
          "and the service turn NOT_SERVING (and HTTP /health/live 503) until it moves again; "
          "0: off");
ABSL_FLAG(int64_t, engine_failed_steps, 5,
          "an engine that moves but fails (a sticky device error): once this many steps of one "
          "model have failed in a row (their requests ended INTERNAL), health turns NOT_SERVING "
          "as for a stall, until a step succeeds; 0: off");
ABSL_FLAG(double, engine_probe_seconds, 10,
          "while --engine-failed-steps holds health NOT_SERVING, a probe every this many "
          "seconds (one step of an AR request of the failing model, then cancelled), so that a "
          "replica without traffic turns SERVING again once its steps succeed, and the failing "
          "model's calls are refused UNAVAILABLE meanwhile; 0: off (calls are taken)");
ABSL_FLAG(double, inject_step_failures_seconds, 0,
          "failure drill: every step of each model fails (its requests end INTERNAL, as after "
          "a transient device error) for this many seconds from its first step after the "
          "warm-up, so that health, refusals, probes and clients' retries can be watched; 0: "
          "off (never set it in production)");
ABSL_FLAG(std::string, http_listen, "",
          "OpenAI-compatible HTTP API address (host:port: POST /v1/images/generations, GET "
          "/v1/models, and the playground page at /); HTTPS with --tls-cert (refused with "
          "--tls-client-ca: it cannot check client certificates); empty: off");
ABSL_FLAG(int32_t, max_images, 16,
          "images one request may ask for (GenerateRequest.n); each takes its own place in the "
          "queue and its own KV slots");
ABSL_FLAG(bool, log_requests, true,
          "log a line per generation call on stderr (request id, front, peer, model, method, "
          "outcome, seconds, tokens, NFE, acceptance; never the prompt)");
ABSL_FLAG(std::string, log_format, "text",
          "text (\"imagegen-server: <event> key=value ...\") or json (one object per line)");
ABSL_FLAG(double, log_stats_seconds, 10,
          "every this many seconds, a stats line per model with work (running, queued, KV "
          "slots, steps, tokens and images per second, tokens per forward, acceptance, busy "
          "share); 0: none");
ABSL_FLAG(std::string, port_file, "",
          "write the bound ports to this file once listening: \"<grpc> <metrics>\" (metrics 0: "
          "off), and \" <http>\" after them when --http-listen is set");

namespace {

imagegen::server::LogFormat log_format = imagegen::server::LogFormat::kText;

// One line, in --log-format, in one write.
void Log(const std::string& msg) {
  const std::string line = imagegen::server::FormatMessage(log_format, msg);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("imagegen-server [--listen HOST:PORT] [--models a,b] ...");
  // --help and --helpshort list this file's flags (Abseil's default looks for a file named
  // after the program, and found none).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
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
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  server::DaemonOptions o;
  o.listen = absl::GetFlag(FLAGS_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o.http_listen = absl::GetFlag(FLAGS_http_listen);
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  o.tls_poll_seconds = absl::GetFlag(FLAGS_tls_poll_seconds);
  o.token_file = absl::GetFlag(FLAGS_token_file);
  o.trusted_proxies = absl::GetFlag(FLAGS_trusted_proxies);
  o.default_method = absl::GetFlag(FLAGS_default_method);
  o.max_threads = absl::GetFlag(FLAGS_max_threads);
  o.encoder_threads = absl::GetFlag(FLAGS_encoder_threads);
  o.stream_stall_ms = static_cast<int64_t>(absl::GetFlag(FLAGS_stream_stall_seconds) * 1000);
  o.max_images = absl::GetFlag(FLAGS_max_images);
  o.engine_stall_seconds = absl::GetFlag(FLAGS_engine_stall_seconds);
  o.engine_failed_steps = absl::GetFlag(FLAGS_engine_failed_steps);
  o.engine_probe_seconds = absl::GetFlag(FLAGS_engine_probe_seconds);
  o.log_requests = absl::GetFlag(FLAGS_log_requests);
  o.log_format = absl::GetFlag(FLAGS_log_format);
  o.log_stats_seconds = absl::GetFlag(FLAGS_log_stats_seconds);
  (void)server::ParseLogFormat(o.log_format, &log_format);  // Listen names a bad one
  EngineOptions& eo = o.engine;
  eo.models_dir = absl::GetFlag(FLAGS_models_dir).empty() ? DefaultModelsDir()
                                                          : absl::GetFlag(FLAGS_models_dir);
  eo.models = absl::GetFlag(FLAGS_models);
  eo.device = absl::GetFlag(FLAGS_device);
  eo.dtype = absl::GetFlag(FLAGS_dtype);
  eo.max_queue = absl::GetFlag(FLAGS_max_queue);
  eo.admission = absl::GetFlag(FLAGS_admission);
  eo.preemption = absl::GetFlag(FLAGS_preemption);
  eo.max_slots = absl::GetFlag(FLAGS_max_slots);
  const int64_t kv_mb = absl::GetFlag(FLAGS_kv_cache_mb);
  if (kv_mb < 0 || kv_mb > (int64_t{1} << 30)) {
    Log("--kv-cache-mb must be 0 (by device) or a size in MiB");
    return 2;
  }
  eo.kv_cache_bytes = kv_mb == 0 ? -1 : kv_mb << 20;  // -1: by device
  eo.max_tokens_per_step = absl::GetFlag(FLAGS_max_tokens_per_step);
  eo.prefill_tokens_per_step = absl::GetFlag(FLAGS_prefill_tokens_per_step);
  if (eo.prefill_tokens_per_step < 1) {
    Log("--prefill-tokens-per-step must be >= 1");
    return 2;
  }
  eo.window_policy = absl::GetFlag(FLAGS_window_policy);
  eo.max_slowdown = absl::GetFlag(FLAGS_max_slowdown);
  eo.window_stickiness = absl::GetFlag(FLAGS_window_stickiness);
  eo.explore_budget = absl::GetFlag(FLAGS_explore_budget);
  eo.min_speculation_gain = absl::GetFlag(FLAGS_min_speculation_gain);
  eo.lone_request_full_window = absl::GetFlag(FLAGS_lone_request_full_window);
  eo.lone_request_max_window = absl::GetFlag(FLAGS_lone_request_max_window);
  eo.step_cost_spot_check = absl::GetFlag(FLAGS_step_cost_spot_check);
  eo.cache_dir = absl::GetFlag(FLAGS_cache_dir);
  if (eo.cache_dir == "none") {
    eo.cache_dir.clear();
  } else if (eo.cache_dir.empty()) {
    const char* xdg = std::getenv("XDG_CACHE_HOME");
    const char* home = std::getenv("HOME");
    if (xdg != nullptr && *xdg != '\0') {
      eo.cache_dir = std::string(xdg) + "/imagegen";
    } else if (home != nullptr && *home != '\0') {
      eo.cache_dir = std::string(home) + "/.cache/imagegen";
    }
  }
  eo.batch_invariant = absl::GetFlag(FLAGS_batch_invariant);
  eo.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs) ? -1 : 0;  // -1: on for CUDA devices
  eo.row_attention = absl::GetFlag(FLAGS_row_attention);
  eo.small_rows_gemm = absl::GetFlag(FLAGS_small_rows_gemm);
  eo.small_rows_gemm_rows = absl::GetFlag(FLAGS_small_rows_gemm_rows);
  eo.cpu_linear = absl::GetFlag(FLAGS_cpu_linear);
  eo.fused_norm_rope = absl::GetFlag(FLAGS_fused_norm_rope);
  eo.matmul_precision = absl::GetFlag(FLAGS_matmul_precision);
  eo.fused_verify = absl::GetFlag(FLAGS_fused_verify);
  eo.decode_thread = absl::GetFlag(FLAGS_decode_thread);
  eo.decode_batch = absl::GetFlag(FLAGS_decode_batch);
  eo.warmup = absl::GetFlag(FLAGS_warmup);
  eo.warmup_methods = absl::GetFlag(FLAGS_warmup_methods);
  eo.warmup_concurrency.clear();
  for (const std::string& c : absl::GetFlag(FLAGS_warmup_concurrency)) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(c, &n)) {
      Log("--warmup-concurrency: '" + c + "' is not a number");
      return 2;
    }
    eo.warmup_concurrency.push_back(n);
  }
  eo.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  eo.adaptive_cpu_threads = absl::GetFlag(FLAGS_adaptive_cpu_threads);
  eo.fail_steps_for_seconds = absl::GetFlag(FLAGS_inject_step_failures_seconds);
  eo.preview_share = absl::GetFlag(FLAGS_preview_share);
  eo.log = [](const std::string& msg) { Log(msg); };

  if (const double p = absl::GetFlag(FLAGS_token_file_poll_seconds);
      !(p == 0 || (p >= 0.05 && p <= 86400))) {
    Log("--token-file-poll-seconds: must be 0 (only on SIGHUP) or in [0.05, 86400]");
    return 2;
  }
  auto listening = server::Daemon::Listen(o);
  if (!listening.ok()) {
    Log(listening.status().message());
    return 2;
  }
  std::unique_ptr<server::Daemon> daemon = std::move(listening).value();
  Log("listening on port " + std::to_string(daemon->port()) + (daemon->tls() ? " (TLS)" : "") +
      (daemon->auth() ? " with bearer-token auth" : "") + "; loading models");
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    // "<grpc> <metrics>", and " <http>" only when the HTTP API is on (older readers of the
    // file take two numbers).
    const std::string http =
        daemon->http_port() != 0 ? " " + std::to_string(daemon->http_port()) : "";
    (void)WriteFileAtomically(pf, std::to_string(daemon->port()) + " " +
                                      std::to_string(daemon->metrics_port()) + http + "\n");
  }

  // Until the engine is ready nothing is in flight, so SIGTERM or SIGINT while the models load
  // (the start-up warm-up included, which can take minutes for large models) exits at once
  // with status 0, rather than once loading is done; a SIGHUP then is raised again for the
  // signal loop below. A thread of its own polls for them, 10 times a second, and hands the
  // signals back to main once loading ends. Whether a signal came before any call could reach
  // the engine is decided under `ready_mu`: Load's before_serving sets `ready` before the
  // service takes calls, and a SIGTERM after that (the watcher may still be in its last poll) is
  // raised again for the drain below, not taken for one that came while loading.
  std::mutex ready_mu;
  bool ready = false;
  std::atomic<bool> loading{true}, hup_while_loading{false};
  std::atomic<int> stop_after_loading{0};
  std::thread while_loading([&] {
    const timespec tick{0, 100'000'000};
    while (loading.load()) {
      const int s = sigtimedwait(&signals, nullptr, &tick);
      if (s == SIGHUP) {
        hup_while_loading = true;
      } else if (s == SIGTERM || s == SIGINT) {
        std::lock_guard<std::mutex> l(ready_mu);
        if (ready) {
          stop_after_loading = s;
          continue;
        }
        Log(std::string("received ") + (s == SIGTERM ? "SIGTERM" : "SIGINT") +
            " while loading the models: exiting, nothing was in flight");
        server::CertificateMirror::RemoveAllBeforeQuickExit();  // the destructors do not run
        std::fflush(stderr);
        std::_Exit(0);
      }
    }
  });
  const Status loaded = daemon->Load(&Engine::Start, [&] {
    std::lock_guard<std::mutex> l(ready_mu);
    ready = true;
  });
  loading = false;
  while_loading.join();
  // A SIGHUP that came while loading, or a SIGTERM or SIGINT that came once calls could reach
  // the engine: pending again (signals are blocked), for the loop below.
  if (hup_while_loading.load()) raise(SIGHUP);
  if (const int s = stop_after_loading.load(); s != 0) raise(s);
  if (Status st = loaded; !st.ok()) {
    if (st.field() == "--default-method") {
      Log(st.message());
      return 2;
    }
    Log("cannot start the engine: " + st.ToString());
    return 1;
  }
  Log("ready: " + daemon->Describe() +
      (daemon->metrics_port() != 0
           ? "; metrics on port " + std::to_string(daemon->metrics_port()) + " /metrics"
           : "") +
      (daemon->http_port() != 0
           ? std::string("; OpenAI Images API on port ") + std::to_string(daemon->http_port()) +
                 (daemon->tls() ? " (HTTPS)" : "") + " /v1/images/generations"
           : ""));

  // The key file is read again on SIGHUP and when it changes (checked every
  // --token-file-poll-seconds), always on a thread of its own: file I/O (a hung mount) never
  // delays the signals main waits for. A failure is logged once until its message changes.
  const double poll_seconds = absl::GetFlag(FLAGS_token_file_poll_seconds);
  struct Watch {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false, hup = false, done = false;
  } watch;
  std::thread watcher;
  if (daemon->auth()) {
    watcher = std::thread([&watch, &daemon, poll_seconds] {
      std::string last;
      std::unique_lock<std::mutex> l(watch.mu);
      for (;;) {
        auto woken = [&] { return watch.stop || watch.hup; };
        if (poll_seconds > 0) {
          watch.cv.wait_for(l, std::chrono::duration<double>(poll_seconds), woken);
        } else {
          watch.cv.wait(l, woken);
        }
        if (watch.stop) break;
        const bool hup = watch.hup;
        watch.hup = false;
        l.unlock();
        if (hup || daemon->KeysChanged()) {
          auto keys = daemon->ReloadKeys();
          const std::string line =
              keys.ok() ? "--token-file read again: " + std::to_string(*keys) + " keys"
                        : "--token-file kept as it was: " + keys.status().message();
          if (hup || keys.ok() || line != last) {
            Log((hup ? "SIGHUP: " : "the file changed: ") + line);
          }
          last = keys.ok() ? "" : line;
        } else {
          last.clear();
        }
        l.lock();
      }
      watch.done = true;
      watch.cv.notify_all();
    });
  }
  // Waits for SIGTERM or SIGINT; SIGHUP wakes the watcher.
  int sig = 0;
  for (;;) {
    sigwait(&signals, &sig);
    if (sig != SIGHUP) break;
    if (daemon->tls()) daemon->CheckCertificateNow();
    if (!daemon->auth()) {
      if (!daemon->tls()) Log("SIGHUP: no --token-file or TLS files to read again");
      continue;
    }
    std::lock_guard<std::mutex> l(watch.mu);
    watch.hup = true;
    watch.cv.notify_all();
  }
  {
    std::lock_guard<std::mutex> l(watch.mu);
    watch.stop = true;
    watch.cv.notify_all();
  }
  Log(std::string("received ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT") + ", draining for up to " +
      absl::StrFormat("%g", absl::GetFlag(FLAGS_grace_seconds)) + " s");
  std::thread force([signals] {
    for (;;) {
      int again = 0;
      sigwait(&signals, &again);
      if (again != SIGHUP) break;
      Log("SIGHUP while draining: the keys stay as they are");
    }
    Log("second signal: exiting now");
    server::CertificateMirror::RemoveAllBeforeQuickExit();
    std::_Exit(1);
  });
  force.detach();
  const EngineStats st = daemon->Stop(
      std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_grace_seconds) * 1000)));
  // The watcher was told to stop before the drain began; one stuck in a read (a hung mount)
  // for 5 s more is left behind, and the process exits without it.
  bool watcher_stuck = false;
  if (watcher.joinable()) {
    std::unique_lock<std::mutex> l(watch.mu);
    watcher_stuck = !watch.cv.wait_for(l, std::chrono::seconds(5), [&] { return watch.done; });
    l.unlock();
    if (!watcher_stuck) watcher.join();
  }
  daemon->log().Flush();  // the last calls' lines before the final one
  Log("stopped: " + std::to_string(st.completed) + " images, " + std::to_string(st.cancelled) +
      " cancelled, " + std::to_string(st.expired) + " expired, " + std::to_string(st.failed) +
      " failed");
  if (watcher_stuck) {
    Log("the --token-file watcher is stuck in a read (a hung mount?): exiting without it");
    server::CertificateMirror::RemoveAllBeforeQuickExit();
    std::fflush(stderr);
    std::_Exit(0);
  }
  daemon.reset();
  return 0;
}
