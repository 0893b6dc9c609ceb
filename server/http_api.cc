#include "server/http_api.h"

#include <absl/strings/escaping.h>
#include <absl/strings/str_join.h>
#include <microhttpd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <strings.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "engine/image/png.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "server/convert.h"
#include "server/http_util.h"
#include "server/playground/assets.h"

namespace imagegen::server {

using json = nlohmann::json;

namespace {

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------------------------
// Errors: OpenAI's error JSON and the matching HTTP status.

struct HttpError {
  unsigned status = MHD_HTTP_INTERNAL_SERVER_ERROR;
  std::string type = "server_error", message, param, code;
  double retry_after = -1;  // seconds (429; 503 of an unhealthy engine)
};

json ErrorJson(const HttpError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

// The request parameter a GenerateRequest field is about.
std::string HttpParam(const std::string& field) {
  if (field == "class_id" || field == "class_name" || field == "prompt" ||
      field == "prompt_token_ids") {
    return "prompt";
  }
  if (field == "negative_prompt_token_ids") return "negative_prompt";
  if (field == "output.scale") return "size";
  if (field == "request" || field.rfind("continuous.", 0) == 0) return "";
  if (field.rfind("policy.", 0) == 0) return "method";
  return field;
}

HttpError FromGrpc(const grpc::Status& st) {
  HttpError e;
  e.message = st.error_message();
  google::rpc::Status details;
  const bool has_details =
      !st.error_details().empty() && details.ParseFromString(st.error_details());
  auto retry_info = [&] {  // RetryInfo's delay as Retry-After
    for (int i = 0; has_details && i < details.details_size(); ++i) {
      google::rpc::RetryInfo ri;
      if (details.details(i).UnpackTo(&ri)) {
        e.retry_after =
            static_cast<double>(ri.retry_delay().seconds()) + ri.retry_delay().nanos() / 1e9;
      }
    }
  };
  switch (st.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
      e.status = MHD_HTTP_BAD_REQUEST;
      e.type = "invalid_request_error";
      for (int i = 0; has_details && i < details.details_size(); ++i) {
        google::rpc::BadRequest br;
        if (details.details(i).UnpackTo(&br) && br.field_violations_size() > 0) {
          const std::string& field = br.field_violations(0).field();
          e.param = HttpParam(field);
          // The message names the parameter as this API spells it.
          if (!e.param.empty() && e.param != field && e.message.rfind(field + ": ", 0) == 0) {
            e.message = e.param + ": " + e.message.substr(field.size() + 2);
          }
        }
      }
      break;
    case grpc::StatusCode::PERMISSION_DENIED:
      e.status = MHD_HTTP_FORBIDDEN;
      e.type = "invalid_request_error";
      e.code = "permission_denied";
      for (int i = 0; has_details && i < details.details_size(); ++i) {
        google::rpc::BadRequest br;
        if (details.details(i).UnpackTo(&br) && br.field_violations_size() > 0) {
          e.param = HttpParam(br.field_violations(0).field());
        }
      }
      break;
    case grpc::StatusCode::UNAUTHENTICATED:
      e.status = MHD_HTTP_UNAUTHORIZED;
      e.type = "invalid_request_error";
      e.code = "invalid_api_key";
      break;
    case grpc::StatusCode::NOT_FOUND:
      e.status = MHD_HTTP_NOT_FOUND;
      e.type = "invalid_request_error";
      e.param = "model";
      e.code = "model_not_found";
      break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      e.status = MHD_HTTP_TOO_MANY_REQUESTS;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      e.retry_after = 1;
      retry_info();
      break;
    case grpc::StatusCode::UNAVAILABLE:
      e.status = MHD_HTTP_SERVICE_UNAVAILABLE;
      e.code = "unavailable";
      retry_info();  // an unhealthy engine's refusal says when to come back; loading does not
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      e.status = MHD_HTTP_GATEWAY_TIMEOUT;
      e.code = "timeout";
      break;
    default:
      e.status = MHD_HTTP_INTERNAL_SERVER_ERROR;
      break;
  }
  return e;
}

MHD_Result ReplyError(MHD_Connection* c, const HttpError& e, const HttpHeaders& headers = {}) {
  return HttpReply(c, e.status, ErrorJson(e).dump(-1, ' ', false, json::error_handler_t::replace),
                   "application/json", e.retry_after, headers);
}

// A playground file. It needs no token (it holds no data; the API calls it makes do), and its
// Content-Security-Policy lets it load nothing but this server's own files.
MHD_Result ReplyAsset(MHD_Connection* c, const StaticAsset& a) {
  MHD_Response* r = MHD_create_response_from_buffer(a.size, const_cast<unsigned char*>(a.data),
                                                    MHD_RESPMEM_PERSISTENT);
  if (r == nullptr) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, a.type);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
  MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
  MHD_add_response_header(r, "Content-Security-Policy",
                          "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'");
  const MHD_Result ok = MHD_queue_response(c, MHD_HTTP_OK, r);
  MHD_destroy_response(r);
  return ok;
}

// ---------------------------------------------------------------------------------------------
// JSON shapes of the responses.

json StatsJson(const v1::GenerationStats& s) {
  return {{"seed", s.seed()},
          {"model", s.model()},
          {"method", s.method()},
          {"policy", s.policy()},
          {"class_id", s.class_id()},
          {"cfg_scale", s.cfg_scale()},
          {"cfg_interval", s.cfg_interval()},
          {"temperature", s.temperature()},
          {"top_k", s.top_k()},
          {"top_p", s.top_p()},
          {"nfe", s.nfe()},
          {"draft_forwards", s.draft_forwards()},
          {"drafts_verified", s.drafts_verified()},
          {"drafts_accepted", s.drafts_accepted()},
          {"acceptance_rate", s.acceptance_rate()},
          {"step_compression", s.step_compression()},
          {"mean_window", s.mean_window()},
          {"prompt_tokens", s.prompt_tokens()},
          {"prefill_forwards", s.prefill_forwards()},
          {"preemptions", s.preemptions()},
          {"queue_seconds", s.queue_seconds()},
          {"first_token_seconds", s.first_token_seconds()},
          {"generation_seconds", s.generation_seconds()},
          {"decode_seconds", s.decode_seconds()},
          {"total_seconds", s.total_seconds()}};
}

json ModelsJson(const std::vector<ModelInfo>& models, const std::string& default_method,
                int max_images) {
  json data = json::array();
  for (const ModelInfo& m : models) {
    json sizes = json::array();
    for (int s : {1, 2, 4, 8, 16}) {
      if (s > MaxScale(m)) break;
      sizes.push_back(std::to_string(m.image_width * s) + "x" + std::to_string(m.image_height * s));
    }
    json classes = json::array();
    for (const std::string& c : m.class_names) classes.push_back(c);
    json methods = json::array();
    for (const std::string& x : m.methods) methods.push_back(x);
    data.push_back({{"id", m.name},
                    {"object", "model"},
                    {"created", 0},
                    {"owned_by", "imagegen"},
                    {"imagegen",
                     {{"prompted", m.prompted},
                      {"max_prompt_len", m.max_prompt_len},
                      {"classes", classes},
                      {"methods", methods},
                      {"default_method", m.continuous ? std::string("mar") : default_method},
                      {"sizes", sizes},
                      {"max_images", max_images},
                      {"grid", m.grid},
                      {"sampling_defaults",
                       {{"cfg_scale", m.sampling_defaults.cfg_scale},
                        {"temperature", m.sampling_defaults.temperature},
                        {"top_k", m.sampling_defaults.top_k},
                        {"top_p", m.sampling_defaults.top_p}}}}}});
  }
  return {{"object", "list"}, {"data", data}};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The request body

bool ParseImagesRequest(const std::string& body, const std::vector<ModelInfo>& models,
                        int max_partial_images, int64_t max_images, ImagesRequest* out,
                        std::string* param, std::string* message) {
  auto fail = [&](const std::string& p, const std::string& m) {
    *param = p;
    *message = m;
    return false;
  };
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return fail("", "the body is not valid JSON");
  if (!j.is_object()) return fail("", "the body must be a JSON object");
  v1::GenerateRequest& r = out->req;
  // Types first: each parameter has one JSON type.
  auto str = [&](const char* k, std::string* v) {
    if (!j.contains(k) || j[k].is_null()) return true;
    if (!j[k].is_string()) return fail(k, "must be a string");
    *v = j[k].get<std::string>();
    return true;
  };
  auto num = [&](const char* k, std::optional<double>* v) {
    if (!j.contains(k) || j[k].is_null()) return true;
    if (!j[k].is_number()) return fail(k, "must be a number");
    *v = j[k].get<double>();
    return true;
  };
  auto integer = [&](const char* k, std::optional<int64_t>* v, int64_t lo, int64_t hi) {
    if (!j.contains(k) || j[k].is_null()) return true;
    if (!j[k].is_number_integer()) return fail(k, "must be an integer");
    const auto x = j[k].get<int64_t>();
    if (x < lo || x > hi) {
      return fail(k, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    *v = x;
    return true;
  };
  static const std::vector<std::string> kKnown = {
      "prompt",       "model",           "n",
      "size",         "response_format", "user",
      "stream",       "partial_images",  "output_format",
      "background",   "quality",         "moderation",
      "seed",         "method",          "cfg_scale",
      "temperature",  "top_k",           "top_p",
      "window",       "negative_prompt", "cfg_interval",
      "stream_steps", "priority"};
  for (const auto& [k, v] : j.items()) {
    if (std::find(kKnown.begin(), kKnown.end(), k) == kKnown.end()) {
      // The name is echoed (in `param` too) at most 64 bytes long, as every echoed value is.
      // ASCII only when cut: a cut through a UTF-8 sequence made the error's JSON throw.
      std::string shown = k;
      if (k.size() > 64) {
        shown.clear();
        for (size_t i = 0; i < 61; ++i) {
          const unsigned char c = static_cast<unsigned char>(k[i]);
          shown += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
        }
        shown += "...";
      }
      return fail(shown, "unknown parameter " + Quoted(k) +
                             " (imagegen takes: " + absl::StrJoin(kKnown, ", ") + ")");
    }
  }
  std::string prompt, model, size, format, user, output_format, background, quality, moderation,
      method, negative;
  if (!str("prompt", &prompt) || !str("model", &model) || !str("size", &size) ||
      !str("response_format", &format) || !str("user", &user) ||
      !str("output_format", &output_format) || !str("background", &background) ||
      !str("quality", &quality) || !str("moderation", &moderation) || !str("method", &method) ||
      !str("negative_prompt", &negative)) {
    return false;
  }
  std::optional<int64_t> n, partial, seed, top_k, window, cfg_interval, priority;
  std::optional<double> cfg, temperature, top_p;
  if (!integer("n", &n, 1, max_images) ||
      !integer("partial_images", &partial, 0, max_partial_images) ||
      !integer("seed", &seed, 0, INT64_MAX) || !integer("top_k", &top_k, 0, 1 << 30) ||
      !integer("window", &window, 1, 1 << 20) ||
      !integer("cfg_interval", &cfg_interval, -1, 1 << 20) ||
      !integer("priority", &priority, INT32_MIN, INT32_MAX) || !num("cfg_scale", &cfg) ||
      !num("temperature", &temperature) || !num("top_p", &top_p)) {
    return false;
  }
  for (const auto& [k, v] : {std::pair<const char*, bool*>{"stream", &out->stream},
                             std::pair<const char*, bool*>{"stream_steps", &out->stream_steps}}) {
    if (j.contains(k) && !j[k].is_null()) {
      if (!j[k].is_boolean()) return fail(k, "must be true or false");
      *v = j[k].get<bool>();
    }
  }
  if (prompt.empty())
    return fail("prompt",
                "required: a text prompt (or, for a class-conditional model, a class name)");
  if (!format.empty() && format != "b64_json") {
    return fail("response_format", "only b64_json is served (no image URLs)");
  }
  if (!output_format.empty() && output_format != "png") {
    return fail("output_format", "only png is served");
  }
  if (!background.empty() && background != "auto" && background != "opaque") {
    return fail("background", "auto or opaque (images have no alpha channel)");
  }
  if (!quality.empty() && quality != "auto" && quality != "standard") {
    return fail("quality", "auto or standard (the method sets speed, never quality)");
  }
  if (!moderation.empty() && moderation != "auto" && moderation != "low") {
    return fail("moderation", "auto or low");
  }
  if (partial.has_value() && !out->stream) return fail("partial_images", "needs stream: true");
  if (out->stream_steps && !out->stream) return fail("stream_steps", "needs stream: true");
  out->partial_images = static_cast<int>(partial.value_or(0));

  // The model: as named, or the server's first.
  const ModelInfo* info = models.empty() ? nullptr : &models[0];
  for (const ModelInfo& m : models) {
    if (m.name == model) info = &m;
  }
  r.set_model(model);
  if (info != nullptr && !model.empty() && info->name != model) info = nullptr;  // NOT_FOUND later
  if (info == nullptr || info->prompted) {
    r.set_prompt(prompt);
  } else {
    r.set_class_name(prompt);  // a class-conditional model: the prompt names the class
  }
  if (!negative.empty()) r.set_negative_prompt(negative);
  if (n.has_value()) r.set_n(static_cast<int32_t>(std::min<int64_t>(*n, INT32_MAX)));
  if (seed.has_value()) r.set_seed(static_cast<uint64_t>(*seed));
  if (cfg.has_value()) r.set_cfg_scale(*cfg);
  if (temperature.has_value()) r.set_temperature(*temperature);
  if (top_k.has_value()) r.set_top_k(static_cast<int32_t>(*top_k));
  if (top_p.has_value()) r.set_top_p(*top_p);
  if (window.has_value()) r.set_window(static_cast<int32_t>(*window));
  if (cfg_interval.has_value()) r.set_cfg_interval(static_cast<int32_t>(*cfg_interval));
  if (priority.has_value()) r.set_priority(static_cast<int32_t>(*priority));
  r.set_user(user);
  r.set_method(method);
  // The size: the model's own, or an integer multiple of it (nearest-neighbour upscaling).
  int scale = 1;
  if (info != nullptr) {
    const auto w = info->image_width, h = info->image_height;
    if (!size.empty() && size != "auto") {
      scale = 0;
      const int most = MaxScale(*info);
      for (int s = 1; s <= most; ++s) {
        if (size == std::to_string(w * s) + "x" + std::to_string(h * s)) scale = s;
      }
      if (scale == 0) {
        return fail("size", "model '" + info->name + "' draws " + std::to_string(w) + "x" +
                                std::to_string(h) + " images; sizes are multiples of it up to " +
                                std::to_string(most) + "x (" + std::to_string(w) + "x" +
                                std::to_string(h) + ", " + std::to_string(2 * w) + "x" +
                                std::to_string(2 * h) + ", ..., " + std::to_string(most * w) + "x" +
                                std::to_string(most * h) + ") or auto");
      }
    }
    out->size = std::to_string(w * scale) + "x" + std::to_string(h * scale);
  }
  r.mutable_output()->set_scale(scale);
  return true;
}

// ---------------------------------------------------------------------------------------------
// The server's shared state and one request.

class HttpCall;

struct HttpApi::Shared : std::enable_shared_from_this<HttpApi::Shared> {
  ImageGenerationService* service = nullptr;
  // HTTPS (HttpApi::SetCertificate): the certificates by generation (1, 2, ... per change);
  // the last is what the handshake callback hands out. Empty: plain HTTP. A connection's
  // handshake takes the certificate current then, which is no older than the one current
  // when it was accepted (`accepted_at`, one entry per open connection): those older than
  // every open connection's are freed (GnuTLS does not copy them, so not before).
  std::mutex cert_mu;
  std::map<int64_t, std::shared_ptr<const ServerCertificate>> served;
  std::multiset<int64_t> accepted_at;
  void FreeUnusedCertificates() {  // under cert_mu
    if (served.empty()) return;
    const int64_t oldest = accepted_at.empty()
                               ? served.rbegin()->first
                               : std::min(*accepted_at.begin(), served.rbegin()->first);
    served.erase(served.begin(), served.lower_bound(oldest));
  }
  MHD_Daemon* daemon = nullptr;  // set once started (the registry's lookup)
  std::mutex mu;
  std::condition_variable cv;
  std::map<HttpCall*, std::weak_ptr<HttpCall>> open;  // connections not yet completed
  // Of those, the generation requests (HttpCall::Start ran): what Stop waits for. A request
  // still sending its body is not one (it would hold the drain for the whole grace).
  std::set<HttpCall*> generating;
  bool stop = false;
  std::thread watchdog;
};

class HttpCall : public std::enable_shared_from_this<HttpCall> {
 public:
  HttpCall(std::shared_ptr<HttpApi::Shared> shared, MHD_Connection* conn)
      : shared_(std::move(shared)), svc_(shared_->service), conn_(conn), t0_(Clock::now()) {}

  // --- the event loop ------------------------------------------------------------------------
  void Append(const char* data, size_t size) {
    if (body_.size() + size > HttpApi::kMaxBodyBytes) {
      too_large_ = true;
      return;
    }
    body_.append(data, size);
  }
  // The body's Content-Length is over HttpApi::kMaxBodyBytes: the request is answered at once,
  // before any of the body is read (libmicrohttpd then reads none of it and closes).
  void MarkTooLarge() { too_large_ = true; }
  bool too_large() const { return too_large_; }

  MHD_Result Handle(const std::string& path, const std::string& method) {
    {
      std::unique_lock<std::mutex> l(mu_);
      if (state_ == State::kWaiting) {  // resumed
        if (reply_) {
          state_ = State::kDone;
          return HttpReply(conn_, reply_->first, reply_->second, "application/json", retry_after_,
                           IdHeader());
        }
        if (gone_) return MHD_NO;  // the client hung up: close
        suspended_ = true;
        MHD_suspend_connection(conn_);
        return MHD_YES;
      }
      if (state_ != State::kNew) return MHD_YES;
      state_ = State::kDone;  // unless a generation starts below
    }
    // The GET routes: health, the playground's files, its config and the model list.
    const StaticAsset* asset = FindPlaygroundAsset(path);
    const bool health = path == "/health" || path == "/health/live" || path == "/health/ready";
    if ((asset != nullptr || health || path == "/playground/config" || path == "/v1/models") &&
        method != MHD_HTTP_METHOD_GET && method != MHD_HTTP_METHOD_HEAD) {
      return ReplyError(conn_, MethodNotAllowed("GET"));
    }
    // Health for load balancers and probes that speak HTTP, no token (as gRPC's Health): live
    // while the server answers; ready (and /health) once the models are loaded, until draining.
    // An unhealthy engine (the daemon's --engine-stall-seconds, --engine-failed-steps) fails
    // both, with what is wrong.
    if (const std::string why = health ? svc_->unhealthy() : "";
        !why.empty() && svc_->engine() != nullptr) {
      const EngineProgress p = svc_->engine()->Progress();
      json body = {{"status", why}};
      if (why == "stalled") {
        body["thread"] = p.thread();
        body["seconds"] = p.seconds();
      } else {
        body["model"] = p.failed_model;
        body["failed_steps"] = p.failed_steps;
        body["error"] = p.last_error;
      }
      return HttpReply(conn_, MHD_HTTP_SERVICE_UNAVAILABLE, body.dump());
    }
    if (path == "/health/live") return HttpReply(conn_, MHD_HTTP_OK, R"({"status":"alive"})");
    if (health) {
      const bool loading = svc_->engine() == nullptr, draining = svc_->draining();
      return HttpReply(conn_, loading || draining ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_OK,
                       json({{"status", loading    ? "loading"
                                        : draining ? "draining"
                                                   : "ready"}})
                           .dump());
    }
    if (asset != nullptr) return ReplyAsset(conn_, *asset);
    if (path == "/playground/config") {  // what the page needs to know before any API call
      return HttpReply(conn_, MHD_HTTP_OK,
                       json({{"auth_required", svc_->auth().enabled()}}).dump());
    }
    if (path == "/v1/models") {
      if (!svc_->auth().AllowsHeader(Header(MHD_HTTP_HEADER_AUTHORIZATION))) {
        return ReplyError(conn_, FromGrpc(grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                                       "missing or invalid bearer token")));
      }
      Engine* engine = svc_->engine();
      if (engine == nullptr) {
        return ReplyError(
            conn_, FromGrpc(grpc::Status(grpc::StatusCode::UNAVAILABLE, "models are loading")));
      }
      return HttpReply(
          conn_, MHD_HTTP_OK,
          ModelsJson(engine->Models(), svc_->options().default_method, svc_->options().max_images)
              .dump());
    }
    if (path == "/v1/images/generations") {
      if (method != MHD_HTTP_METHOD_POST) return ReplyError(conn_, MethodNotAllowed("POST"));
      return Start();
    }
    HttpError e;
    e.status = MHD_HTTP_NOT_FOUND;
    e.type = "invalid_request_error";
    e.message =
        "no route " + path +
        " (POST /v1/images/generations, GET /v1/models, GET /health, GET / for the playground)";
    return ReplyError(conn_, e);
  }

  // The content reader of a stream: what is ready, or suspends until more is.
  ssize_t Read(char* buf, size_t max) {
    std::lock_guard<std::mutex> l(mu_);
    if (sse_off_ < sse_.size()) {
      const size_t k = std::min(max, sse_.size() - sse_off_);
      std::memcpy(buf, sse_.data() + sse_off_, k);
      sse_off_ += k;
      if (sse_off_ == sse_.size()) {
        sse_.clear();
        sse_off_ = 0;
      }
      return static_cast<ssize_t>(k);
    }
    if (gone_) return MHD_CONTENT_READER_END_WITH_ERROR;
    if (sse_done_) return MHD_CONTENT_READER_END_OF_STREAM;
    suspended_ = true;
    MHD_suspend_connection(conn_);
    return 0;
  }

  // The connection is done (answered, or closed by either side).
  void Completed(bool ok) {
    std::vector<int64_t> cancel;
    bool record = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      live_ = false;
      if (!ok || !finished_) {
        gone_ = true;
        cancel = RunningLocked();
      }
      if (started_ && !recorded_) {
        recorded_ = true;
        record = true;
      }
    }
    for (int64_t id : cancel) engine_->Cancel(id);
    if (record) {  // the client left before its answer
      svc_->metrics()->OnRequestEnd(model_, method_label_, "cancelled");
      svc_->metrics()->OnKeyRequestEnd(caller_.key_name(), "cancelled");
      Log("cancelled", "the client closed the connection", stream_ ? MHD_HTTP_OK : 0);
      std::lock_guard<std::mutex> l(mu_);
      caller_.lease.reset();  // recorded: its images no longer count against its key
    }
    if (started_) svc_->metrics()->OnCallClosed();
  }

  // --- the watchdog --------------------------------------------------------------------------
  // While suspended, the library does not watch the socket: a peer that closed it (a read of
  // zero bytes) is a client that left. Its images are cancelled and the connection resumed, so
  // that the library closes it.
  void CheckGone() {
    std::vector<int64_t> cancel;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!live_ || !suspended_ || gone_) return;
      const MHD_ConnectionInfo* ci =
          MHD_get_connection_info(conn_, MHD_CONNECTION_INFO_CONNECTION_FD);
      if (ci == nullptr) return;
      char b;
      const ssize_t r = ::recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r > 0 || (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) return;
      gone_ = true;
      cancel = RunningLocked();
      ResumeLocked();
    }
    for (int64_t id : cancel) engine_->Cancel(id);
  }
  // Server stop: the request ends now (its images cancelled).
  void Abort() {
    std::vector<int64_t> cancel;
    {
      std::lock_guard<std::mutex> l(mu_);
      gone_ = true;
      cancel = RunningLocked();
      ResumeLocked();
    }
    for (int64_t id : cancel) engine_->Cancel(id);
  }

