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
#include <absl/strings/ascii.h>
#include <absl/strings/match.h>
#include <absl/strings/numbers.h>
#include <absl/strings/str_cat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
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

// Whether `target` is this machine (a token may go there without TLS).
bool Loopback(const std::string& target) {
  for (const char* p : {"127.", "localhost", "[::1]", "ipv4:127.", "ipv6:[::1]", "unix:"}) {
    if (absl::StartsWith(target, p)) return true;
  }
  return false;
}

bool TlsWanted() {
  return !absl::GetFlag(FLAGS_tls_ca).empty() || !absl::GetFlag(FLAGS_tls_cert).empty() ||
         !absl::GetFlag(FLAGS_tls_key).empty() || !absl::GetFlag(FLAGS_tls_server_name).empty();
}

// Any TLS flag turns TLS on (without --tls-ca, the system's roots check the server): a client
// certificate or server name given without --tls-ca must not send the call in clear.
std::shared_ptr<grpc::Channel> Connect() {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  const std::string ca = absl::GetFlag(FLAGS_tls_ca), cert = absl::GetFlag(FLAGS_tls_cert),
                    key = absl::GetFlag(FLAGS_tls_key);
  if (cert.empty() != key.empty()) {
    std::cerr << "imagegen: --tls-cert and --tls-key go together (a client certificate and its "
                 "key)\n";
    std::exit(2);
  }
  if (TlsWanted()) {
    grpc::SslCredentialsOptions o;
    if (!ca.empty()) o.pem_root_certs = ReadFileOrExit("tls-ca", ca);  // else the system's roots
    if (!cert.empty()) {
      o.pem_cert_chain = ReadFileOrExit("tls-cert", cert);
      o.pem_private_key = ReadFileOrExit("tls-key", key);
    }
    creds = grpc::SslCredentials(o);
    if (!absl::GetFlag(FLAGS_tls_server_name).empty()) {
      args.SetSslTargetNameOverride(absl::GetFlag(FLAGS_tls_server_name));
    }
  }
  return grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target), creds, args);
}

// The bearer token: the file's one line that is neither blank nor a # comment, trimmed. It goes
// into a header, so it must be printable ASCII without spaces (a line of the server's key file
// holds a name after the token). Errors name the line, never the token.
std::string TokenOrExit(const std::string& path) {
  const std::string data = ReadFileOrExit("token-file", path);
  std::string token;
  int at = 0, token_line = 0;
  for (size_t b = 0; b < data.size();) {
    const size_t e = std::min(data.find('\n', b), data.size());
    const std::string line = Trim(data.substr(b, e - b));
    b = e + 1;
    ++at;
    if (line.empty() || line[0] == '#') continue;
    auto fail = [&](const std::string& why) {
      std::cerr << "imagegen: --token-file: " << path << ": line " << at << ": " << why << "\n";
      std::exit(2);
    };
    if (token_line > 0) {
      fail("a second token (line " + std::to_string(token_line) +
           " holds one); the file must hold one token alone");
    }
    for (const char c : line) {
      if (c < 0x21 || c > 0x7e) {
        fail(
            "the token holds a space, a tab or a character that is not printable ASCII (a "
            "line of the server's key file holds more than the token: put the token alone in "
            "the file)");
      }
    }
    token = line;
    token_line = at;
  }
  if (token.empty()) {
    std::cerr << "imagegen: --token-file: " << path << " holds no token\n";
    std::exit(2);
  }
  if (!TlsWanted() && !Loopback(absl::GetFlag(FLAGS_target))) {
    std::cerr << "imagegen: warning: --token-file without TLS: the token crosses the network in "
                 "clear (--tls-ca, or any --tls-* flag, turns TLS on)\n";
  }
  return token;
}

