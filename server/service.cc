#include "server/service.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cctype>
#include <optional>

#include "server/convert.h"

namespace imagegen::server {
namespace {

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
    case grpc::StatusCode::ABORTED:
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

grpc::ByteBuffer Serialize(const google::protobuf::Message& m) {
  grpc::ByteBuffer bb;
  bool own = false;
  grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(m, &bb, &own);
  return bb;
}

// Step updates that wait while the client reads slowly become one: the positions and tokens of
// all of them (so the stream still reassembles the grid exactly), the newest counters and
// drafts, and the newest preview (older ones are superseded).
void Merge(StepEvent& into, const StepEvent& e) {
  into.request_id = e.request_id;
  into.step = e.step;
  into.window = e.window;
  into.positions.insert(into.positions.end(), e.positions.begin(), e.positions.end());
  into.tokens.insert(into.tokens.end(), e.tokens.begin(), e.tokens.end());
  into.verified += e.verified;
  into.accepted += e.accepted;
  into.draft_positions = e.draft_positions;
  into.draft_tokens = e.draft_tokens;
  into.totals = e.totals;
  into.total_tokens = e.total_tokens;
  if (!e.preview.empty()) into.preview = e.preview;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// WorkQueue

WorkQueue::WorkQueue(int threads) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    threads_.emplace_back([this] {
      std::unique_lock<std::mutex> l(mu_);
      while (true) {
        cv_.wait(l, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping, and nothing left to run
        std::function<void()> task = std::move(tasks_.front());
        tasks_.pop_front();
        l.unlock();
        task();
        l.lock();
      }
    });
  }
}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkQueue::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> l(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

// ---------------------------------------------------------------------------------------------
// Call: one Generate or GenerateStream call, from validation to OnDone. The engine holds it as
// the request's observer, its reactor holds it until gRPC is done with the call, and the
// encoder pool holds it while a task for it runs.
//
// Under mu_, the state says who may touch the reactor next: a Pump task (queued_), a write in
// flight (writing_), or nobody after Finish (finished_). Reactor operations (StartWrite,
// Finish) are issued after mu_ is released, so that gRPC may run reactions on any thread.

class Call : public RequestObserver, public std::enable_shared_from_this<Call> {
 public:
  Call(ImageGenerationService* svc, grpc::CallbackServerContext* ctx)
      : svc_(svc), ctx_(ctx), t0_(Clock::now()), arrived_(std::chrono::system_clock::now()) {}

  void BindUnary(grpc::ServerUnaryReactor* r, grpc::ByteBuffer* out) {
    unary_ = r;
    unary_out_ = out;
  }
  void BindStream(grpc::ServerWriteReactor<grpc::ByteBuffer>* r) { stream_ = r; }
  bool streaming() const { return stream_ != nullptr; }

  // Set by ImageGenerationService::Begin before the request is submitted.
  v1::GenerateRequest req;
  std::string model, method = "unknown";
  int scale = 1;

  // The engine accepted the request as `id`.
  void Submitted(Engine* engine, int64_t id) {
    bool cancel = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      engine_ = engine;
      id_ = id;
      cancel = gone_;
    }
    if (cancel) engine->Cancel(id);
  }

  // Ends a call that never reached the engine.
  void FinishNow(const grpc::Status& st) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (finished_) return;
      finished_ = true;
      RecordEnd(st);
    }
    IssueFinish(st);
  }

  // --- the engine thread ---------------------------------------------------------------------
  void OnStep(const StepEvent& e) override {
    svc_->metrics_->OnRequestStep(model, method, e);
    if (!streaming()) return;
    std::lock_guard<std::mutex> l(mu_);
    if (finished_ || gone_) return;
    if (has_pending_) {
      Merge(pending_, e);
    } else {
      pending_ = e;
      has_pending_ = true;
    }
    ScheduleLocked();
  }
  void OnComplete(RequestResult r) override {
    std::lock_guard<std::mutex> l(mu_);
    result_ = std::move(r);
    ended_ = true;
    ScheduleLocked();
  }
  void OnError(const Status& s) override {
    std::lock_guard<std::mutex> l(mu_);
    error_ = s;
    ended_ = true;
    ScheduleLocked();
  }