  // --- engine events (the engine thread) -----------------------------------------------------
  void OnStep(int index, const StepEvent& e) {
    svc_->metrics()->OnRequestStep(model_, method_label_, e);
    if (stream_steps_) {  // copied here, turned into JSON on the encoder pool
      Run([this, index, step = e.step, positions = e.positions, tokens = e.tokens,
           totals = e.totals, total = e.total_tokens, window = e.window] {
        const json ev = {{"type", "imagegen.step"},
                         {"image_index", index},
                         {"step", step},
                         {"positions", positions},
                         {"tokens", tokens},
                         {"committed", totals.tokens},
                         {"total", total},
                         {"nfe", totals.nfe},
                         {"drafts_verified", totals.drafts_verified},
                         {"drafts_accepted", totals.drafts_accepted},
                         {"window", window}};
        Send("imagegen.step", ev, false);
      });
    }
    // The engine decodes a preview when the next partial image is due (GenerateParams::
    // previews: once (j + 1) / (partial_images + 1) of the tokens are decided).
    if (e.preview.pixels.empty()) return;
    int& next = partial_next_[static_cast<size_t>(index)];
    if (next >= partial_images_) return;
    const int partial = next++;
    Run([this, index, partial, img = e.preview] {
      StatusOr<std::string> png = EncodePng(img, scale_);
      if (!png.ok()) return;
      json ev = EventBase("image_generation.partial_image", index);
      ev["b64_json"] = absl::Base64Escape(*png);
      ev["partial_image_index"] = partial;
      Send("image_generation.partial_image", ev, false);
    });
  }
  void OnComplete(int index, RequestResult r) {
    {
      std::lock_guard<std::mutex> l(mu_);
      image_ended_[static_cast<size_t>(index)] = true;
    }
    Run([this, index, r = std::move(r)]() mutable {
      const double total_seconds = std::chrono::duration<double>(Clock::now() - t0_).count();
      v1::GenerateResponse resp;
      const grpc::Status st = FillResponse(r, scale_, false, total_seconds, &resp);
      if (!st.ok()) {
        Fail(st);
        return;
      }
      json item = {{"b64_json", absl::Base64Escape(resp.image_png())},
                   {"imagegen", StatsJson(resp.stats())}};
      output_tokens_ += static_cast<int64_t>(r.tokens.size());
      input_tokens_ = std::max<int64_t>(r.prompt_tokens, 1);
      // An image counts (metrics, the key's usage, the request log) when it goes out, as over
      // gRPC: not when the client has gone or another image failed the request.
      if (stream_) {
        if (Ended()) return;
        CountImage(r, total_seconds);
        json ev = EventBase("image_generation.completed", index);
        ev["b64_json"] = item["b64_json"];
        ev["usage"] = Usage();
        ev["imagegen"] = item["imagegen"];
        const bool last = ++done_ == n_;
        if (last) Record("ok", "", MHD_HTTP_OK);  // before the end is sent: it may close at once
        Send("image_generation.completed", ev, last);
        return;
      }
      items_[static_cast<size_t>(index)] = std::move(item);
      finished_images_.emplace_back(std::move(r), total_seconds);
      if (++done_ < n_ || Ended()) return;
      for (const auto& [result, seconds] : finished_images_) CountImage(result, seconds);
      finished_images_.clear();
      json body = {{"created", UnixNow()},   {"data", items_},    {"background", "opaque"},
                   {"output_format", "png"}, {"quality", "auto"}, {"size", size_},
                   {"usage", Usage()}};
      Record("ok", "", MHD_HTTP_OK);
      Answer(MHD_HTTP_OK, body.dump(-1, ' ', false, json::error_handler_t::replace), -1);
    });
  }
  void OnError(int index, const Status& s) {
    std::vector<int64_t> others;
    {
      std::lock_guard<std::mutex> l(mu_);
      image_ended_[static_cast<size_t>(index)] = true;
      if (failed_) return;
      failed_ = true;
      others = RunningLocked();
    }
    for (int64_t id : others) engine_->Cancel(id);
    Run([this, s] { Fail(ToGrpc(s, req_, svc_->metrics()->RecentGenerationSeconds())); });
  }

