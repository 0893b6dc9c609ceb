#include "server/service.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <optional>

#include "server/convert.h"

namespace imagegen::server {
namespace {

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
// Call: one Generate or GenerateStream call, from validation to OnDone, for its n images (one
// engine request each). The engine holds it through each image's observer, its reactor holds
// it until gRPC is done with the call, and the encoder pool holds it while a task for it runs.
//
// Under mu_, the state says who may touch the reactor next: a Pump task (queued_), a write in
// flight (writing_), or nobody after Finish (finished_). Reactor operations (StartWrite,
// Finish) are issued after mu_ is released, so that gRPC may run reactions on any thread.

class Call : public std::enable_shared_from_this<Call> {
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
  std::string request_id, peer;  // for the request log
  std::optional<TraceParent> trace;
  Caller caller;
  int32_t priority = 0;  // the request's, or its key's (after Resolve)

  // Before submission: the call draws `n` images.
  void Expect(int n) {
    results_.resize(static_cast<size_t>(n));
    image_ended_.assign(static_cast<size_t>(n), false);
  }

  // The engine accepted the images as `ids` (in index order).
  void Submitted(Engine* engine, std::vector<int64_t> ids) {
    EngineRequests cancel;
    {
      std::lock_guard<std::mutex> l(mu_);
      engine_ = engine;
      ids_ = std::move(ids);
      // Gone, or an image failed, before the ids were known: cancel the rest now.
      if (gone_ || error_) cancel = RunningLocked();
    }
    cancel.Cancel();
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

  // --- the engine thread (through each image's observer) --------------------------------------
  void OnStep(int index, const StepEvent& e) {
    svc_->metrics_->OnRequestStep(model, method, e);
    if (!streaming()) return;
    std::lock_guard<std::mutex> l(mu_);
    if (finished_ || gone_) return;
    auto it = pending_.find(index);
    if (it != pending_.end()) {
      Merge(it->second, e);
    } else {
      pending_.emplace(index, e);
    }
    ScheduleLocked();
  }
  void OnComplete(int index, RequestResult r) {
    std::lock_guard<std::mutex> l(mu_);
    image_ended_[static_cast<size_t>(index)] = true;
    results_[static_cast<size_t>(index)] = std::move(r);
    ready_.push_back(index);
    completed_ += 1;
    ScheduleLocked();
  }
  void OnError(int index, const Status& s) {
    EngineRequests others;
    {
      std::lock_guard<std::mutex> l(mu_);
      image_ended_[static_cast<size_t>(index)] = true;
      if (error_) return;  // the call already ends with the first error
      error_ = s;
      others = RunningLocked();  // the call is over: its other images are not wanted
      ScheduleLocked();
    }
    others.Cancel();
  }

  // --- gRPC's reactions ----------------------------------------------------------------------
  void Cancelled() {
    EngineRequests running;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!gone_) expired_ = PastDeadline();
      running = GoneLocked();
      ScheduleLocked();
    }
    running.Cancel();
  }
  void WriteDone(bool ok) {
    EngineRequests running;
    {
      std::lock_guard<std::mutex> l(mu_);
      writing_ = false;
      write_started_.reset();
      if (ok && last_written_) last_delivered_ = true;  // a later cancel changes nothing
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
      if (!write_started_ || stalled_ || now - *write_started_ < limit) return;
      stalled_ = true;
    }
    svc_->metrics_->OnStreamStalled();
    ctx_->TryCancel();
  }

