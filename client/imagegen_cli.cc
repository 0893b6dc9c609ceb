// imagegen: the command-line client, built from proto/ only (no engine, no LibTorch).
//
//   imagegen models
//   imagegen generate --class sneaker [--method scd-mc] [--seed 7] --out sneaker.png
//   imagegen generate --class bag --stream --preview-every 5 --preview-dir frames --out bag.png
//   imagegen generate --model janus-pro-1b --prompt "a red bag" --out bag.png   (text-to-image)
//   imagegen generate --model fmnist-t2i --prompt "a bag" --negative-prompt "a dark bag"
//       --n 4 --seed 1 --out bag.png   (writes bag_0.png .. bag_3.png, seeds 1 .. 4)
//   imagegen load --concurrency 16 --duration 30 --method scd-mc
//   imagegen health    (grpc.health.v1: exit 0 when SERVING; the image's HEALTHCHECK)
//
// Connection: --target host:port, --tls-ca (TLS), --tls-cert/--tls-key (mTLS), --token-file.
#include <grpcpp/grpcpp.h>

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/flags/usage.h>
#include <absl/flags/usage_config.h>
#include <absl/strings/match.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "engine/util/percentile.h"
#include "engine/util/read_file.h"
#include "engine/util/status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "imagegen/v1/imagegen.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle that signed the server's certificate (enables TLS)");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mTLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM key of --tls-cert");
ABSL_FLAG(std::string, tls_server_name, "", "expected server name in its certificate");
ABSL_FLAG(std::string, token_file, "", "file with the bearer token");
ABSL_FLAG(double, timeout, 0, "deadline of each call in seconds (0: none)");
ABSL_FLAG(int32_t, priority, 0,
          "generate: admission priority (a lower value is admitted first; default 0)");
ABSL_FLAG(std::string, user, "",
          "generate: who the request is for (the server shares its slots fairly between users; "
          "default: this machine's address)");
ABSL_FLAG(std::string, request_id, "",
          "generate: the call's x-request-id (the server's log line names it; default: the "
          "server makes one, printed here)");
ABSL_FLAG(std::string, model, "", "model name (default: the server's first)");
// --class (a C++ keyword) is accepted and rewritten to --cls before parsing; dashes and
// underscores in flag names are interchangeable.
ABSL_FLAG(std::string, cls, "",
          "--class: class name or id (generate: required; load: default all)");
ABSL_FLAG(std::string, prompt, "", "generate, load: the prompt of a text-to-image model");
ABSL_FLAG(std::string, prompt_ids, "",
          "generate, load: the prompt as comma-separated token ids (template and BOS included)");
ABSL_FLAG(std::string, negative_prompt, "",
          "generate, load: what a text-to-image model's image should not be (needs guidance)");
ABSL_FLAG(int32_t, n, 1,
          "generate: images to draw (seeds --seed, --seed + 1, ...); with more than one, --out "
          "gets _0, _1, ... before its extension");
ABSL_FLAG(std::string, method, "", "decoding method preset (default: the server's)");
ABSL_FLAG(int64_t, seed, -1, "seed (-1: the server picks one)");
ABSL_FLAG(double, cfg, -1, "guidance scale (-1: the model's default)");
ABSL_FLAG(int32_t, cfg_interval, -1,
          "LlamaGen's cfg_interval: guide only image tokens 0..N+1 (-1: all of them)");
ABSL_FLAG(double, temperature, -1, "temperature (-1: the model's default)");
ABSL_FLAG(int32_t, top_k, -1, "top-k (-1: the model's default, 0: off)");
ABSL_FLAG(double, top_p, -1, "top-p (-1: the model's default)");
ABSL_FLAG(int32_t, window, 0, "window L (0: the preset's; cspd: gamma, the drafts per step)");
ABSL_FLAG(int32_t, num_iter, 0, "mar: MAR iterations (0: the model's default)");
ABSL_FLAG(std::string, cfg_schedule, "", "mar, cspd: linear or constant (default: the model's)");
ABSL_FLAG(double, prefill, -1, "cspd: fraction of tokens the target draws first (-1: 0.05)");
ABSL_FLAG(std::string, alignment, "", "cspd: on or off, trajectory alignment (default on)");
ABSL_FLAG(bool, cspd_authors, false,
          "cspd: the authors' code instead of the paper (inner temperature 42, inverted Sigma, "
          "100 residual rounds then a zero latent, the draft's mean as its token, a target "
          "that sees verified tokens only); lossy");