 private:
  enum class State { kNew, kWaiting, kStreaming, kDone };

  std::string Header(const char* name) const {
    const char* v = MHD_lookup_connection_value(conn_, MHD_HEADER_KIND, name);
    return v == nullptr ? "" : v;
  }
  // Every value of a header that may repeat (X-Forwarded-For), in order, joined by commas.
  std::string AllHeaders(const char* name) const {
    struct Want {
      const char* name;
      std::string values;
    } want{name, ""};
    MHD_get_connection_values(
        conn_, MHD_HEADER_KIND,
        [](void* cls, MHD_ValueKind, const char* key, const char* value) -> MHD_Result {
          auto* w = static_cast<Want*>(cls);
          if (key != nullptr && value != nullptr && strcasecmp(key, w->name) == 0) {
            if (!w->values.empty()) w->values += ",";
            w->values += value;
          }
          return MHD_YES;
        },
        &want);
    return want.values;
  }
  static HttpError MethodNotAllowed(const std::string& allowed) {
    HttpError e;
    e.status = MHD_HTTP_METHOD_NOT_ALLOWED;
    e.type = "invalid_request_error";
    e.message = "this route takes " + allowed;
    return e;
  }

  MHD_Result Start();

  // Under mu_: the submitted images that have not ended.
  std::vector<int64_t> RunningLocked() const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < ids_.size(); ++i) {
      if (!image_ended_[i]) out.push_back(ids_[i]);
    }
    return out;
  }
  void ResumeLocked() {
    if (!live_ || !suspended_) return;
    suspended_ = false;
    MHD_resume_connection(conn_);
  }

  // Work for this request on the encoder pool, one task at a time, in order.
  void Run(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> l(strand_mu_);
      tasks_.push_back(std::move(task));
      if (running_) return;
      running_ = true;
    }
    svc_->PostEncode([self = shared_from_this()] { self->Drain(); });
  }
  void Drain() {
    while (true) {
      std::function<void()> task;
      {
        std::lock_guard<std::mutex> l(strand_mu_);
        if (tasks_.empty()) {
          running_ = false;
          return;
        }
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  json EventBase(const char* type, int index) const {
    return {{"type", type},        {"created_at", UnixNow()}, {"size", size_},
            {"quality", "auto"},   {"background", "opaque"},  {"output_format", "png"},
            {"image_index", index}};
  }
  json Usage() const {
    return {{"input_tokens", input_tokens_},
            {"input_tokens_details", {{"text_tokens", input_tokens_}, {"image_tokens", 0}}},
            {"output_tokens", output_tokens_},
            {"total_tokens", input_tokens_ + output_tokens_}};
  }
  // Whether the request is over for its images: the client left, an image failed it, or its
  // answer is decided.
  bool Ended() {
    std::lock_guard<std::mutex> l(mu_);
    return gone_ || failed_ || finished_;
  }
  void CountImage(const RequestResult& r, double total_seconds) {
    svc_->metrics()->OnImage(model_, method_label_, r, total_seconds);
    svc_->metrics()->OnKeyImage(caller_.key_name(), r);
    std::lock_guard<std::mutex> l(mu_);
    record_.AddImage(r);
  }
  // A server-sent event for a stream; `last` ends it.
  void Send(const char* event, const json& data, bool last) {
    std::lock_guard<std::mutex> l(mu_);
    if (finished_) return;
    sse_ += std::string("event: ") + event +
            "\ndata: " + data.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
    if (last) {
      sse_done_ = true;
      finished_ = true;
    }
    ResumeLocked();
  }
  // The answer of a unary request.
  void Answer(unsigned status, std::string body, double retry_after) {
    std::lock_guard<std::mutex> l(mu_);
    if (finished_) return;
    finished_ = true;
    reply_.emplace(status, std::move(body));
    retry_after_ = retry_after;
    ResumeLocked();
  }
  void Fail(const grpc::Status& st) {
    const HttpError e = FromGrpc(st);
    Record(OutcomeLabel(st.error_code()), st.error_message(), stream_ ? MHD_HTTP_OK : e.status);
    if (stream_) {
      Send("error", ErrorJson(e), true);
    } else {
      Answer(e.status, ErrorJson(e).dump(-1, ' ', false, json::error_handler_t::replace),
             e.retry_after);
    }
  }
  // Once: the request's outcome in the metrics and the request log (`http_status`: the status
  // line sent, 0 when none was).
  void Record(const std::string& outcome, const std::string& error, unsigned http_status) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (recorded_) return;
      recorded_ = true;
    }
    svc_->metrics()->OnRequestEnd(model_, method_label_, outcome);
    svc_->metrics()->OnKeyRequestEnd(caller_.key_name(), outcome);
    Log(outcome, error, http_status);
    std::lock_guard<std::mutex> l(mu_);
    caller_.lease.reset();  // the call's images no longer count against its key
  }
  void Log(const std::string& outcome, const std::string& error, unsigned http_status) {
    RequestLog* log = svc_->request_log();
    if (log == nullptr) return;
    CallRecord r;
    {
      std::lock_guard<std::mutex> l(mu_);
      r = record_;
    }
    r.request_id = request_id_;
    r.trace = trace_;
    r.api = stream_ ? "http-stream" : "http";
    r.peer = peer_;
    r.model = svc_->ModelName(model_);
    r.method = method_label_;
    r.images = std::max(req_.n(), 1);
    r.user = req_.user().substr(0, 256);
    r.priority = priority_;
    r.key = caller_.key_name();
    r.address = caller_.logged_address();
    r.outcome = outcome;
    r.error = error;
    r.http_status = static_cast<int>(http_status);
    r.seconds = std::chrono::duration<double>(Clock::now() - t0_).count();
    log->Call(r);
  }
  // The x-request-id header of every answer to a generation request.
  HttpHeaders IdHeader() const {
    if (request_id_.empty()) return {};
    return {{"x-request-id", request_id_}};
  }

  const std::shared_ptr<HttpApi::Shared> shared_;
  ImageGenerationService* const svc_;
  MHD_Connection* const conn_;
  const Clock::time_point t0_;
  std::string body_;
  bool too_large_ = false;

  // Set by Start (the event loop) before the images are submitted; read-only after.
  v1::GenerateRequest req_;
  std::string model_, method_label_ = "unknown", size_;
  bool stream_ = false, stream_steps_ = false;
  int partial_images_ = 0, scale_ = 1, n_ = 1;
  bool started_ = false;  // a generation request (counted as a call)
  std::string request_id_, peer_;
  std::optional<TraceParent> trace_;  // the caller's traceparent, for the log line
  Caller caller_;
  int32_t priority_ = 0;
  Engine* engine_ = nullptr;
  std::vector<int> partial_next_;  // the engine thread's

  std::mutex mu_;
  State state_ = State::kNew;
  bool live_ = true;        // the library still has the connection
  bool suspended_ = false;  // and it is suspended
  bool gone_ = false;       // the client left (or the server stops)
  bool finished_ = false;   // the answer (or the stream's end) is decided
  bool failed_ = false;     // an image failed: the request's outcome
  bool recorded_ = false;   // counted in imagegen_requests_total
  std::vector<int64_t> ids_;
  std::vector<bool> image_ended_;
  CallRecord record_;  // the images done so far, for the request log
  std::optional<std::pair<unsigned, std::string>> reply_;
  double retry_after_ = -1;
  std::string sse_;
  size_t sse_off_ = 0;
  bool sse_done_ = false;

  // The encoder pool's (one task at a time).
  std::vector<json> items_;
  // A unary request's finished images and their times, counted when the answer goes out (as
  // gRPC keeps its results until they are sent).
  std::vector<std::pair<RequestResult, double>> finished_images_;
  int done_ = 0;
  int64_t input_tokens_ = 0, output_tokens_ = 0;

  std::mutex strand_mu_;
  std::deque<std::function<void()>> tasks_;
  bool running_ = false;
};

