// The ImageGeneration gRPC service, on gRPC's callback API: a call holds no thread while its
// image is generated. Generate and GenerateStream take the request as raw bytes and parse it
// here, so that a body that is not a GenerateRequest (or is too large) is INVALID_ARGUMENT with
// a message, and counted, like every other bad request.
//
// A call is validated and submitted to the engine; the engine thread hands its events to the
// call, and the call's work (PNG encoding, building and serialising messages, finishing) runs
// on the service's small encoder pool, never on the engine thread. Each call has at most one
// task queued or running and at most one message being written: a stream whose client reads
// slowly gets its step updates coalesced (positions and tokens merged, the newest preview
// kept, superseded ones dropped), so what it holds is bounded by one image, and a stream whose
// client reads nothing for `stall_limit` is ended (ABORTED; its engine request cancelled).
// Cancellation and deadlines reach the call through gRPC (OnCancel) and cancel the engine
// request, which frees its KV slots at the next engine step. Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/scheduler/engine.h"
#include "imagegen/v1/imagegen.grpc.pb.h"
#include "server/auth.h"
#include "server/forwarded.h"
#include "server/metrics.h"
#include "server/request_log.h"
#include "server/tokenizer.h"

namespace imagegen::server {

struct ServiceOptions {
  std::string default_method = "scd-mc";  // of requests that name none
  int encoder_threads = 2;                // PNG encoding and message building
  // A stream whose client has not taken a message for this long is ended.
  std::chrono::milliseconds stall_limit{30000};
  size_t max_request_bytes = 64 << 10;  // larger bodies are INVALID_ARGUMENT
  int max_images = 16;                  // GenerateRequest.n at most
  RequestLog* request_log = nullptr;    // a line per call when set (outlives the service)
  TrustedProxies trusted_proxies;       // whose X-Forwarded-For names the caller (forwarded.h)
};

// Who a call is from: the API key its bearer token matched (null: refused; auth.h), and its
// address (forwarded.h).
struct Caller {
  std::shared_ptr<const ApiKey> key;
  std::string address;     // "ipv4:10.1.2.3", "ipv6:[::1]" (no port)
  bool forwarded = false;  // the address is X-Forwarded-For's, not the peer's
  // Set by Resolve for a key with max_in_flight: holds the call's images against the key's
  // limit until reset (when the call's outcome is recorded) or destroyed.
  std::shared_ptr<const void> lease;

  // The API key's name (empty: unnamed, refused, or no auth).
  std::string key_name() const { return key ? key->name : ""; }
  // The address for the request log: X-Forwarded-For's, else empty (the peer is logged).
  std::string logged_address() const { return forwarded ? address : ""; }
};

// Images in flight per API key name (ApiKey::max_in_flight), shared with the leases.
struct KeyCounts {
  std::mutex mu;
  std::map<std::string, int64_t> in_flight;  // under mu
};

// A FIFO of tasks run by a fixed set of threads. The destructor runs what is queued, then joins.
class WorkQueue {
 public:
  explicit WorkQueue(int threads);
  ~WorkQueue();
  void Post(std::function<void()> task);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

class Call;

// Hands one image's engine events to the call (gRPC or HTTP) that asked for it: a call of n
// images has n of these, each with its index.
template <class C>
class ImageObserver final : public RequestObserver {
 public:
  ImageObserver(std::shared_ptr<C> call, int index) : call_(std::move(call)), index_(index) {}
  void OnStep(const StepEvent& e) override { call_->OnStep(index_, e); }
  void OnComplete(RequestResult r) override { call_->OnComplete(index_, std::move(r)); }
  void OnError(const Status& s) override { call_->OnError(index_, s); }

 private:
  std::shared_ptr<C> call_;
  const int index_;
};

using ServiceBase = v1::ImageGeneration::WithRawCallbackMethod_Generate<
    v1::ImageGeneration::WithRawCallbackMethod_GenerateStream<
        v1::ImageGeneration::WithCallbackMethod_ListModels<v1::ImageGeneration::Service>>>;

// The daemon's health watch's verdict on the engine (DaemonOptions::engine_stall_seconds,
// engine_failed_steps).
struct EngineHealth {
  std::string reason;  // "stalled", "failing"; empty: healthy
  std::string model;   // failing: the model whose steps fail
  std::string what;    // what is wrong, as the log says it
  // New generation calls are refused with UNAVAILABLE and a RetryInfo of `retry_seconds`
  // rather than queued on an engine that cannot serve them: every call while stalled, the
  // failing model's calls while failing (the daemon's own probe steps find out when it works
  // again). Calls in flight go on.
  bool refuse = false;
  double retry_seconds = 1;
};

class ImageGenerationService final : public ServiceBase {
 public:
  // `metrics` must outlive the service.
  ImageGenerationService(Metrics* metrics, TokenAuth auth, ServiceOptions options);
  // After the gRPC server has shut down (every call is done): stops the pool and the watchdog.
  ~ImageGenerationService() override;