ABSL_FLAG(int32_t, scale, 1, "upscale the PNG this many times (nearest neighbour)");
ABSL_FLAG(std::string, out, "image.png", "generate: where to write the PNG");
ABSL_FLAG(bool, stream, false, "generate: stream the grid as it is decided; load: use streams");
ABSL_FLAG(int32_t, preview_every, 0, "--stream (generate, load): a preview PNG every N steps");
ABSL_FLAG(std::string, preview_dir, "", "generate --stream: directory for the preview frames");
ABSL_FLAG(bool, drafts, false, "generate --stream: also show the drafts of every step");
ABSL_FLAG(int32_t, concurrency, 4, "load: concurrent clients (closed loop)");
ABSL_FLAG(double, duration, 10, "load: seconds to keep issuing requests");
ABSL_FLAG(std::string, service, "imagegen.v1.ImageGeneration",
          "health: the service to check (\"\": the process; the default is NOT_SERVING while "
          "the models load and once the daemon drains)");

namespace {

namespace v1 = imagegen::v1;
using Clock = std::chrono::steady_clock;
using imagegen::Percentile;

// TLS material and the token: without them no call can be made.
std::string ReadFileOrExit(const std::string& flag, const std::string& path) {
  imagegen::StatusOr<std::string> data = imagegen::ReadFile(path);
  if (!data.ok()) {
    std::cerr << "imagegen: --" << flag << ": " << data.status().message() << "\n";
    std::exit(2);
  }
  return std::move(data).value();
}

std::string Trim(std::string s) {
  const auto b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::shared_ptr<grpc::Channel> Connect() {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  if (!absl::GetFlag(FLAGS_tls_ca).empty()) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ReadFileOrExit("tls-ca", absl::GetFlag(FLAGS_tls_ca));
    if (!absl::GetFlag(FLAGS_tls_cert).empty()) {
      o.pem_cert_chain = ReadFileOrExit("tls-cert", absl::GetFlag(FLAGS_tls_cert));
      o.pem_private_key = ReadFileOrExit("tls-key", absl::GetFlag(FLAGS_tls_key));
    }
    creds = grpc::SslCredentials(o);
    if (!absl::GetFlag(FLAGS_tls_server_name).empty()) {
      args.SetSslTargetNameOverride(absl::GetFlag(FLAGS_tls_server_name));
    }
  }
  return grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target), creds, args);
}

void Prepare(grpc::ClientContext* ctx) {
  // Read once: `load` prepares a context for every request.
  static const std::string token =
      absl::GetFlag(FLAGS_token_file).empty()
          ? ""
          : Trim(ReadFileOrExit("token-file", absl::GetFlag(FLAGS_token_file)));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  if (absl::GetFlag(FLAGS_timeout) > 0) {
    ctx->set_deadline(
        std::chrono::system_clock::now() +
        std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout) * 1000)));
  }
}

// The status with its google.rpc details (field violations, retry delay), on one line each.
std::string Describe(const grpc::Status& s) {
  std::string out =
      std::string(imagegen::StatusCodeName(s.error_code())) + ": " + s.error_message();
  google::rpc::Status st;
  if (!s.error_details().empty() && st.ParseFromString(s.error_details())) {
    for (const auto& d : st.details()) {
      google::rpc::BadRequest br;
      google::rpc::RetryInfo ri;
      if (d.UnpackTo(&br)) {
        for (const auto& v : br.field_violations()) {
          out += "\n  field " + v.field() + ": " + v.description();
        }
      } else if (d.UnpackTo(&ri)) {
        out += "\n  retry after " +
               std::to_string(ri.retry_delay().seconds() + ri.retry_delay().nanos() / 1e9) + " s";
      }
    }
  }
  return out;
}