namespace {

ssize_t ReadStream(void* cls, uint64_t /*pos*/, char* buf, size_t max) {
  return static_cast<HttpCall*>(cls)->Read(buf, max);
}

}  // namespace

MHD_Result HttpCall::Start() {
  started_ = true;
  {
    std::lock_guard<std::mutex> l(shared_->mu);
    shared_->generating.insert(this);
  }
  svc_->metrics()->OnCallOpened(false);
  Engine* engine = svc_->engine();
  ImagesRequest ir;
  grpc::Status parsed = grpc::Status::OK;
  if (too_large_) {
    parsed = BadField("request",
                      "the body is over " + std::to_string(HttpApi::kMaxBodyBytes) + " bytes");
  } else if (engine != nullptr) {
    std::string param, message;
    if (!ParseImagesRequest(body_, engine->Models(), HttpApi::kMaxPartialImages,
                            svc_->options().max_images, &ir, &param, &message)) {
      parsed = BadField(param.empty() ? "request" : param, message);
    }
  }
  parsed = ImageGenerationService::CheckRequestId(Header("X-Request-Id"), parsed, &request_id_);
  trace_ = ParseTraceparent(Header("traceparent"));
  peer_ = HttpPeer(conn_);
  req_ = ir.req;
  model_ = req_.model();
  stream_ = ir.stream;
  stream_steps_ = ir.stream_steps;
  partial_images_ = ir.partial_images;
  size_ = ir.size;
  scale_ = OutputScale(req_);
  std::vector<GenerateParams> images;
  caller_ =
      svc_->Identify(Header(MHD_HTTP_HEADER_AUTHORIZATION), peer_, AllHeaders("X-Forwarded-For"));
  priority_ = req_.priority();
  grpc::Status st =
      svc_->Resolve(req_, caller_, parsed, std::chrono::system_clock::time_point::max(), &engine_,
                    &images, &method_label_);
  if (!images.empty()) priority_ = images[0].priority;
  if (st.ok()) {
    n_ = static_cast<int>(images.size());
    for (GenerateParams& p : images) p.previews = stream_ ? partial_images_ : 0;
    items_.assign(static_cast<size_t>(n_), json());
    partial_next_.assign(static_cast<size_t>(n_), 0);
    {
      std::lock_guard<std::mutex> l(mu_);
      image_ended_.assign(static_cast<size_t>(n_), false);
    }
    std::vector<std::shared_ptr<RequestObserver>> observers;
    for (int i = 0; i < n_; ++i) {
      observers.push_back(std::make_shared<ImageObserver<HttpCall>>(shared_from_this(), i));
    }
    StatusOr<std::vector<int64_t>> ids = engine_->SubmitGroup(std::move(images), observers);
    if (ids.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      ids_ = std::move(*ids);
      if (failed_) {  // an image failed before its ids were known
        for (int64_t id : RunningLocked()) engine_->Cancel(id);
      }
    } else {
      st = ToGrpc(ids.status(), req_, svc_->metrics()->RecentGenerationSeconds());
    }
  }
  if (!st.ok()) {
    const HttpError e = FromGrpc(st);
    Record(OutcomeLabel(st.error_code()), st.error_message(), e.status);
    {
      std::lock_guard<std::mutex> l(mu_);
      finished_ = true;
    }
    return ReplyError(conn_, e, IdHeader());
  }
  if (stream_) {
    MHD_Response* r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, &ReadStream, this, nullptr);
    if (r == nullptr) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no");
    MHD_add_response_header(r, "x-request-id", request_id_.c_str());
    {
      std::lock_guard<std::mutex> l(mu_);
      state_ = State::kStreaming;
    }
    const MHD_Result ok = MHD_queue_response(conn_, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ok;
  }
  std::lock_guard<std::mutex> l(mu_);
  if (reply_) {  // answered already (a fast image, or an early error)
    state_ = State::kDone;
    return HttpReply(conn_, reply_->first, reply_->second, "application/json", retry_after_,
                     IdHeader());
  }
  state_ = State::kWaiting;
  suspended_ = true;
  MHD_suspend_connection(conn_);
  return MHD_YES;
}