  // --- gRPC's reactions ----------------------------------------------------------------------
  void Cancelled() {
    EngineRequest running;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!gone_) expired_ = PastDeadline();
      running = GoneLocked();
      ScheduleLocked();
    }
    running.Cancel();
  }
  void WriteDone(bool ok) {
    EngineRequest running;
    {
      std::lock_guard<std::mutex> l(mu_);
      writing_ = false;
      if (!ok && !gone_) running = GoneLocked();
      ScheduleLocked();
    }
    running.Cancel();
  }
  void Done() {
    std::lock_guard<std::mutex> l(ctx_mu_);
    done_ = true;
  }

  // --- the watchdog --------------------------------------------------------------------------
  // A write outstanding for longer than `limit`: the client has stopped reading. The call is
  // cancelled (that completes the write, and Pump then finishes the call ABORTED).
  void CheckStall(Clock::time_point now, std::chrono::milliseconds limit) {
    std::lock_guard<std::mutex> c(ctx_mu_);  // the context lives until OnDone
    if (done_) return;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!writing_ || stalled_ || now - write_started_ < limit) return;
      stalled_ = true;
    }
    svc_->metrics_->OnStreamStalled();
    ctx_->TryCancel();
  }

 private:
  // The engine request to cancel once mu_ is released (none if it has ended).
  struct EngineRequest {
    Engine* engine = nullptr;
    int64_t id = -1;
    void Cancel() const {
      if (engine != nullptr && id >= 0) engine->Cancel(id);
    }
  };
  // The client is gone (under mu_): what of the engine request is left to cancel.
  EngineRequest GoneLocked() {
    gone_ = true;
    return ended_ ? EngineRequest() : EngineRequest{engine_, id_};
  }

  // Queues a Pump unless one is queued, a write is in flight, or the call is finished.
  void ScheduleLocked() {
    if (queued_ || writing_ || finished_) return;
    queued_ = true;
    svc_->encoders_.Post([self = shared_from_this()] { self->Pump(); });
  }

  // Whether a cancellation is the client's deadline. On the wire a client's expired deadline and
  // its explicit cancel are the same RST_STREAM, and the client's timer runs ahead of ours by
  // the time the request took to arrive (the server's deadline is its arrival plus the sent
  // timeout): on a loaded machine the client's cancel lands before our deadline. So a cancel in
  // the last half of the call's time (at most the last second) counts as its deadline.
  bool PastDeadline() const {
    const auto deadline = ctx_->deadline();
    if (deadline == std::chrono::system_clock::time_point::max()) return false;
    const auto slack = std::min<std::chrono::system_clock::duration>(std::chrono::seconds(1),
                                                                     (deadline - arrived_) / 2);
    return std::chrono::system_clock::now() >= deadline - slack;
  }

  grpc::Status GoneStatus() const {
    if (stalled_) {
      return grpc::Status(grpc::StatusCode::ABORTED,
                          "the client read no stream message for " +
                              std::to_string(svc_->options_.stall_limit.count()) +
                              " ms; the request was cancelled");
    }
    return expired_ ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded")
                    : grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
  }

  void RecordEnd(const grpc::Status& st) {
    svc_->metrics_->OnRequestEnd(model, method, Outcome(st.error_code()),
                                 st.ok() && result_ ? &*result_ : nullptr, Since(t0_));
  }

  void IssueFinish(const grpc::Status& st) {
    if (unary_ != nullptr) {
      unary_->Finish(st);
    } else {
      stream_->Finish(st);
    }
  }

  // On the encoder pool: the next thing the call needs, if it can be done now.
  void Pump() {
    std::unique_lock<std::mutex> l(mu_);
    queued_ = false;
    while (!finished_ && !writing_) {
      if (gone_) {
        const grpc::Status st = GoneStatus();
        finished_ = true;
        RecordEnd(st);
        l.unlock();
        IssueFinish(st);
        return;
      }
      if (has_pending_) {  // a step update (streams only)
        StepEvent e = std::move(pending_);
        pending_ = StepEvent();
        has_pending_ = false;
        writing_ = true;  // reserved while encoding: nobody else starts a write
        l.unlock();
        v1::GenerateStreamResponse msg;
        FillStep(e, scale, msg.mutable_step());
        grpc::ByteBuffer bb = Serialize(msg);
        l.lock();
        if (gone_) {
          writing_ = false;
          continue;
        }
        out_ = std::move(bb);
        write_started_ = Clock::now();
        l.unlock();
        stream_->StartWrite(&out_);
        return;
      }
      if (!ended_) return;  // wait for the engine
      if (error_) {
        const grpc::Status st = ToGrpc(*error_, req, svc_->metrics_->RecentGenerationSeconds());
        finished_ = true;
        RecordEnd(st);
        l.unlock();
        IssueFinish(st);
        return;
      }
      // The image: encoded here, outside the lock (result_ no longer changes).
      writing_ = true;
      l.unlock();
      grpc::Status st;
      grpc::ByteBuffer bb;
      if (streaming()) {
        v1::GenerateStreamResponse msg;
        st = FillResponse(*result_, scale, true, Since(t0_), msg.mutable_final());
        bb = Serialize(msg);
      } else {
        v1::GenerateResponse msg;
        st = FillResponse(*result_, scale, req.output().include_tokens(), Since(t0_), &msg);
        bb = Serialize(msg);
      }
      l.lock();
      writing_ = false;
      if (gone_) continue;
      finished_ = true;
      RecordEnd(st);
      if (!st.ok() || !streaming()) {
        if (st.ok()) *unary_out_ = std::move(bb);
        l.unlock();
        IssueFinish(st);
        return;
      }
      out_ = std::move(bb);
      writing_ = true;
      write_started_ = Clock::now();
      l.unlock();
      stream_->StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
  }

  ImageGenerationService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  const Clock::time_point t0_;
  const std::chrono::system_clock::time_point arrived_;
  grpc::ServerUnaryReactor* unary_ = nullptr;
  grpc::ByteBuffer* unary_out_ = nullptr;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* stream_ = nullptr;

  std::mutex mu_;
  Engine* engine_ = nullptr;
  int64_t id_ = -1;
  bool queued_ = false, writing_ = false, finished_ = false;
  bool ended_ = false;    // the engine reported the end (result_ or error_)
  bool gone_ = false;     // cancelled, past its deadline, stalled, or a write failed
  bool expired_ = false;  // gone because the deadline passed
  bool stalled_ = false;
  bool has_pending_ = false;
  StepEvent pending_;
  std::optional<RequestResult> result_;
  std::optional<Status> error_;
  grpc::ByteBuffer out_;  // the message being written
  Clock::time_point write_started_;

  std::mutex ctx_mu_;
  bool done_ = false;  // gRPC is done with the call: ctx_ is gone
};