v1::GenerateRequest BuildRequest(bool need_class) {
  v1::GenerateRequest r;
  r.set_model(absl::GetFlag(FLAGS_model));
  const std::string cls = absl::GetFlag(FLAGS_cls);
  const std::string prompt = absl::GetFlag(FLAGS_prompt), ids = absl::GetFlag(FLAGS_prompt_ids);
  if (!prompt.empty()) r.set_prompt(prompt);
  r.set_negative_prompt(absl::GetFlag(FLAGS_negative_prompt));
  for (size_t at = 0; !ids.empty() && at <= ids.size();) {
    const size_t comma = std::min(ids.find(',', at), ids.size());
    const std::string one = ids.substr(at, comma - at);
    if (one.empty() || one.find_first_not_of("0123456789") != std::string::npos || one.size() > 9) {
      std::cerr << "imagegen: --prompt-ids: '" << one << "' is not a token id\n";
      std::exit(2);
    }
    r.add_prompt_token_ids(std::stoi(one));
    at = comma + 1;
  }
  const bool prompted = !prompt.empty() || !ids.empty();
  if (!cls.empty()) {
    if (cls.find_first_not_of("0123456789") == std::string::npos) {
      r.set_class_id(std::stoi(cls));
    } else {
      r.set_class_name(cls);
    }
  } else if (need_class && !prompted) {
    std::cerr << "imagegen: --class is required (a name from `imagegen models`, or an id), or "
                 "--prompt for a text-to-image model\n";
    std::exit(2);
  }
  if (absl::GetFlag(FLAGS_seed) >= 0) r.set_seed(static_cast<uint64_t>(absl::GetFlag(FLAGS_seed)));
  r.set_priority(absl::GetFlag(FLAGS_priority));
  r.set_user(absl::GetFlag(FLAGS_user));
  if (absl::GetFlag(FLAGS_cfg) >= 0) r.set_cfg_scale(absl::GetFlag(FLAGS_cfg));
  if (absl::GetFlag(FLAGS_cfg_interval) != -1)
    r.set_cfg_interval(absl::GetFlag(FLAGS_cfg_interval));
  if (absl::GetFlag(FLAGS_temperature) >= 0) r.set_temperature(absl::GetFlag(FLAGS_temperature));
  if (absl::GetFlag(FLAGS_top_k) >= 0) r.set_top_k(absl::GetFlag(FLAGS_top_k));
  if (absl::GetFlag(FLAGS_top_p) >= 0) r.set_top_p(absl::GetFlag(FLAGS_top_p));
  if (absl::GetFlag(FLAGS_window) > 0) r.set_window(absl::GetFlag(FLAGS_window));
  r.set_method(absl::GetFlag(FLAGS_method));
  v1::ContinuousOptions* c = r.mutable_continuous();
  if (absl::GetFlag(FLAGS_num_iter) > 0) c->set_num_iter(absl::GetFlag(FLAGS_num_iter));
  c->set_cfg_schedule(absl::GetFlag(FLAGS_cfg_schedule));
  if (absl::GetFlag(FLAGS_prefill) >= 0) c->set_prefill(absl::GetFlag(FLAGS_prefill));
  if (!absl::GetFlag(FLAGS_alignment).empty()) {
    c->set_trajectory_alignment(absl::GetFlag(FLAGS_alignment) != "off");
  }
  if (absl::GetFlag(FLAGS_cspd_authors)) {
    c->set_inner_temperature(42);
    c->set_invert_sigma(true);
    c->set_residual_rounds(100);
    c->set_zero_fallback(true);
    c->set_draft_mean(true);
    c->set_verified_context(true);
  }
  if (c->ByteSizeLong() == 0) r.clear_continuous();
  r.mutable_output()->set_scale(absl::GetFlag(FLAGS_scale));
  r.set_preview_every(absl::GetFlag(FLAGS_preview_every));
  return r;
}