// ---------------------------------------------------------------------------------------------
// The server

namespace {

MHD_Result Handle(void* cls, MHD_Connection* c, const char* url, const char* method,
                  const char* /*version*/, const char* upload, size_t* upload_size,
                  void** con_cls) {
  auto* shared = static_cast<HttpApi::Shared*>(cls);
  if (*con_cls == nullptr) {
    auto call = std::make_shared<HttpCall>(shared->shared_from_this(), c);
    {
      std::lock_guard<std::mutex> l(shared->mu);
      shared->open.emplace(call.get(), call);
    }
    *con_cls = new std::shared_ptr<HttpCall>(call);
    // A body announced over the limit is refused before any of it is read.
    const char* length = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
    if (length != nullptr) {
      errno = 0;
      char* end = nullptr;
      const unsigned long long n = std::strtoull(length, &end, 10);
      if (errno == ERANGE || (end != length && n > HttpApi::kMaxBodyBytes)) {
        call->MarkTooLarge();
        return call->Handle(url, method);
      }
    }
    return MHD_YES;
  }
  HttpCall& call = **static_cast<std::shared_ptr<HttpCall>*>(*con_cls);
  if (*upload_size > 0) {
    const bool answered = call.too_large();
    if (!answered) call.Append(upload, *upload_size);
    *upload_size = 0;
    // Over the limit while it came (chunked): libmicrohttpd cannot answer in the middle of a
    // body, so the connection is closed now rather than read to the end.
    if (!answered && call.too_large()) return MHD_NO;
    return MHD_YES;
  }
  return call.Handle(url, method);
}

void Completed(void* cls, MHD_Connection* /*c*/, void** con_cls, MHD_RequestTerminationCode toe) {
  auto* shared = static_cast<HttpApi::Shared*>(cls);
  auto* holder = static_cast<std::shared_ptr<HttpCall>*>(*con_cls);
  if (holder == nullptr) return;
  (*holder)->Completed(toe == MHD_REQUEST_TERMINATED_COMPLETED_OK);
  {
    std::lock_guard<std::mutex> l(shared->mu);
    shared->open.erase(holder->get());
    shared->generating.erase(holder->get());
  }
  shared->cv.notify_all();
  delete holder;
  *con_cls = nullptr;
}

// The HTTPS servers of the process. GnuTLS's certificate callback carries no pointer of ours:
// with one server (the daemon's) it is that one; with several (tests), libmicrohttpd's session
// pointer, its connection, names the server.
std::mutex https_mu;
std::vector<HttpApi::Shared*>& HttpsServers() {
  static auto* servers = new std::vector<HttpApi::Shared*>();
  return *servers;
}

int RetrieveCertificate(gnutls_session_t session, const gnutls_datum_t*, int,
                        const gnutls_pk_algorithm_t*, int, gnutls_pcert_st** chain,
                        unsigned int* chain_length, gnutls_privkey_t* key) {
  std::lock_guard<std::mutex> registry(https_mu);
  HttpApi::Shared* shared = nullptr;
  const auto& servers = HttpsServers();
  if (servers.size() == 1) {
    shared = servers.front();
  } else if (auto* c = static_cast<MHD_Connection*>(gnutls_session_get_ptr(session))) {
    const MHD_ConnectionInfo* info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_DAEMON);
    for (HttpApi::Shared* s : servers) {
      if (info != nullptr && s->daemon == info->daemon) shared = s;
    }
  }
  if (shared == nullptr) return -1;  // the handshake fails
  std::lock_guard<std::mutex> l(shared->cert_mu);
  const ServerCertificate& current = *shared->served.rbegin()->second;
  *chain = current.chain();
  *chain_length = current.chain_length();
  *key = current.key();
  return 0;
}