  // Calls before SetEngine are UNAVAILABLE ("models are loading"); the engine must outlive
  // every call. Loads the tokenizer.json of every text-to-image model first (an error names
  // the file; the engine is then not taken).
  Status SetEngine(Engine* engine);
  // From now on new calls are UNAVAILABLE; calls in flight go on.
  void SetDraining();
  bool draining() const { return draining_.load(); }
  // The daemon's health watch (DaemonOptions::engine_stall_seconds, engine_failed_steps): why
  // the engine is unhealthy, which HTTP health says, and whether new calls are refused.
  void SetUnhealthy(EngineHealth health) {
    std::lock_guard<std::mutex> l(unhealthy_mu_);
    unhealthy_ = std::move(health);
  }
  std::string unhealthy() const {  // the reason; empty: healthy
    std::lock_guard<std::mutex> l(unhealthy_mu_);
    return unhealthy_.reason;
  }

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerateStream(
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;

  // Generate and GenerateStream calls not yet done (the accounting check of the tests).
  int64_t open_calls() const;

  // Everything between a parsed request and the engine, for every front (gRPC here, the HTTP
  // API): who may call, whether models are loaded and the server takes calls, then the
  // request (`parsed`: the front's own parsing outcome), its defaults (`method`: the metric
  // label), the prompts tokenized, the deadline, and the request's n engine requests (image
  // i's seed is seed + i). Errors are what the call must end with; fields are named.
  // `request_id` is what the client sent as x-request-id (empty: none); *request_id_out is the
  // call's id (the client's, or a new one), and an invalid one is INVALID_ARGUMENT naming
  // `x-request-id` when `parsed` was OK.
  static grpc::Status CheckRequestId(const std::string& request_id, const grpc::Status& parsed,
                                     std::string* request_id_out);
  // The caller's API key is its tenant (GenerateParams::tenant) and sets its priority's
  // default and floor (a request asking for a more urgent one is PERMISSION_DENIED naming
  // `priority`) and its images in flight (max_in_flight: beyond it RESOURCE_EXHAUSTED with
  // RetryInfo; `n` above it INVALID_ARGUMENT; caller.lease holds the call's images); its
  // address stands for the user when the request names none (GenerateParams::client).
  grpc::Status Resolve(const v1::GenerateRequest& req, Caller& caller, const grpc::Status& parsed,
                       std::chrono::system_clock::time_point deadline, Engine** engine,
                       std::vector<GenerateParams>* images, std::string* method) const;
  // The caller of a call from `peer` ("ipv4:10.1.2.3:5678") with this Authorization value and
  // X-Forwarded-For values (joined by commas).
  Caller Identify(std::string_view authorization, const std::string& peer,
                  std::string_view forwarded_for) const;
  Metrics* metrics() const { return metrics_; }
  RequestLog* request_log() const { return options_.request_log; }
  // The model a request names, or the one it gets by naming none (the engine's first; empty
  // while the models load).
  std::string ModelName(const std::string& requested) const;
  const TokenAuth& auth() const { return auth_; }
  const ServiceOptions& options() const { return options_; }
  // The engine once SetEngine has run (null before).
  Engine* engine() const { return engine_.load(); }
  // Runs `task` on the service's encoder pool (PNG encoding, message building).
  void PostEncode(std::function<void()> task) { encoders_.Post(std::move(task)); }

 private:
  friend class Call;
  // Counts the call, parses, checks and submits it; a status other than OK is what the call
  // must end with at once.
  grpc::Status Begin(const std::shared_ptr<Call>& call, grpc::CallbackServerContext* ctx,
                     const grpc::ByteBuffer& request);
  void Watch();  // the stall watchdog's loop
  // UNAVAILABLE with RetryInfo when the health watch refuses calls of `model` (EngineHealth).
  grpc::Status RefuseIfUnhealthy(const std::string& model) const;
  // `text` put into the model's template and tokenized into `ids`; errors name `field`
  // ("prompt" or "negative_prompt").
  grpc::Status EncodePrompt(const Engine& engine, const std::string& model,
                            const std::string& field, const std::string& text,
                            std::vector<int64_t>* ids) const;
  void Forget(const Call* call);

  Metrics* metrics_;
  const std::shared_ptr<KeyCounts> key_counts_ = std::make_shared<KeyCounts>();
  const TokenAuth auth_;
  const ServiceOptions options_;
  std::atomic<Engine*> engine_{nullptr};
  // By model name, for text-to-image models with a tokenizer; written before engine_ is set,
  // read-only after.
  std::map<std::string, std::unique_ptr<Tokenizer>> tokenizers_;
  std::atomic<bool> draining_{false};
  mutable std::mutex unhealthy_mu_;
  EngineHealth unhealthy_;
  WorkQueue encoders_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<std::weak_ptr<Call>> streams_;  // streaming calls in flight (the watchdog's list)
  int64_t open_calls_ = 0;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace imagegen::server