void PrintStats(const v1::GenerateResponse& r, const std::string& out) {
  const v1::GenerationStats& s = r.stats();
  if (s.prompt_tokens() > 0) {
    std::printf("model %s prompt of %d tokens (%lld prefill forwards) seed %llu method %s\n",
                s.model().c_str(), s.prompt_tokens(), static_cast<long long>(s.prefill_forwards()),
                static_cast<unsigned long long>(s.seed()), s.method().c_str());
  } else {
    std::printf("model %s class %d seed %llu method %s\n", s.model().c_str(), s.class_id(),
                static_cast<unsigned long long>(s.seed()), s.method().c_str());
  }
  std::printf(
      "%d tokens in %lld steps (NFE): step compression %.2fx, acceptance %.2f, "
      "%lld draft-model forwards\n",
      r.grid() * r.grid(), static_cast<long long>(s.nfe()), s.step_compression(),
      s.acceptance_rate(), static_cast<long long>(s.draft_forwards()));
  if (s.residual_rounds() > 0) {
    std::printf("residual sampling: %lld proposals, %lld fallbacks; draft-target distance %.3f\n",
                static_cast<long long>(s.residual_rounds()),
                static_cast<long long>(s.residual_fallbacks()), s.draft_target_sq_dist());
  }
  std::printf("queue %.3f s, first token %.3f s, generation %.3f s, decode %.3f s, total %.3f s",
              s.queue_seconds(), s.first_token_seconds(), s.generation_seconds(),
              s.decode_seconds(), s.total_seconds());
  if (!out.empty()) std::printf(" -> %s (%dx%d)", out.c_str(), r.width(), r.height());
  std::printf("\n");
}

// Image `index` of `n`: `out` itself for one image, else out with _<index> before its extension.
std::string OutName(const std::string& out, int index, int n) {
  if (n <= 1) return out;
  const std::filesystem::path p(out);
  return (p.parent_path() /
          (p.stem().string() + "_" + std::to_string(index) + p.extension().string()))
      .string();
}

void WriteOrDie(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f << bytes;
  if (!f) {
    std::cerr << "imagegen: cannot write " << path << "\n";
    std::exit(1);
  }
}

// The call's id as the server sent it back (x-request-id, in the response's headers, or in its
// trailers when the call failed at once); empty when none came.
std::string RequestId(const grpc::ClientContext& ctx) {
  for (const auto* md : {&ctx.GetServerInitialMetadata(), &ctx.GetServerTrailingMetadata()}) {
    const auto it = md->find("x-request-id");
    if (it != md->end()) return std::string(it->second.data(), it->second.size());
  }
  return "";
}

// Newlines and tabs shown as escapes (a chat template on one line).
std::string Escaped(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '\n' ? "\\n" : c == '\t' ? "\\t" : std::string(1, c);
  return out;
}

// ListModels; prints the error and returns false when the call fails.
bool FetchModels(v1::ImageGeneration::Stub& stub, v1::ListModelsResponse* resp) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::Status st = stub.ListModels(&ctx, v1::ListModelsRequest(), resp);
  if (!st.ok()) std::cerr << "imagegen: " << Describe(st) << "\n";
  return st.ok();
}