// HTTPS: each connection notes the certificate generation current when it was accepted
// (before its handshake), so that no certificate it may use is freed while it is open.
void ConnectionNotified(void* cls, MHD_Connection* /*c*/, void** socket_context,
                        MHD_ConnectionNotificationCode toe) {
  auto* shared = static_cast<HttpApi::Shared*>(cls);
  std::lock_guard<std::mutex> l(shared->cert_mu);
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    if (shared->served.empty()) return;
    const int64_t generation = shared->served.rbegin()->first;
    shared->accepted_at.insert(generation);
    *socket_context = reinterpret_cast<void*>(static_cast<intptr_t>(generation));
  } else if (*socket_context != nullptr) {  // closed (also when accepted but never started)
    const auto generation = static_cast<int64_t>(reinterpret_cast<intptr_t>(*socket_context));
    *socket_context = nullptr;
    auto it = shared->accepted_at.find(generation);
    if (it != shared->accepted_at.end()) shared->accepted_at.erase(it);
    shared->FreeUnusedCertificates();
  }
}

}  // namespace

void HttpApi::SetCertificate(std::shared_ptr<const ServerCertificate> certificate) {
  if (certificate == nullptr) return;
  std::lock_guard<std::mutex> l(shared_->cert_mu);
  if (shared_->served.empty()) return;  // plain HTTP
  const int64_t generation = shared_->served.rbegin()->first + 1;
  shared_->served.emplace(generation, std::move(certificate));
  shared_->FreeUnusedCertificates();
}