namespace {

// A call's gRPC side: forwards cancellation (and, for streams, write completions) to the Call,
// and when gRPC is done with the call, takes it off the service's books and deletes itself.
template <class Base>
class Reactor : public Base {
 public:
  Reactor(std::shared_ptr<Call> call, std::function<void(const Call*)> forget)
      : call_(std::move(call)), forget_(std::move(forget)) {}
  void OnCancel() override { call_->Cancelled(); }
  void OnDone() override {
    call_->Done();
    forget_(call_.get());
    delete this;
  }

 protected:
  std::shared_ptr<Call> call_;
  std::function<void(const Call*)> forget_;
};

using UnaryReactor = Reactor<grpc::ServerUnaryReactor>;

class StreamReactor final : public Reactor<grpc::ServerWriteReactor<grpc::ByteBuffer>> {
 public:
  using Reactor::Reactor;
  void OnWriteDone(bool ok) override { call_->WriteDone(ok); }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// ImageGenerationService

ImageGenerationService::ImageGenerationService(Metrics* metrics, TokenAuth auth,
                                               ServiceOptions options)
    : metrics_(metrics),
      auth_(std::move(auth)),
      options_(std::move(options)),
      encoders_(options_.encoder_threads) {
  watchdog_ = std::thread([this] { Watch(); });
}

ImageGenerationService::~ImageGenerationService() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
}

Status ImageGenerationService::SetEngine(Engine* engine) {
  for (const ModelInfo& m : engine->Models()) {
    if (m.text_tokenizer_path.empty()) continue;
    ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> t, Tokenizer::Load(m.text_tokenizer_path));
    if (t->vocab_size() > m.text_vocab_size) {
      return FailedPrecondition(m.text_tokenizer_path + ": " + std::to_string(t->vocab_size()) +
                                " token ids, but model '" + m.name + "' embeds " +
                                std::to_string(m.text_vocab_size));
    }
    tokenizers_[m.name] = std::move(t);
  }
  engine_.store(engine);
  return OkStatus();
}

grpc::Status ImageGenerationService::EncodePrompt(const Engine& engine, const std::string& model,
                                                  const std::string& text,
                                                  std::vector<int64_t>* ids) const {
  const std::vector<ModelInfo>& models = engine.Models();
  const ModelInfo* info = models.empty() ? nullptr : &models[0];
  for (const ModelInfo& m : models) {
    if (m.name == model) info = &m;
  }
  if (info == nullptr || (!model.empty() && info->name != model)) {
    return grpc::Status::OK;  // an unknown model: the engine reports NOT_FOUND
  }
  if (!info->prompted) {
    return BadField("prompt",
                    "model '" + info->name + "' is class-conditional; set class_id or class_name");
  }
  auto it = tokenizers_.find(info->name);
  if (it == tokenizers_.end()) {
    return BadField("prompt", "model '" + info->name +
                                  "' has no tokenizer.json on this server; send "
                                  "prompt_token_ids");
  }
  std::string templated = info->prompt_template;
  templated.replace(templated.find("{prompt}"), 8, text);
  StatusOr<std::vector<int32_t>> enc = it->second->Encode(templated);
  if (!enc.ok()) return BadField("prompt", enc.status().message());
  ids->assign(enc->begin(), enc->end());
  return grpc::Status::OK;
}

void ImageGenerationService::SetDraining() { draining_.store(true); }

