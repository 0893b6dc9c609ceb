#include "server/service.h"

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

#include "server/convert.h"

namespace imagegen::server {
namespace {

// Receives one request's engine events (on the engine thread) and hands them to the handler.
class Call : public RequestObserver {
 public:
  Call(Metrics* metrics, std::string model, std::string method, bool keep_steps)
      : metrics_(metrics),
        model_(std::move(model)),
        method_(std::move(method)),
        keep_steps_(keep_steps) {}

  void OnStep(const StepEvent& e) override {
    metrics_->OnRequestStep(model_, method_, e);
    if (!keep_steps_) return;
    std::lock_guard<std::mutex> l(mu_);
    steps_.push_back(e);
    cv_.notify_one();
  }
  void OnComplete(RequestResult r) override {
    std::lock_guard<std::mutex> l(mu_);
    result = std::move(r);
    done_ = true;
    cv_.notify_one();
  }
  void OnError(const Status& s) override {
    std::lock_guard<std::mutex> l(mu_);
    error = s;
    done_ = true;
    cv_.notify_one();
  }
  // Waits up to `wait` for step events or the end; moves the pending steps into `out`.
  // Returns whether the request has ended (then `result` or `error` is set).
  bool Next(std::chrono::milliseconds wait, std::deque<StepEvent>* out) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, wait, [&] { return done_ || !steps_.empty(); });
    out->swap(steps_);
    steps_.clear();
    return done_;
  }

  std::optional<RequestResult> result;
  std::optional<Status> error;

 private:
  Metrics* metrics_;
  const std::string model_, method_;
  const bool keep_steps_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StepEvent> steps_;
  bool done_ = false;
};

// The call's outcome label: its status code's name in lower case. The label values are fixed
// (dashboards and alerts select on them), so codes a call is not expected to end with count
// as internal.
std::string Outcome(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::UNAUTHENTICATED:
      break;
    default:
      c = grpc::StatusCode::INTERNAL;
  }
  std::string label = StatusCodeName(static_cast<int>(c));
  std::transform(label.begin(), label.end(), label.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return label;
}

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

ImageGenerationService::ImageGenerationService(Metrics* metrics, TokenAuth auth,
                                               std::string default_method)
    : metrics_(metrics), auth_(std::move(auth)), default_method_(std::move(default_method)) {}

void ImageGenerationService::SetEngine(Engine* engine) { engine_.store(engine); }

void ImageGenerationService::SetDraining() { draining_.store(true); }

grpc::Status ImageGenerationService::Generate(grpc::ServerContext* ctx,
                                              const v1::GenerateRequest* req,
                                              v1::GenerateResponse* resp) {
  return Run(ctx, *req, nullptr, resp);
}

grpc::Status ImageGenerationService::GenerateStream(
    grpc::ServerContext* ctx, const v1::GenerateRequest* req,
    grpc::ServerWriter<v1::GenerateStreamResponse>* writer) {
  return Run(ctx, *req, writer, nullptr);
}

grpc::Status ImageGenerationService::ListModels(grpc::ServerContext* ctx,
                                                const v1::ListModelsRequest*,
                                                v1::ListModelsResponse* resp) {
  if (!auth_.Allows(*ctx)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token");
  }
  Engine* engine = engine_.load();
  if (engine == nullptr) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "models are loading");
  FillModels(engine->Models(), default_method_, resp);
  return grpc::Status::OK;
}

grpc::Status ImageGenerationService::Run(grpc::ServerContext* ctx, const v1::GenerateRequest& req,
                                         grpc::ServerWriter<v1::GenerateStreamResponse>* writer,
                                         v1::GenerateResponse* unary) {
  const auto t0 = Clock::now();
  const std::string method = MethodLabel(req, default_method_);
  auto finish = [&](grpc::Status st, const RequestResult* r = nullptr) {
    metrics_->OnRequestEnd(req.model(), method, Outcome(st.error_code()), r, Since(t0));
    return st;
  };
  if (!auth_.Allows(*ctx)) {
    return finish(
        grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token"));
  }
  Engine* engine = engine_.load();
  if (engine == nullptr) {
    return finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "models are loading"));
  }
  if (draining_.load()) {
    return finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"));
  }
  GenerateParams params;
  if (grpc::Status st = ToParams(req, default_method_, &params); !st.ok()) return finish(st);
  // The client's deadline, as a duration from now on the engine's monotonic clock.
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    params.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         deadline - std::chrono::system_clock::now());
  }
  const bool stream = writer != nullptr;
  auto call = std::make_shared<Call>(metrics_, req.model(), method, stream);
  StatusOr<int64_t> id = engine->Submit(std::move(params), call);
  if (!id.ok()) return finish(ToGrpc(id.status(), req, metrics_->RecentGenerationSeconds()));

  bool gone = false;  // the client cancelled, its deadline passed, or a write failed
  while (true) {
    std::deque<StepEvent> steps;
    const bool done = call->Next(std::chrono::milliseconds(50), &steps);
    for (const StepEvent& e : steps) {
      if (gone) break;
      v1::GenerateStreamResponse msg;
      FillStep(e, OutputScale(req), msg.mutable_step());
      if (!writer->Write(msg)) gone = true;
    }
    if (done) break;
    if (!gone && ctx->IsCancelled()) gone = true;
    if (gone) engine->Cancel(*id);  // ends at the next step boundary; keep waiting for it
  }
  if (gone) {  // whatever the engine did last, the client is no longer there to receive it
    const bool expired = std::chrono::system_clock::now() >= deadline;
    return finish(expired ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded")
                          : grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
  }
  if (call->error) return finish(ToGrpc(*call->error, req, metrics_->RecentGenerationSeconds()));
  const RequestResult& r = *call->result;
  if (stream) {
    v1::GenerateStreamResponse msg;
    grpc::Status st = FillResponse(r, OutputScale(req), true, Since(t0), msg.mutable_final());
    if (!st.ok()) return finish(st);
    if (!writer->Write(msg)) {
      return finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    }
  } else {
    grpc::Status st =
        FillResponse(r, OutputScale(req), req.output().include_tokens(), Since(t0), unary);
    if (!st.ok()) return finish(st);
  }
  return finish(grpc::Status::OK, &r);
}

}  // namespace imagegen::server