int64_t HttpApi::certificates_held() const {
  std::lock_guard<std::mutex> l(shared_->cert_mu);
  return static_cast<int64_t>(shared_->served.size());
}

StatusOr<std::unique_ptr<HttpApi>> HttpApi::Start(
    const std::string& address, ImageGenerationService* service,
    std::shared_ptr<const ServerCertificate> certificate) {
  std::unique_ptr<HttpApi> s(new HttpApi());
  s->shared_ = std::make_shared<Shared>();
  s->shared_->service = service;
  const bool tls = certificate != nullptr;
  unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME;
  std::vector<MHD_OptionItem> tls_options;
  if (tls) {
    if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES ||
        MHD_is_feature_supported(MHD_FEATURE_HTTPS_CERT_CALLBACK) != MHD_YES) {
      return FailedPrecondition(
          "this libmicrohttpd has no TLS or no certificate callback; HTTPS is not available");
    }
    flags |= MHD_USE_TLS;
    s->shared_->served.emplace(1, std::move(certificate));
    // Every handshake asks RetrieveCertificate, which hands out the current certificate
    // (SetCertificate replaces it when the files change); ConnectionNotified keeps those that
    // open connections may use.
    tls_options.push_back(
        {MHD_OPTION_HTTPS_CERT_CALLBACK, 0, reinterpret_cast<void*>(&RetrieveCertificate)});
    tls_options.push_back({MHD_OPTION_NOTIFY_CONNECTION,
                           reinterpret_cast<intptr_t>(&ConnectionNotified), s->shared_.get()});
    std::lock_guard<std::mutex> registry(https_mu);
    HttpsServers().push_back(s->shared_.get());
  }
  // Out of the registry again if the start fails below (the destructor's Stop does it later).
  auto unregister = [shared = s->shared_.get()] {
    std::lock_guard<std::mutex> registry(https_mu);
    auto& servers = HttpsServers();
    servers.erase(std::remove(servers.begin(), servers.end(), shared), servers.end());
  };
  tls_options.push_back({MHD_OPTION_END, 0, nullptr});
  StatusOr<int> listening = ListenTcp(address, &s->port_);
  if (!listening.ok()) {
    unregister();
    return listening.status();
  }
  const int fd = *listening;
  s->daemon_ = MHD_start_daemon(
      flags, 0, nullptr, nullptr, &Handle, s->shared_.get(), MHD_OPTION_LISTEN_SOCKET,
      static_cast<MHD_socket>(fd), MHD_OPTION_CONNECTION_TIMEOUT, kIdleTimeoutSeconds,
      MHD_OPTION_CONNECTION_LIMIT, kMaxConnections, MHD_OPTION_NOTIFY_COMPLETED, &Completed,
      s->shared_.get(), MHD_OPTION_ARRAY, tls_options.data(), MHD_OPTION_END);
  if (s->daemon_ == nullptr) {
    ::close(fd);
    unregister();
    return tls ? InvalidArgument("cannot start HTTPS on " + address +
                                 ": --tls-cert or --tls-key is not a valid PEM "
                                 "certificate chain and its key")
               : Unavailable("cannot start the HTTP server on " + address);
  }
  {
    std::lock_guard<std::mutex> registry(https_mu);
    s->shared_->daemon = s->daemon_;
  }
  Shared* shared = s->shared_.get();
  shared->watchdog = std::thread([shared] {
    std::unique_lock<std::mutex> l(shared->mu);
    while (!shared->stop) {
      shared->cv.wait_for(l, std::chrono::milliseconds(100));
      std::vector<std::shared_ptr<HttpCall>> calls;
      for (const auto& [p, w] : shared->open) {
        if (auto c = w.lock()) calls.push_back(std::move(c));
      }
      l.unlock();
      for (const auto& c : calls) c->CheckGone();
      calls.clear();
      l.lock();
    }
  });
  return s;
}

int64_t HttpApi::open_requests() const {
  std::lock_guard<std::mutex> l(shared_->mu);
  return static_cast<int64_t>(shared_->open.size());
}

void HttpApi::Stop(std::chrono::system_clock::time_point deadline) {
  if (daemon_ == nullptr) return;
  std::vector<std::shared_ptr<HttpCall>> calls;
  {
    std::unique_lock<std::mutex> l(shared_->mu);
    shared_->cv.wait_until(l, deadline, [&] { return shared_->generating.empty(); });
    shared_->stop = true;
    for (const auto& [p, w] : shared_->open) {
      if (auto c = w.lock()) calls.push_back(std::move(c));
    }
  }
  shared_->cv.notify_all();
  shared_->watchdog.join();
  // The library may not stop with suspended connections: each is resumed and ends.
  for (const auto& c : calls) c->Abort();
  calls.clear();
  MHD_stop_daemon(daemon_);
  daemon_ = nullptr;
  std::lock_guard<std::mutex> registry(https_mu);
  auto& servers = HttpsServers();
  servers.erase(std::remove(servers.begin(), servers.end(), shared_.get()), servers.end());
}

HttpApi::~HttpApi() { Stop(std::chrono::system_clock::now()); }

}  // namespace imagegen::server