int Models() {
  auto stub = v1::ImageGeneration::NewStub(Connect());
  v1::ListModelsResponse resp;
  if (!FetchModels(*stub, &resp)) return 1;
  for (const auto& m : resp.models()) {
    const std::string tokens = m.continuous()
                                   ? "continuous tokens of " + std::to_string(m.token_dim())
                                   : "vocabulary " + std::to_string(m.vocab_size());
    std::printf("%s: %dx%d tokens (%s) -> %dx%dx%d images, %d %s%s\n", m.name().c_str(), m.grid(),
                m.grid(), tokens.c_str(), m.image_width(), m.image_height(), m.channels(),
                m.kv_slots(), m.continuous() ? "forward rows" : "KV slots",
                m.draft_model().empty() ? "" : (", draft model " + m.draft_model()).c_str());
    if (m.prompted()) {
      std::printf("  text-to-image: prompts of at most %d tokens (ids < %d)%s; template %s",
                  m.max_prompt_len(), m.text_vocab_size(),
                  m.text_prompts() ? ", text accepted" : ", token ids only",
                  Escaped(m.prompt_template()).c_str());
    } else {
      std::printf("  classes:");
      for (const auto& c : m.classes()) std::printf(" %d=%s", c.id(), c.name().c_str());
    }
    std::printf("\n  methods:");
    for (const auto& x : m.methods()) {
      std::printf(" %s%s", x.c_str(), x == resp.default_method() ? " (default)" : "");
    }
    const auto& d = m.sampling_defaults();
    std::printf("\n  defaults: cfg %.2f, temperature %.2f, top-k %d, top-p %.2f; max window %d\n",
                d.cfg_scale(), d.temperature(), d.top_k(), d.top_p(), m.max_window());
  }
  if (resp.max_images() > 0)
    std::printf("images per request (--n): at most %d\n", resp.max_images());
  return 0;
}

int Generate() {
  auto stub = v1::ImageGeneration::NewStub(Connect());
  v1::GenerateRequest req = BuildRequest(true);
  const int n = absl::GetFlag(FLAGS_n);
  if (n != 1) req.set_n(n);
  const std::string out = absl::GetFlag(FLAGS_out);
  grpc::ClientContext ctx;
  Prepare(&ctx);
  if (const std::string id = absl::GetFlag(FLAGS_request_id); !id.empty()) {
    ctx.AddMetadata("x-request-id", id);
  }
  if (!absl::GetFlag(FLAGS_stream)) {
    v1::GenerateResponse resp;
    grpc::Status st = stub->Generate(&ctx, req, &resp);
    const std::string id = RequestId(ctx);
    if (!st.ok()) {
      std::cerr << "imagegen: " << Describe(st) << (id.empty() ? "" : "\n  request id " + id)
                << "\n";
      return 1;
    }
    if (!id.empty()) std::printf("request id %s\n", id.c_str());
    WriteOrDie(OutName(out, 0, n), resp.image_png());
    PrintStats(resp, OutName(out, 0, n));
    for (const v1::GenerateResponse& more : resp.more_images()) {
      WriteOrDie(OutName(out, more.index(), n), more.image_png());
      PrintStats(more, OutName(out, more.index(), n));
    }
    return 0;
  }
  req.set_preview_every(absl::GetFlag(FLAGS_preview_every));
  req.set_stream_drafts(absl::GetFlag(FLAGS_drafts));
  const std::string dir = absl::GetFlag(FLAGS_preview_dir);
  if (std::error_code ec; !dir.empty() && !std::filesystem::create_directories(dir, ec) && ec) {
    std::cerr << "imagegen: cannot create --preview-dir " << dir << ": " << ec.message() << "\n";
    return 2;
  }
  auto reader = stub->GenerateStream(&ctx, req);
  v1::GenerateStreamResponse msg;
  int frames = 0, finals = 0;
  while (reader->Read(&msg)) {
    if (msg.has_step()) {
      const v1::StepUpdate& s = msg.step();
      const double acc = s.drafts_verified() > 0
                             ? static_cast<double>(s.drafts_accepted()) / s.drafts_verified()
                             : 0;
      if (n > 1) std::printf("[%d] ", s.index());
      std::printf("step %3d  +%-3d tokens  %3d/%d  NFE %lld  window %d  acceptance %.2f", s.step(),
                  s.positions_size(), s.committed(), s.total(), static_cast<long long>(s.nfe()),
                  s.window(), acc);
      if (absl::GetFlag(FLAGS_drafts) && s.draft_tokens_size() > 0) {
        std::printf("  drafts@%d:", s.draft_positions(0));
        for (int i = 0; i < std::min(s.draft_tokens_size(), 8); ++i)
          std::printf(" %d", s.draft_tokens(i));
        if (s.draft_tokens_size() > 8) std::printf(" ...");
      }
      if (!s.preview_png().empty() && !dir.empty()) {
        char name[64];
        if (n > 1) {
          std::snprintf(name, sizeof(name), "/image_%d_step_%04d.png", s.index(), s.step());
        } else {
          std::snprintf(name, sizeof(name), "/step_%04d.png", s.step());
        }
        WriteOrDie(dir + name, s.preview_png());
        std::printf("  preview %s%s", dir.c_str(), name);
        ++frames;
      }
      std::printf("\n");
      std::fflush(stdout);
    } else if (msg.has_final()) {
      finals += 1;
      const std::string name = OutName(out, msg.final().index(), n);
      WriteOrDie(name, msg.final().image_png());
      PrintStats(msg.final(), name);
    }
  }
  grpc::Status st = reader->Finish();
  const std::string id = RequestId(ctx);
  if (!st.ok()) {
    std::cerr << "imagegen: " << Describe(st) << (id.empty() ? "" : "\n  request id " + id) << "\n";
    return 1;
  }
  if (!id.empty()) std::printf("request id %s\n", id.c_str());
  if (finals != std::max(n, 1)) {
    std::cerr << "imagegen: the stream ended with " << finals << " of " << std::max(n, 1)
              << " images\n";
    return 1;
  }
  if (frames > 0) std::printf("%d preview frames in %s\n", frames, dir.c_str());
  return 0;
}