void Prepare(grpc::ClientContext* ctx) {
  // Read once: `load` prepares a context for every request.
  static const std::string token =
      absl::GetFlag(FLAGS_token_file).empty() ? "" : TokenOrExit(absl::GetFlag(FLAGS_token_file));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  if (absl::GetFlag(FLAGS_timeout) > 0) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(
                          std::chrono::duration<double>(absl::GetFlag(FLAGS_timeout))));
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
      int32_t id = 0;
      if (!absl::SimpleAtoi(cls, &id)) {
        std::cerr << "imagegen: --class: " << cls << " is out of range for a class id\n";
        std::exit(2);
      }
      r.set_class_id(id);
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
    c->set_trajectory_alignment(absl::AsciiStrToLower(absl::GetFlag(FLAGS_alignment)) == "on");
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
  if (absl::GetFlag(FLAGS_stream)) r.set_preview_every(absl::GetFlag(FLAGS_preview_every));
  return r;
}

// Flag values, checked before any call: one out of range exits 2 naming its flag. The CLI sends
// a sampling field only when it is not its default sentinel (-1), so without this check a
// negative value would silently mean "the model's default" rather than reach the server's own
// check.
void CheckFlagsOrExit(const std::string& cmd) {
  auto fail = [](const std::string& flag, const std::string& why) {
    std::cerr << "imagegen: --" << flag << ": " << why << "\n";
    std::exit(2);
  };
  auto at_least_0_or_default = [&](const char* flag, double v) {
    if (!std::isfinite(v) || (v < 0 && v != -1)) {
      fail(flag, absl::StrCat(v, " is out of range (>= 0, or -1: the default)"));
    }
  };
  at_least_0_or_default("cfg", absl::GetFlag(FLAGS_cfg));
  at_least_0_or_default("temperature", absl::GetFlag(FLAGS_temperature));
  at_least_0_or_default("top-p", absl::GetFlag(FLAGS_top_p));
  at_least_0_or_default("top-k", absl::GetFlag(FLAGS_top_k));
  at_least_0_or_default("cfg-interval", absl::GetFlag(FLAGS_cfg_interval));
  at_least_0_or_default("prefill", absl::GetFlag(FLAGS_prefill));
  if (absl::GetFlag(FLAGS_seed) < -1) fail("seed", "must be >= 0 (or -1: the server picks one)");
  if (absl::GetFlag(FLAGS_window) < 0) fail("window", "must be >= 0 (0: the preset's)");
  if (absl::GetFlag(FLAGS_num_iter) < 0) fail("num-iter", "must be >= 0 (0: the model's)");
  if (absl::GetFlag(FLAGS_scale) < 1) fail("scale", "must be >= 1");
  if (absl::GetFlag(FLAGS_n) < 1) fail("n", "must be >= 1");
  if (const std::string a = absl::AsciiStrToLower(absl::GetFlag(FLAGS_alignment));
      !a.empty() && a != "on" && a != "off") {
    fail("alignment", "'" + absl::GetFlag(FLAGS_alignment) + "' is neither on nor off");
  }
  if (const double t = absl::GetFlag(FLAGS_timeout); !std::isfinite(t) || t < 0 || t > 1e7) {
    fail("timeout", "must be between 0 (none) and 1e7 seconds");
  }
  if (absl::GetFlag(FLAGS_preview_every) < 0) fail("preview-every", "must be >= 0");
  if (!absl::GetFlag(FLAGS_stream)) {
    if (absl::GetFlag(FLAGS_preview_every) > 0) fail("preview-every", "needs --stream");
    if (!absl::GetFlag(FLAGS_preview_dir).empty()) fail("preview-dir", "needs --stream");
    if (absl::GetFlag(FLAGS_drafts)) fail("drafts", "needs --stream");
  }
  if (cmd == "load") {
    if (const int c = absl::GetFlag(FLAGS_concurrency); c < 1 || c > 4096) {
      fail("concurrency", "must be between 1 and 4096");
    }
    if (const double d = absl::GetFlag(FLAGS_duration); !std::isfinite(d) || d <= 0 || d > 1e7) {
      fail("duration", "must be more than 0 and at most 1e7 seconds");
    }
  }
  if (cmd == "generate") {  // found before the image is made, not after
    const std::filesystem::path dir = std::filesystem::path(absl::GetFlag(FLAGS_out)).parent_path();
    if (std::error_code ec; !dir.empty() && !std::filesystem::is_directory(dir, ec)) {
      fail("out", dir.string() + " is not a directory");
    }
  }
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

// Atomically (a temporary file renamed over `path`): a failed write leaves no half image and
// keeps the file that was there.
void WriteOrDie(const std::string& path, const std::string& bytes) {
  if (const imagegen::Status st = imagegen::WriteFileAtomically(path, bytes); !st.ok()) {
    std::cerr << "imagegen: " << st.message() << "\n";
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
    if (1 + resp.more_images_size() != std::max(n, 1)) {
      std::cerr << "imagegen: the answer held " << 1 + resp.more_images_size() << " of "
                << std::max(n, 1) << " images\n";
      return 1;
    }
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

// The server's RetryInfo delay, when the status carries one.
std::optional<double> RetryDelay(const grpc::Status& s) {
  google::rpc::Status st;
  if (s.error_details().empty() || !st.ParseFromString(s.error_details())) return std::nullopt;
  for (const auto& d : st.details()) {
    google::rpc::RetryInfo ri;
    if (d.UnpackTo(&ri)) return ri.retry_delay().seconds() + ri.retry_delay().nanos() / 1e9;
  }
  return std::nullopt;
}

// Codes no retry can mend (a wrong flag, model, method or token): the run stops at the first.
bool Permanent(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNIMPLEMENTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
      return true;
    default:
      return false;
  }
}

// Closed loop: --concurrency clients each send a request, wait for the image, and send the
// next, for --duration seconds; classes cycle through the model's classes unless --class.
// A refused request (RESOURCE_EXHAUSTED, UNAVAILABLE, any other passing error) is counted and
// its client waits before the next: the server's RetryInfo delay, else 100 ms, at most 5 s,
// with jitter, outside the shared lock. A permanent error (Permanent above) stops the run.
// The rate is the images over the run's whole time (until the last client returned). Exit 1
// when no image came, when a permanent error stopped the run, or when a request failed with
// anything but RESOURCE_EXHAUSTED (the server's admission under the load asked for).
int Load() {
  auto channel = Connect();
  auto stub = v1::ImageGeneration::NewStub(channel);
  int classes = 1;
  v1::ListModelsResponse models;
  if (!FetchModels(*stub, &models)) return 1;
  const std::string model = absl::GetFlag(FLAGS_model);
  bool found = model.empty() && models.models_size() > 0;
  std::string names;
  for (const auto& m : models.models()) {
    names += (names.empty() ? "" : ", ") + m.name();
    if (model.empty() || m.name() == model) {
      classes = std::max(1, m.classes_size());
      found = true;
      break;
    }
  }
  if (!found) {
    std::cerr << "imagegen: --model: the server serves no model '" << model
              << "' (it serves: " << names << ")\n";
    return 2;
  }
  const int c = absl::GetFlag(FLAGS_concurrency);
  const bool stream = absl::GetFlag(FLAGS_stream);
  const auto t0 = Clock::now();
  const auto stop =
      t0 + std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_duration) * 1000));
  std::mutex mu;
  std::vector<double> latency, first;
  std::map<std::string, int64_t> errors;
  std::string permanent;  // the first permanent error, described
  std::atomic<bool> halt{false};
  int64_t nfe = 0, tokens = 0;
  double window = 0, expected = 0, predicted = 0, measured = 0;
  std::atomic<int64_t> counter{0};
  const v1::GenerateRequest base = BuildRequest(false);
  const bool cycle_classes = base.class_case() == v1::GenerateRequest::CLASS_NOT_SET &&
                             base.prompt().empty() && base.prompt_token_ids_size() == 0;
  std::vector<std::thread> threads;
  for (int k = 0; k < c; ++k) {
    threads.emplace_back([&, k] {
      std::mt19937 jitter(static_cast<uint32_t>(k) * 2654435761u + 1);
      while (Clock::now() < stop && !halt.load()) {
        v1::GenerateRequest req = base;
        const int64_t i = counter.fetch_add(1);
        if (cycle_classes) req.set_class_id(static_cast<int32_t>(i % classes));
        grpc::ClientContext ctx;
        Prepare(&ctx);
        const auto s0 = Clock::now();
        double ttft = -1;
        grpc::Status st;
        v1::GenerationStats stats;
        bool imaged = false;
        if (stream) {
          auto reader = stub->GenerateStream(&ctx, req);
          v1::GenerateStreamResponse m;
          while (reader->Read(&m)) {
            if (m.has_step() && ttft < 0)
              ttft = std::chrono::duration<double>(Clock::now() - s0).count();
            if (m.has_final()) {
              stats = m.final().stats();
              imaged = true;
            }
          }
          st = reader->Finish();
        } else {
          v1::GenerateResponse resp;
          st = stub->Generate(&ctx, req, &resp);
          stats = resp.stats();
          imaged = st.ok();
        }
        const auto s1 = Clock::now();
        if (!st.ok() || !imaged) {
          {
            std::lock_guard<std::mutex> l(mu);
            errors[st.ok() ? std::string("OK without an image")
                           : imagegen::StatusCodeName(st.error_code())] += 1;
            if (!st.ok() && Permanent(st.error_code())) {
              if (permanent.empty()) permanent = Describe(st);
              halt = true;
              break;
            }
          }
          const double wait = std::clamp(RetryDelay(st).value_or(0.1), 0.01, 5.0) *
                              std::uniform_real_distribution<double>(0.8, 1.2)(jitter);
          const auto until = std::min(
              stop, Clock::now() + std::chrono::microseconds(static_cast<int64_t>(wait * 1e6)));
          while (Clock::now() < until && !halt.load()) {
            std::this_thread::sleep_for(
                std::min<Clock::duration>(until - Clock::now(), std::chrono::milliseconds(50)));
          }
          continue;
        }
        std::lock_guard<std::mutex> l(mu);
        latency.push_back(std::chrono::duration<double>(s1 - s0).count());
        if (ttft >= 0) first.push_back(ttft);
        nfe += stats.nfe();
        tokens += static_cast<int64_t>(stats.step_compression() * stats.nfe() + 0.5);
        window += stats.mean_window();
        expected += stats.expected_tokens();
        predicted += stats.predicted_step_seconds();
        measured += stats.measured_step_seconds();
      }
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
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
  int64_t failed = 0, refused = 0;
  for (const auto& [code, count] : errors) {
    std::printf("errors %s: %lld\n", code.c_str(), static_cast<long long>(count));
    failed += count;
    if (code == "RESOURCE_EXHAUSTED") refused += count;
  }
  if (failed > 0) {
    std::printf("requests: %zu ok, %lld failed (%.1f%% ok)\n", latency.size(),
                static_cast<long long>(failed), 100.0 * n / (n + static_cast<double>(failed)));
  }
  if (!permanent.empty()) {
    std::cerr << "imagegen: load stopped: " << permanent << "\n";
    return 1;
  }
  return latency.empty() || failed > refused ? 1 : 0;
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
  if (cmd == "models" || cmd == "generate" || cmd == "load" || cmd == "health") {
    CheckFlagsOrExit(cmd);
  }
  if (cmd == "models") return Models();
  if (cmd == "generate") return Generate();
  if (cmd == "load") return Load();
  if (cmd == "health") return Health();
  std::cerr << "imagegen: unknown command '" << cmd << "' (models, generate, load, health)\n";
  return 2;
}