 private:
  // The engine requests to cancel once mu_ is released.
  struct EngineRequests {
    Engine* engine = nullptr;
    std::vector<int64_t> ids;
    void Cancel() const {
      for (int64_t id : ids) engine->Cancel(id);
    }
  };
  // Under mu_: the submitted images that have not ended.
  EngineRequests RunningLocked() const {
    EngineRequests r{engine_, {}};
    for (size_t i = 0; i < ids_.size(); ++i) {
      if (!image_ended_[i]) r.ids.push_back(ids_[i]);
    }
    return r;
  }
  // The client is gone (under mu_): what of the engine requests is left to cancel.
  EngineRequests GoneLocked() {
    gone_ = true;
    return RunningLocked();
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

  // Under mu_, once: the call's outcome in the metrics and the request log.
  void RecordEnd(const grpc::Status& st) {
    const std::string outcome = OutcomeLabel(st.error_code());
    svc_->metrics_->OnRequestEnd(model, method, outcome);
    svc_->metrics_->OnKeyRequestEnd(caller.key_name(), outcome);
    caller.lease.reset();  // the call's images no longer count against its key
    RequestLog* log = svc_->options_.request_log;
    if (log == nullptr) return;
    record_.request_id = request_id;
    record_.trace = trace;
    record_.api = streaming() ? "grpc-stream" : "grpc";
    record_.peer = peer;
    record_.model = svc_->ModelName(model);
    record_.method = method;
    record_.images = std::max(req.n(), 1);
    record_.user = req.user().substr(0, 256);
    record_.priority = priority;
    record_.key = caller.key_name();
    record_.address = caller.logged_address();
    record_.outcome = outcome;
    record_.error = st.ok() ? "" : st.error_message();
    record_.seconds = Since(t0_);
    log->Call(record_);
  }

  // The Pump task, before the call's first message or its successful answer: the request id in
  // the response's headers as well (they go out with it).
  void Headers() {
    if (headers_) return;
    headers_ = true;
    ctx_->AddInitialMetadata("x-request-id", request_id);
  }

  void IssueFinish(const grpc::Status& st) {
    if (unary_ != nullptr) {
      unary_->Finish(st);
    } else {
      stream_->Finish(st);
    }
  }

  // Image `index` as a response (its PNG encoded here); counted in the metrics when it is sent.
  grpc::Status Encode(int index, bool include_tokens, v1::GenerateResponse* out) {
    const RequestResult& r = *results_[static_cast<size_t>(index)];
    grpc::Status st = FillResponse(r, scale, include_tokens, Since(t0_), out);
    out->set_index(index);
    return st;
  }

  // On the encoder pool: the next thing the call needs, if it can be done now.
  void Pump() {
    std::unique_lock<std::mutex> l(mu_);
    queued_ = false;
    while (!finished_ && !writing_) {
      if (gone_ && !last_delivered_) {
        const grpc::Status st = GoneStatus();
        finished_ = true;
        RecordEnd(st);
        l.unlock();
        IssueFinish(st);
        return;
      }
      if (last_delivered_) {  // the stream's last message reached the client: it ends OK
        finished_ = true;
        RecordEnd(grpc::Status::OK);
        l.unlock();
        IssueFinish(grpc::Status::OK);
        return;
      }
      if (!pending_.empty()) {  // a step update (streams only)
        const int index = pending_.begin()->first;
        StepEvent e = std::move(pending_.begin()->second);
        pending_.erase(pending_.begin());
        writing_ = true;  // reserved while encoding: nobody else starts a write
        l.unlock();
        v1::GenerateStreamResponse msg;
        FillStep(e, scale, msg.mutable_step());
        msg.mutable_step()->set_index(index);
        grpc::ByteBuffer bb = Serialize(msg);
        l.lock();
        if (gone_) {
          writing_ = false;
          continue;
        }
        out_ = std::move(bb);
        write_started_ = Clock::now();
        l.unlock();
        Headers();
        stream_->StartWrite(&out_);
        return;
      }
      if (error_) {
        const grpc::Status st = ToGrpc(*error_, req, svc_->metrics_->RecentGenerationSeconds());
        finished_ = true;
        RecordEnd(st);
        l.unlock();
        IssueFinish(st);
        return;
      }
      // An image for the client: a stream sends each as it finishes, the unary response all n
      // at once. Encoded here, outside the lock (a finished image's result no longer changes).
      const int n = static_cast<int>(results_.size());
      if (streaming() ? ready_.empty() : completed_ < n) return;  // wait for the engine
      std::vector<int> images;
      if (streaming()) {
        images.push_back(ready_.front());
        ready_.pop_front();
      } else {
        for (int i = 0; i < n; ++i) images.push_back(i);
      }
      const bool last = streaming() ? ++sent_ == n : true;
      writing_ = true;
      l.unlock();
      grpc::Status st;
      grpc::ByteBuffer bb;
      if (streaming()) {
        v1::GenerateStreamResponse msg;
        st = Encode(images[0], true, msg.mutable_final());
        bb = Serialize(msg);
      } else {
        v1::GenerateResponse msg;
        const bool tokens = req.output().include_tokens();
        st = Encode(0, tokens, &msg);
        for (int i = 1; i < n && st.ok(); ++i) st = Encode(i, tokens, msg.add_more_images());
        bb = Serialize(msg);
      }
      l.lock();
      writing_ = false;
      if (gone_) continue;
      if (st.ok()) {
        for (int i : images) {
          svc_->metrics_->OnImage(model, method, *results_[static_cast<size_t>(i)], Since(t0_));
          svc_->metrics_->OnKeyImage(caller.key_name(), *results_[static_cast<size_t>(i)]);
          record_.AddImage(*results_[static_cast<size_t>(i)]);
          results_[static_cast<size_t>(i)].reset();  // sent: its pixels are not kept
        }
      }
      if (!st.ok() || !streaming()) {
        finished_ = true;
        RecordEnd(st);
        if (st.ok()) *unary_out_ = std::move(bb);
        l.unlock();
        if (st.ok()) Headers();
        IssueFinish(st);
        return;
      }
      out_ = std::move(bb);
      writing_ = true;
      write_started_ = Clock::now();
      // The last message is written like the others and the call finished once it is done:
      // a client that stops reading before it is ended by the watchdog (ABORTED, counted as
      // stalled), where StartWriteAndFinish had already counted the call as OK.
      last_written_ = last;
      l.unlock();
      Headers();
      stream_->StartWrite(&out_);
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
  std::vector<int64_t> ids_;       // the images' engine requests, by index
  std::vector<bool> image_ended_;  // the engine reported the image's end
  bool queued_ = false, writing_ = false, finished_ = false;
  bool last_written_ = false;    // a stream's last message is written (or being written)
  bool last_delivered_ = false;  // ... and its write completed
  bool gone_ = false;            // cancelled, past its deadline, stalled, or a write failed
  bool expired_ = false;         // gone because the deadline passed
  bool stalled_ = false;
  std::map<int, StepEvent> pending_;                   // step updates not yet written, by image
  std::vector<std::optional<RequestResult>> results_;  // finished images not yet sent
  std::deque<int> ready_;                              // streams: finished, not yet sent
  int completed_ = 0, sent_ = 0;
  std::optional<Status> error_;  // the first image error: the call's outcome
  CallRecord record_;            // the images sent so far, for the request log
  grpc::ByteBuffer out_;         // the message being written
  bool headers_ = false;         // Pump's: the request id is in the initial metadata
  // When the write in flight was started: none while a message is being encoded (writing_ is
  // set then, to reserve the stream) or no write is in flight, so that the watchdog times the
  // client's reading alone. (It used to read writing_ and a stale time: a stream's first
  // message, a large preview encoded on a loaded machine, was cancelled as stalled.)
  std::optional<Clock::time_point> write_started_;

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
                                                  const std::string& field, const std::string& text,
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
    return BadField(field,
                    "model '" + info->name + "' is class-conditional; set class_id or class_name");
  }
  auto it = tokenizers_.find(info->name);
  if (it == tokenizers_.end()) {
    return BadField(field, "model '" + info->name +
                               "' has no tokenizer.json on this server; send " + field +
                               "_token_ids");
  }
  std::string templated = info->prompt_template;
  templated.replace(templated.find("{prompt}"), 8, text);
  StatusOr<std::vector<int32_t>> enc = it->second->Encode(templated);
  if (!enc.ok()) return BadField(field, enc.status().message());
  ids->assign(enc->begin(), enc->end());
  return grpc::Status::OK;
}

std::string ImageGenerationService::ModelName(const std::string& requested) const {
  if (!requested.empty()) return requested;
  const Engine* engine = engine_.load();
  if (engine == nullptr || engine->Models().empty()) return "";
  return engine->Models()[0].name;
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

grpc::Status ImageGenerationService::CheckRequestId(const std::string& request_id,
                                                    const grpc::Status& parsed,
                                                    std::string* request_id_out) {
  if (!request_id.empty() && ValidRequestId(request_id)) {
    *request_id_out = request_id;
    return parsed;
  }
  *request_id_out = NewRequestId();
  if (request_id.empty() || !parsed.ok()) return parsed;
  return BadField("x-request-id", RequestIdError(request_id));
}

grpc::Status ImageGenerationService::RefuseIfUnhealthy(const std::string& model) const {
  EngineHealth h;
  {
    std::lock_guard<std::mutex> l(unhealthy_mu_);
    if (!unhealthy_.refuse) return grpc::Status::OK;
    h = unhealthy_;
  }
  if (h.reason == "failing") {
    if (ModelName(model) != h.model) return grpc::Status::OK;  // another model's steps work
    return UnavailableFor("engine failing: " + h.what + "; calls of model " + h.model +
                              " are refused here until one of its steps succeeds: retry on "
                              "another replica",
                          h.retry_seconds);
  }
  return UnavailableFor("engine " + h.reason + ": " + h.what +
                            "; calls are refused here until it moves: retry on another replica",
                        h.retry_seconds);
}

Caller ImageGenerationService::Identify(std::string_view authorization, const std::string& peer,
                                        std::string_view forwarded_for) const {
  Caller c;
  c.key = auth_.AuthenticateHeader(authorization);
  c.address = options_.trusted_proxies.ClientAddress(peer, forwarded_for, &c.forwarded);
  return c;
}

grpc::Status ImageGenerationService::Resolve(const v1::GenerateRequest& req, Caller& caller,
                                             const grpc::Status& parsed,
                                             std::chrono::system_clock::time_point deadline,
                                             Engine** engine_out,
                                             std::vector<GenerateParams>* images,
                                             std::string* method) const {
  if (caller.key == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token");
  }
  Engine* engine = engine_.load();
  if (engine == nullptr) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "models are loading");
  if (draining_.load()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
  }
  if (grpc::Status st = RefuseIfUnhealthy(req.model()); !st.ok()) return st;
  if (!parsed.ok()) return parsed;
  // A continuous-token model's default method is mar, whatever the server's default.
  const std::string default_method =
      DefaultMethodFor(engine->Models(), req.model(), options_.default_method);
  *method = MethodLabel(req, default_method);
  if (req.n() < 0 || req.n() > options_.max_images) {
    return BadField("n", "must be in [1, " + std::to_string(options_.max_images) +
                             "] (0 means 1); this server's --max-images is " +
                             std::to_string(options_.max_images));
  }
  GenerateParams params;
  if (grpc::Status st = ToParams(req, default_method, &params); !st.ok()) return st;
  for (const ModelInfo& m : engine->Models()) {
    const bool asked =
        req.model().empty() ? &m == &engine->Models().front() : m.name == req.model();
    if (asked && OutputScale(req) > MaxScale(m)) {
      return BadField("output.scale", "at most " + std::to_string(MaxScale(m)) + " for model '" +
                                          m.name + "' (" + std::to_string(m.image_width) + "x" +
                                          std::to_string(m.image_height) + " images; at most " +
                                          std::to_string(kMaxOutputSide) + " px a side upscaled)");
    }
  }
  if (!req.prompt().empty()) {
    grpc::Status st =
        EncodePrompt(*engine, req.model(), "prompt", req.prompt(), &params.prompt_token_ids);
    if (!st.ok()) return st;
  }
  if (!req.negative_prompt().empty()) {
    grpc::Status st = EncodePrompt(*engine, req.model(), "negative_prompt", req.negative_prompt(),
                                   &params.negative_prompt_token_ids);
    if (!st.ok()) return st;
  }
  // The client's deadline, as a duration from now on the engine's monotonic clock.
  if (deadline != std::chrono::system_clock::time_point::max()) {
    params.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         deadline - std::chrono::system_clock::now());
  }
  if (caller.key->priority.has_value()) {
    const int32_t floor = *caller.key->priority;
    if (req.priority() == 0) {
      params.priority = floor;
    } else if (req.priority() < floor) {
      return DeniedField("priority", std::to_string(req.priority()) +
                                         " is more urgent than this API key may ask for (at most " +
                                         std::to_string(floor) + ", its default)");
    }
  }
  params.tenant = caller.key->name;
  params.client = ClientOf(req.user(), caller.address);
  const int n = std::max(req.n(), 1);
  if (caller.key->max_in_flight.has_value()) {
    const int64_t max = *caller.key->max_in_flight;
    if (n > max) {
      return BadField("n", std::to_string(n) + " images: this API key may have at most " +
                               std::to_string(max) + " in flight");
    }
    std::lock_guard<std::mutex> l(key_counts_->mu);
    int64_t& used = key_counts_->in_flight[caller.key->name];
    if (used + n > max) {
      return Overloaded("this API key has " + std::to_string(used) +
                            " images in flight, its max_in_flight is " + std::to_string(max),
                        metrics_->RecentGenerationSeconds());
    }
    used += n;
    // Gives the images back when the call's outcome is recorded (or the call is destroyed).
    class Lease {
     public:
      Lease(std::shared_ptr<KeyCounts> counts, std::string name, int64_t n)
          : counts_(std::move(counts)), name_(std::move(name)), n_(n) {}
      Lease(const Lease&) = delete;
      Lease& operator=(const Lease&) = delete;
      ~Lease() {
        std::lock_guard<std::mutex> l(counts_->mu);
        counts_->in_flight[name_] -= n_;
      }

     private:
      const std::shared_ptr<KeyCounts> counts_;
      const std::string name_;
      const int64_t n_;
    };
    caller.lease = std::make_shared<const Lease>(key_counts_, caller.key->name, n);
  }
  images->assign(static_cast<size_t>(n), params);
  for (int i = 0; i < n; ++i) {
    if (params.seed.has_value()) (*images)[static_cast<size_t>(i)].seed = *params.seed + i;
  }
  *engine_out = engine;
  return grpc::Status::OK;
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
  const auto rid = md.find("x-request-id");
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
  parsed =
      CheckRequestId(rid == md.end() ? "" : std::string(rid->second.data(), rid->second.size()),
                     parsed, &call->request_id);
  // The id goes back in the headers once a message or an image goes out (Call::Headers), and
  // never with an error: a response with headers is one gRPC's client may no longer retry
  // (gRFC A6), and with the id in the trailers too tests/deploy/replicas.py still saw a unary
  // UNAVAILABLE of a draining replica not retried (2 runs of 8). Errors are answered as
  // before; their id is in the server's log line.
  call->peer = ctx->peer();
  if (auto t = md.find("traceparent"); t != md.end()) {
    call->trace = ParseTraceparent(std::string_view(t->second.data(), t->second.size()));
  }
  std::string authorization, forwarded_for;
  if (auto a = md.find("authorization"); a != md.end()) {
    authorization.assign(a->second.data(), a->second.size());
  }
  for (auto [it, end] = md.equal_range("x-forwarded-for"); it != end; ++it) {
    if (!forwarded_for.empty()) forwarded_for += ",";
    forwarded_for.append(it->second.data(), it->second.size());
  }
  call->caller = Identify(authorization, call->peer, forwarded_for);
  call->priority = call->req.priority();
  const auto deadline = ctx->deadline();
  Engine* engine = nullptr;
  std::vector<GenerateParams> images;
  grpc::Status st =
      Resolve(call->req, call->caller, parsed, deadline, &engine, &images, &call->method);
  if (!images.empty()) call->priority = images[0].priority;
  if (!st.ok()) return st;
  // n images: one engine request each, queued together (they share the prompt's prefill).
  const int n = static_cast<int>(images.size());
  std::vector<std::shared_ptr<RequestObserver>> observers;
  for (int i = 0; i < n; ++i) observers.push_back(std::make_shared<ImageObserver<Call>>(call, i));
  call->Expect(n);
  if (call->streaming()) {  // watched from now on; OnDone takes it off the list
    std::lock_guard<std::mutex> l(mu_);
    streams_.push_back(call);
  }
  StatusOr<std::vector<int64_t>> ids = engine->SubmitGroup(std::move(images), std::move(observers));
  if (!ids.ok()) return ToGrpc(ids.status(), call->req, metrics_->RecentGenerationSeconds());
  call->Submitted(engine, std::move(*ids));
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
  resp->set_max_images(options_.max_images);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace imagegen::server