// Closed loop: --concurrency clients each send a request, wait for the image, and send the
// next, for --duration seconds; classes cycle through the model's classes unless --class.
int Load() {
  auto channel = Connect();
  auto stub = v1::ImageGeneration::NewStub(channel);
  int classes = 1;
  v1::ListModelsResponse models;
  if (!FetchModels(*stub, &models)) return 1;
  for (const auto& m : models.models()) {
    if (absl::GetFlag(FLAGS_model).empty() || m.name() == absl::GetFlag(FLAGS_model)) {
      classes = std::max(1, m.classes_size());
      break;
    }
  }
  const int c = absl::GetFlag(FLAGS_concurrency);
  const bool stream = absl::GetFlag(FLAGS_stream);
  const auto t0 = Clock::now();
  const auto stop =
      t0 + std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_duration) * 1000));
  std::mutex mu;
  std::vector<double> latency, first;
  std::map<std::string, int64_t> errors;
  int64_t nfe = 0, tokens = 0;
  double window = 0, expected = 0, predicted = 0, measured = 0;
  std::atomic<int64_t> counter{0};
  Clock::time_point last = t0;
  const v1::GenerateRequest base = BuildRequest(false);
  const bool cycle_classes = base.class_case() == v1::GenerateRequest::CLASS_NOT_SET &&
                             base.prompt().empty() && base.prompt_token_ids_size() == 0;
  std::vector<std::thread> threads;
  for (int k = 0; k < c; ++k) {
    threads.emplace_back([&] {
      while (Clock::now() < stop) {
        v1::GenerateRequest req = base;
        const int64_t i = counter.fetch_add(1);
        if (cycle_classes) req.set_class_id(static_cast<int32_t>(i % classes));
        grpc::ClientContext ctx;
        Prepare(&ctx);
        const auto s0 = Clock::now();
        double ttft = -1;
        grpc::Status st;
        v1::GenerationStats stats;
        if (stream) {
          auto reader = stub->GenerateStream(&ctx, req);
          v1::GenerateStreamResponse m;
          while (reader->Read(&m)) {
            if (m.has_step() && ttft < 0)
              ttft = std::chrono::duration<double>(Clock::now() - s0).count();
            if (m.has_final()) stats = m.final().stats();
          }
          st = reader->Finish();
        } else {
          v1::GenerateResponse resp;
          st = stub->Generate(&ctx, req, &resp);
          stats = resp.stats();
        }
        const auto s1 = Clock::now();
        std::lock_guard<std::mutex> l(mu);
        if (!st.ok()) {
          errors[imagegen::StatusCodeName(st.error_code())] += 1;
          if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
          continue;
        }
        latency.push_back(std::chrono::duration<double>(s1 - s0).count());
        if (ttft >= 0) first.push_back(ttft);
        nfe += stats.nfe();
        tokens += static_cast<int64_t>(stats.step_compression() * stats.nfe() + 0.5);
        window += stats.mean_window();
        expected += stats.expected_tokens();
        predicted += stats.predicted_step_seconds();
        measured += stats.measured_step_seconds();
        last = std::max(last, s1);
      }
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(last - t0).count();
  const auto n = static_cast<double>(latency.size());
  std::printf("load: %d clients (%s), %zu images in %.1f s: %.2f images/s\n", c,
              stream ? "GenerateStream" : "Generate", latency.size(), secs,
              n / std::max(secs, 1e-9));
  std::printf("latency s: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f", Percentile(latency, 0.5),
              Percentile(latency, 0.9), Percentile(latency, 0.99), Percentile(latency, 1.0));
  if (!first.empty()) {
    std::printf("  | first step s: p50 %.3f  p99 %.3f", Percentile(first, 0.5),
                Percentile(first, 0.99));
  }
  std::printf("\nmean NFE per image %.1f; mean window %.1f nodes per step\n",
              n > 0 ? static_cast<double>(nfe) / n : 0.0, n > 0 ? window / n : 0.0);
  if (expected > 0) {  // the goodput controller planned these steps
    std::printf("controller: expected %.0f tokens, committed %lld (%.2fx)", expected,
                static_cast<long long>(tokens), static_cast<double>(tokens) / expected);
  }
  if (predicted > 0) {
    std::printf("%sstep time predicted %.2f s, measured %.2f s (%.2fx)\n", expected > 0 ? "; " : "",
                predicted, measured, measured / predicted);
  } else if (expected > 0) {
    std::printf("\n");
  }
  for (const auto& [code, count] : errors) {
    std::printf("errors %s: %lld\n", code.c_str(), static_cast<long long>(count));
  }
  return latency.empty() ? 1 : 0;
}

// grpc.health.v1 Check: prints the status and exits 0 only when SERVING (1 otherwise, 2 when
// the call fails), so that a container HEALTHCHECK or a script can use it as it is. Without
// --timeout the call gets 5 s: a probe must not hang.
int Health() {
  auto stub = grpc::health::v1::Health::NewStub(Connect());
  grpc::ClientContext ctx;
  Prepare(&ctx);
  if (absl::GetFlag(FLAGS_timeout) <= 0) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status st = stub->Check(&ctx, req, &resp);
  if (!st.ok()) {
    std::cerr << "imagegen health: " << Describe(st) << "\n";
    return 2;
  }
  std::cout << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()) << "\n";
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "imagegen models | generate --class NAME [--stream] [--out FILE] | load [--concurrency N] "
      "[--duration S] | health [--service S]\n  (flags: --target, --method, --seed, --cfg, "
      "--window, --token-file, "
      "--tls-ca, ...; --help lists all)");
  absl::FlagsUsageConfig usage;  // --help lists this file's flags, not Abseil's or gRPC's
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "client/imagegen_cli.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  std::vector<std::string> args(argv, argv + argc);
  std::vector<char*> argp;
  for (std::string& a : args) {
    if (a == "--class" || a.rfind("--class=", 0) == 0) a = "--cls" + a.substr(7);
    if (a.rfind("--", 0) == 0) {  // --preview-dir and --preview_dir alike
      const size_t end = std::min(a.find('='), a.size());
      std::replace(a.begin() + 2, a.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
    }
    argp.push_back(a.data());
  }
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  if (rest.size() != 2) {
    std::cerr << "usage: " << absl::ProgramUsageMessage() << "\n";
    return 2;
  }
  const std::string cmd = rest[1];
  if (cmd == "models") return Models();
  if (cmd == "generate") return Generate();
  if (cmd == "load") return Load();
  if (cmd == "health") return Health();
  std::cerr << "imagegen: unknown command '" << cmd << "' (models, generate, load, health)\n";
  return 2;
}