int64_t ImageGenerationService::open_calls() const {
  std::lock_guard<std::mutex> l(mu_);
  return open_calls_;
}

void ImageGenerationService::Forget(const Call* call) {
  {
    std::lock_guard<std::mutex> l(mu_);
    open_calls_ -= 1;
    streams_.remove_if([call](const std::weak_ptr<Call>& w) {
      auto p = w.lock();
      return p == nullptr || p.get() == call;
    });
  }
  metrics_->OnCallClosed();
}

void ImageGenerationService::Watch() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    cv_.wait_for(l, std::chrono::milliseconds(250));
    std::vector<std::shared_ptr<Call>> calls;
    for (const auto& w : streams_) {
      if (auto p = w.lock()) calls.push_back(std::move(p));
    }
    l.unlock();
    const auto now = Clock::now();
    for (const auto& c : calls) c->CheckStall(now, options_.stall_limit);
    calls.clear();  // release outside mu_: the last reference may go here
    l.lock();
  }
}

grpc::Status ImageGenerationService::Begin(const std::shared_ptr<Call>& call,
                                           grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer& request) {
  {
    std::lock_guard<std::mutex> l(mu_);
    open_calls_ += 1;
  }
  // gRPC's retry layer marks the second and later attempts of a call (gRFC A6).
  const auto& md = ctx->client_metadata();
  const auto attempts = md.find("grpc-previous-rpc-attempts");
  metrics_->OnCallOpened(attempts != md.end() && attempts->second != "0");
  // The body first (for the metric labels), then who may call, then what it asks.
  grpc::Status parsed = grpc::Status::OK;
  grpc::ByteBuffer copy(request);
  if (request.Length() > options_.max_request_bytes) {
    parsed =
        BadField("request", "the body is " + std::to_string(request.Length()) + " bytes; at most " +
                                std::to_string(options_.max_request_bytes) + " are accepted");
  } else if (!grpc::SerializationTraits<v1::GenerateRequest>::Deserialize(&copy, &call->req).ok()) {
    parsed = BadField("request", "the body is not a valid imagegen.v1.GenerateRequest");
  } else {
    call->model = call->req.model();
    call->method = MethodLabel(call->req, options_.default_method);
    call->scale = OutputScale(call->req);
  }
  if (!auth_.Allows(*ctx)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token");
  }
  Engine* engine = engine_.load();
  if (engine == nullptr) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "models are loading");
  if (draining_.load()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
  }
  if (!parsed.ok()) return parsed;
  // A continuous-token model's default method is mar, whatever the server's default.
  const std::string default_method =
      DefaultMethodFor(engine->Models(), call->req.model(), options_.default_method);
  call->method = MethodLabel(call->req, default_method);
  GenerateParams params;
  if (grpc::Status st = ToParams(call->req, default_method, &params); !st.ok()) return st;
  if (!call->req.prompt().empty()) {
    grpc::Status st =
        EncodePrompt(*engine, call->req.model(), call->req.prompt(), &params.prompt_token_ids);
    if (!st.ok()) return st;
  }
  // The client's deadline, as a duration from now on the engine's monotonic clock.
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    params.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         deadline - std::chrono::system_clock::now());
  }
  if (call->streaming()) {  // watched from now on; OnDone takes it off the list
    std::lock_guard<std::mutex> l(mu_);
    streams_.push_back(call);
  }
  StatusOr<int64_t> id = engine->Submit(std::move(params), call);
  if (!id.ok()) return ToGrpc(id.status(), call->req, metrics_->RecentGenerationSeconds());
  call->Submitted(engine, *id);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* ImageGenerationService::Generate(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* response) {
  auto call = std::make_shared<Call>(this, ctx);
  auto* reactor = new UnaryReactor(call, [this](const Call* c) { Forget(c); });
  call->BindUnary(reactor, response);
  if (grpc::Status st = Begin(call, ctx, *request); !st.ok()) call->FinishNow(st);
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ImageGenerationService::GenerateStream(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  auto call = std::make_shared<Call>(this, ctx);
  auto* reactor = new StreamReactor(call, [this](const Call* c) { Forget(c); });
  call->BindStream(reactor);
  if (grpc::Status st = Begin(call, ctx, *request); !st.ok()) call->FinishNow(st);
  return reactor;
}

grpc::ServerUnaryReactor* ImageGenerationService::ListModels(grpc::CallbackServerContext* ctx,
                                                             const v1::ListModelsRequest*,
                                                             v1::ListModelsResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (!auth_.Allows(*ctx)) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token"));
    return reactor;
  }
  Engine* engine = engine_.load();
  if (engine == nullptr) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "models are loading"));
    return reactor;
  }
  FillModels(engine->Models(), options_.default_method, resp);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace imagegen::server
