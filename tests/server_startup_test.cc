// The daemon's start-up, in-process (server/daemon.h, as server/main.cc drives it): the engine
// starter given to Load() holds back until the test has seen the not-yet-ready state through
// real gRPC calls on loopback (health "" SERVING, the service NOT_SERVING, Generate UNAVAILABLE
// "models are loading"), then starts the real engine on the bundled models; the service turns
// SERVING and serves an image. No LibTorch here: the engine is reached through its torch-free
// header only.
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "imagegen/v1/imagegen.grpc.pb.h"
#include "server/daemon.h"
#include "tests/build_paths.h"
#include "tests/http_client.h"
#include "tests/poll.h"

namespace imagegen::testing {
namespace {

namespace v1 = imagegen::v1;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr char kService[] = "imagegen.v1.ImageGeneration";

server::DaemonOptions Options() {
  server::DaemonOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "127.0.0.1:0";
  o.engine.models_dir = imagegen::testing::TestModelsDir();
  o.engine.max_slots = 4;
  return o;
}

class Client {
 public:
  explicit Client(int port)
      : channel_(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                     grpc::InsecureChannelCredentials())),
        health_(grpc::health::v1::Health::NewStub(channel_)),
        stub_(v1::ImageGeneration::NewStub(channel_)) {}

  HealthCheckResponse::ServingStatus Health(const std::string& service) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(30));
    HealthCheckRequest req;
    req.set_service(service);
    HealthCheckResponse resp;
    grpc::Status st = health_->Check(&ctx, req, &resp);
    return st.ok() ? resp.status() : HealthCheckResponse::UNKNOWN;
  }
  grpc::Status Generate(const std::string& method, v1::GenerateResponse* resp,
                        seconds deadline = seconds(300)) {
    v1::GenerateRequest req;
    req.set_class_name("bag");
    req.set_seed(1);
    req.set_method(method);
    req.mutable_output()->set_include_tokens(true);
    return Call(req, resp, deadline);
  }
  // The bundled text-to-image model.
  grpc::Status GenerateFromText(v1::GenerateResponse* resp) {
    v1::GenerateRequest req;
    req.set_model("fmnist-t2i");
    req.set_prompt("a bag");
    req.set_seed(1);
    req.set_method("ar");
    return Call(req, resp, seconds(300));
  }
  grpc::Status Call(const v1::GenerateRequest& req, v1::GenerateResponse* resp, seconds deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    return stub_->Generate(&ctx, req, resp);
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::unique_ptr<v1::ImageGeneration::Stub> stub_;
};

TEST(ServerStartupTest, AliveAtOnceNotReadyWhileTheModelsLoadThenServing) {
  auto listening = server::Daemon::Listen(Options());
  ASSERT_TRUE(listening.ok()) << listening.status().ToString();
  std::unique_ptr<server::Daemon> d = std::move(listening).value();
  ASSERT_GT(d->port(), 0);
  ASSERT_GT(d->metrics_port(), 0);

  // The starter: says it has been entered (Load is under way), waits for the test, then
  // loads the bundled models for real.
  Gate release;
  std::atomic<bool> entered{false};
  server::EngineStarter starter = [&](const EngineOptions& eo, EngineListener* listener) {
    entered.store(true);
    release.Wait();
    return Engine::Start(eo, listener);
  };
  Status loaded = Internal("Load has not returned");
  // Load's before_serving runs once the engine is up but before any call can reach it (the
  // daemon's main decides there whether a SIGTERM came while loading): still NOT_SERVING, and a
  // call is still refused.
  std::atomic<int> ready_calls{0};
  HealthCheckResponse::ServingStatus health_before_serving = HealthCheckResponse::SERVING;
  grpc::StatusCode generate_before_serving = grpc::StatusCode::OK;
  auto before_serving = [&] {
    ++ready_calls;
    Client early(d->port());
    health_before_serving = early.Health(kService);
    v1::GenerateResponse r;
    generate_before_serving = early.Generate("ar", &r).error_code();
  };
  std::thread loader([&] { loaded = d->Load(starter, before_serving); });
  // Whatever happens below, let the loader finish before `release` and `d` go away.
  struct Joiner {
    Gate& gate;
    std::thread& t;
    ~Joiner() {
      gate.Open();
      if (t.joinable()) t.join();
    }
  } joiner{release, loader};
  ASSERT_TRUE(WaitUntil([&] { return entered.load(); }, seconds(60)));

  // Loading: alive, not ready, calls refused.
  Client c(d->port());
  EXPECT_EQ(c.Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(c.Health(kService), HealthCheckResponse::NOT_SERVING);
  v1::GenerateResponse resp;
  grpc::Status early = c.Generate("ar", &resp);
  EXPECT_EQ(early.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(early.error_message().find("models are loading"), std::string::npos)
      << early.error_message();
  EXPECT_EQ(c.Health(kService), HealthCheckResponse::NOT_SERVING);  // still held back

  // Released: the real engine loads and the service turns SERVING.
  release.Open();
  EXPECT_TRUE(
      WaitUntil([&] { return c.Health(kService) == HealthCheckResponse::SERVING; }, seconds(300)));
  loader.join();
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_EQ(ready_calls.load(), 1);
  EXPECT_EQ(health_before_serving, HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(generate_before_serving, grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(c.Health(""), HealthCheckResponse::SERVING);
  EXPECT_NE(d->Describe().find("fmnist-gpt"), std::string::npos) << d->Describe();
  // On the CPU (the engine's default device) a lone request's window ceiling, -1 resolved to
  // the step-cost calibration's.
  EXPECT_NE(d->Describe().find("a request alone at most the nodes its step-cost calibration makes "
                               "fastest"),
            std::string::npos)
      << d->Describe();

  v1::GenerateResponse image;
  grpc::Status st = c.Generate("scd-mc", &image);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(image.tokens_size(), 196);
  EXPECT_FALSE(image.image_png().empty());

  const EngineStats stats = d->Stop(seconds(30));
  EXPECT_EQ(stats.completed, 1);
  EXPECT_NE(c.Health(""), HealthCheckResponse::SERVING);
}

// GET `path` on one of the daemon's HTTP ports; the raw response ("" if none came).
std::string Get(int port, const std::string& path) {
  return Fetch(port, "GET " + path + " HTTP/1.0\r\n\r\n");
}

// One image of fmnist-gpt through the OpenAI Images API; the raw response.
std::string PostImage(int port) {
  const std::string body = R"({"model":"fmnist-gpt","prompt":"bag","response_format":"b64_json"})";
  return Fetch(port,
               "POST /v1/images/generations HTTP/1.0\r\nContent-Type: application/json\r\n"
               "Content-Length: " +
                   std::to_string(body.size()) + "\r\n\r\n" + body);
}

// The RetryInfo delay a status carries, in seconds; -1 without one.
double RetrySeconds(const grpc::Status& s) {
  google::rpc::Status details;
  if (s.error_details().empty() || !details.ParseFromString(s.error_details())) return -1;
  for (const auto& d : details.details()) {
    google::rpc::RetryInfo ri;
    if (d.UnpackTo(&ri)) return ri.retry_delay().seconds() + ri.retry_delay().nanos() / 1e9;
  }
  return -1;
}

// A new call of fmnist-gpt refused at once for an unhealthy engine, over gRPC and HTTP:
// UNAVAILABLE whose message starts with `why` and sends the client elsewhere, with a RetryInfo
// of `retry_seconds` (a call that was not refused would wait out its 60 s deadline or run), and
// 503 with the same message and Retry-After (whole seconds, rounded up).
void ExpectRefused(Client& c, int http_port, const std::string& why, double retry_seconds) {
  v1::GenerateResponse r;
  const grpc::Status refused = c.Generate("ar", &r, seconds(60));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_EQ(refused.error_message().rfind(why, 0), 0u) << refused.error_message();
  EXPECT_NE(refused.error_message().find("retry on another replica"), std::string::npos)
      << refused.error_message();
  EXPECT_DOUBLE_EQ(RetrySeconds(refused), retry_seconds);
  const std::string http = PostImage(http_port);
  EXPECT_NE(http.find(" 503 "), std::string::npos) << http;
  EXPECT_NE(http.find("Retry-After: " + std::to_string(static_cast<int>(std::ceil(retry_seconds)))),
            std::string::npos)
      << http;
  EXPECT_NE(http.find(why), std::string::npos) << http;
}

// The engine's listener (the daemon's metrics), held in its OnStep on demand: the engine
// thread wedged inside a step, as a hung device would leave it.
class HoldingListener : public EngineListener {
 public:
  explicit HoldingListener(EngineListener* inner) : inner_(inner) {}
  void OnStep(const StepSample& s) override {
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return !hold_; });
    }
    inner_->OnStep(s);
  }
  void Hold(bool hold) {
    std::lock_guard<std::mutex> l(mu_);
    hold_ = hold;
    cv_.notify_all();
  }

 private:
  EngineListener* const inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;
};

// --engine-stall-seconds: a wedged engine turns liveness and readiness NOT_SERVING (gRPC health
// and HTTP /health/live) while a request waits on it, and SERVING again once it moves; the
// request then completes.
TEST(ServerStartupTest, AWedgedEngineFailsLivenessUntilItMovesAgain) {
  server::DaemonOptions o = Options();
  o.http_listen = "127.0.0.1:0";
  // Not 1 s: on a machine loaded by other tests a step of the bundled model took about 1 s, and
  // health then turned NOT_SERVING between the steps of the released request.
  o.engine_stall_seconds = 3;
  auto listening = server::Daemon::Listen(o);
  ASSERT_TRUE(listening.ok()) << listening.status().ToString();
  std::unique_ptr<server::Daemon> d = std::move(listening).value();
  std::unique_ptr<HoldingListener> holder;
  ASSERT_TRUE(d->Load([&](const EngineOptions& eo, EngineListener* listener) {
                 holder = std::make_unique<HoldingListener>(listener);
                 return Engine::Start(eo, holder.get());
               }).ok());
  Client c(d->port());
  ASSERT_EQ(c.Health(""), HealthCheckResponse::SERVING);
  ASSERT_EQ(c.Health(kService), HealthCheckResponse::SERVING);
  // Idle for longer than the limit is not a stall.
  std::this_thread::sleep_for(milliseconds(3500));
  EXPECT_EQ(c.Health(""), HealthCheckResponse::SERVING);
  EXPECT_NE(Get(d->http_port(), "/health/live").find(" 200 "), std::string::npos);

  holder->Hold(true);
  grpc::Status generated = grpc::Status(grpc::StatusCode::UNKNOWN, "not returned");
  v1::GenerateResponse image;
  std::thread call([&] { generated = c.Generate("scd-mc", &image); });
  struct Releaser {  // whatever fails below, the call returns before `c` and `d` go
    HoldingListener* h;
    std::thread& t;
    ~Releaser() {
      h->Hold(false);
      if (t.joinable()) t.join();
    }
  } releaser{holder.get(), call};
  ASSERT_TRUE(
      WaitUntil([&] { return c.Health("") == HealthCheckResponse::NOT_SERVING; }, seconds(120)));
  EXPECT_EQ(c.Health(kService), HealthCheckResponse::NOT_SERVING);
  const std::string live = Get(d->http_port(), "/health/live");
  EXPECT_NE(live.find(" 503 "), std::string::npos) << live;
  EXPECT_NE(live.find(R"("status":"stalled")"), std::string::npos) << live;
  EXPECT_NE(live.find(R"("thread":"engine")"), std::string::npos) << live;
  EXPECT_NE(Get(d->http_port(), "/health").find(" 503 "), std::string::npos);
  // A new call is refused at once rather than queued behind the wedged thread (it would wait
  // out its deadline): UNAVAILABLE with a RetryInfo of the watch's period (0.75 s here), 503
  // with Retry-After over HTTP.
  ExpectRefused(c, d->http_port(), "engine stalled: the engine thread has not moved", 0.75);
  const std::string metrics = Get(d->metrics_port(), "/metrics");
  EXPECT_NE(metrics.find("imagegen_engine_unhealthy_total{reason=\"stalled\"} 1"),
            std::string::npos)
      << metrics;
  // From 0 for each model, before any failure (the alert on it needs the series to exist).
  EXPECT_NE(metrics.find("imagegen_cuda_graph_capture_failures_total{model=\"fmnist-gpt\"} 0"),
            std::string::npos)
      << metrics;
  const std::string gauge = "imagegen_engine_stalled_seconds{thread=\"engine\"} ";
  const size_t at = metrics.find(gauge);
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_GT(std::stod(metrics.substr(at + gauge.size())), 3.0);

  holder->Hold(false);  // it moves again
  EXPECT_TRUE(WaitUntil(
      [&] {
        return c.Health("") == HealthCheckResponse::SERVING &&
               c.Health(kService) == HealthCheckResponse::SERVING;
      },
      seconds(120)));
  call.join();
  EXPECT_TRUE(generated.ok()) << generated.error_message();
  EXPECT_EQ(image.tokens_size(), 196);
  // Idle again: healthy for good (polled: on a starved machine a step of the released request
  // can outlast the limit, and the watch takes up to its period to see the engine idle).
  EXPECT_TRUE(WaitUntil(
      [&] { return Get(d->http_port(), "/health/live").find(" 200 ") != std::string::npos; },
      seconds(120)));
  EXPECT_EQ(d->Stop(seconds(30)).completed, 1);
}

// A daemon with `o` whose engine fails its steps while `fail` is positive
// (EngineOptions::fail_steps); null, with the test failed, when it does not start.
std::unique_ptr<server::Daemon> StartFailing(const server::DaemonOptions& o,
                                             std::shared_ptr<std::atomic<int64_t>> fail) {
  auto listening = server::Daemon::Listen(o);
  if (!listening.ok()) {
    ADD_FAILURE() << listening.status().ToString();
    return nullptr;
  }
  std::unique_ptr<server::Daemon> d = std::move(listening).value();
  const Status loaded = d->Load([fail](const EngineOptions& eo, EngineListener* listener) {
    EngineOptions with = eo;
    with.fail_steps = fail;
    return Engine::Start(with, listener);
  });
  if (!loaded.ok()) {
    ADD_FAILURE() << loaded.ToString();
    return nullptr;
  }
  return d;
}

// --engine-failed-steps: an engine that moves but fails every step (a sticky device error, here
// injected: EngineOptions::fail_steps) turns health NOT_SERVING once that many steps failed in
// a row, and SERVING again after a step that does not fail.
TEST(ServerStartupTest, AnEngineWhoseStepsAllFailTurnsNotServingUntilOneSucceeds) {
  server::DaemonOptions o = Options();
  o.http_listen = "127.0.0.1:0";
  o.engine_failed_steps = 2;
  o.engine_probe_seconds = 0;  // a call's step turns it back (the next test: a probe's)
  auto fail = std::make_shared<std::atomic<int64_t>>(0);
  std::unique_ptr<server::Daemon> d = StartFailing(o, fail);
  ASSERT_NE(d, nullptr);
  Client c(d->port());
  fail->store(2);
  v1::GenerateResponse r;
  grpc::Status first = c.Generate("ar", &r);
  EXPECT_EQ(first.error_code(), grpc::StatusCode::INTERNAL) << first.error_message();
  EXPECT_NE(first.error_message().find("injected step failure"), std::string::npos)
      << first.error_message();
  // One failed step is not yet a failing engine.
  EXPECT_EQ(c.Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(c.Generate("ar", &r).error_code(), grpc::StatusCode::INTERNAL);
  ASSERT_TRUE(
      WaitUntil([&] { return c.Health("") == HealthCheckResponse::NOT_SERVING; }, seconds(120)));
  EXPECT_EQ(c.Health(kService), HealthCheckResponse::NOT_SERVING);
  const std::string live = Get(d->http_port(), "/health/live");
  EXPECT_NE(live.find(" 503 "), std::string::npos) << live;
  EXPECT_NE(live.find(R"("status":"failing")"), std::string::npos) << live;
  EXPECT_NE(live.find(R"("failed_steps":2)"), std::string::npos) << live;
  EXPECT_NE(live.find("injected step failure"), std::string::npos) << live;
  const std::string metrics = Get(d->metrics_port(), "/metrics");
  EXPECT_NE(metrics.find("imagegen_engine_unhealthy_total{reason=\"failing\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("imagegen_engine_failed_steps_in_a_row{model=\"fmnist-gpt\"} 2"),
            std::string::npos)
      << metrics;
  // The CPU's intra-op threads (--adaptive-cpu-threads), at start and now.
  EXPECT_NE(metrics.find("\nimagegen_engine_cpu_threads_max "), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\nimagegen_engine_cpu_threads "), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("imagegen_engine_cpu_thread_changes_total{direction=\"down\"} 0"),
            std::string::npos)
      << metrics;
  // Calls are still taken (without probes a call's step is the only way back); the next step
  // succeeds and the engine is healthy again.
  grpc::Status third = c.Generate("ar", &r);
  EXPECT_TRUE(third.ok()) << third.error_message();
  EXPECT_TRUE(
      WaitUntil([&] { return c.Health("") == HealthCheckResponse::SERVING; }, seconds(120)));
  EXPECT_EQ(c.Health(kService), HealthCheckResponse::SERVING);
  EXPECT_NE(Get(d->http_port(), "/health").find(" 200 "), std::string::npos);
  d->Stop(seconds(30));
}

// A failing engine that readiness took out of the endpoints gets no calls: it probes itself
// (--engine-probe-seconds), each probe one step of an AR request. A probe whose step fails
// counts as a failed step and leaves it NOT_SERVING; the first whose step succeeds turns it
// SERVING without any call. Probes are not calls: the request metrics do not count them.
TEST(ServerStartupTest, AFailingEngineWithoutCallsProbesItselfBackToServing) {
  server::DaemonOptions o = Options();
  o.engine_failed_steps = 2;
  o.engine_probe_seconds = 0.01;  // the watch's own period (1 s) paces them
  auto fail = std::make_shared<std::atomic<int64_t>>(0);
  std::unique_ptr<server::Daemon> d = StartFailing(o, fail);
  ASSERT_NE(d, nullptr);
  Client c(d->port());
  fail->store(3);  // the two calls' steps and the first probe's
  v1::GenerateResponse r;
  EXPECT_EQ(c.Generate("ar", &r).error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(c.Generate("ar", &r).error_code(), grpc::StatusCode::INTERNAL);
  ASSERT_TRUE(
      WaitUntil([&] { return c.Health("") == HealthCheckResponse::NOT_SERVING; }, seconds(120)));
  auto metrics = [&] { return Get(d->metrics_port(), "/metrics"); };
  auto has = [](const std::string& text, const std::string& line) {
    return text.find(line) != std::string::npos;
  };
  // The first probe's step fails: a third failed step in a row, and still NOT_SERVING.
  ASSERT_TRUE(WaitUntil(
      [&] {
        return has(metrics(),
                   "imagegen_engine_probes_total{model=\"fmnist-gpt\",outcome=\"failed\"} 1");
      },
      seconds(120)))
      << metrics();
  EXPECT_EQ(fail->load(), 0);
  // The next one's succeeds, with no call.
  ASSERT_TRUE(
      WaitUntil([&] { return c.Health("") == HealthCheckResponse::SERVING; }, seconds(120)));
  EXPECT_EQ(c.Health(kService), HealthCheckResponse::SERVING);
  const std::string after = metrics();
  EXPECT_TRUE(has(after, "imagegen_engine_probes_total{model=\"fmnist-gpt\",outcome=\"ok\"} 1"))
      << after;
  EXPECT_TRUE(has(after, "imagegen_engine_probes_total{model=\"fmnist-gpt\",outcome=\"failed\"} 1"))
      << after;
  EXPECT_TRUE(has(after, "imagegen_engine_failed_steps_in_a_row{model=\"fmnist-gpt\"} 0")) << after;
  EXPECT_TRUE(has(after, "imagegen_engine_unhealthy_total{reason=\"failing\"} 1")) << after;
  EXPECT_TRUE(has(
      after, "imagegen_requests_total{method=\"ar\",model=\"fmnist-gpt\",outcome=\"internal\"} 2"))
      << after;
  EXPECT_FALSE(has(after, "outcome=\"cancelled\"")) << after;
  d->Stop(seconds(30));
}

// While a model is failing and the probe is on, that model's new calls are refused with
// UNAVAILABLE and a RetryInfo of the probe's period (503 with Retry-After over HTTP), so that a
// client's retry takes them to another replica instead of to steps that fail; other models'
// calls are taken, and a refused call never reaches the engine.
TEST(ServerStartupTest, AFailingModelsCallsAreRefusedWhileOtherModelsAreServed) {
  server::DaemonOptions o = Options();
  o.http_listen = "127.0.0.1:0";
  o.engine_failed_steps = 2;
  o.engine_probe_seconds = 3600;  // on, but the first probe is an hour away
  o.engine.models = {"fmnist-gpt", "fmnist-t2i"};
  auto fail = std::make_shared<std::atomic<int64_t>>(0);
  std::unique_ptr<server::Daemon> d = StartFailing(o, fail);
  ASSERT_NE(d, nullptr);
  Client c(d->port());
  fail->store(2);
  v1::GenerateResponse r;
  EXPECT_EQ(c.Generate("ar", &r).error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(c.Generate("ar", &r).error_code(), grpc::StatusCode::INTERNAL);
  ASSERT_TRUE(
      WaitUntil([&] { return c.Health("") == HealthCheckResponse::NOT_SERVING; }, seconds(120)));
  ExpectRefused(c, d->http_port(),
                "engine failing: the last 2 steps of model fmnist-gpt failed (step failed: "
                "injected step failure",
                3600);
  // The other model's steps work: its calls are taken while fmnist-gpt's count stands.
  v1::GenerateResponse text;
  const grpc::Status served = c.GenerateFromText(&text);
  EXPECT_TRUE(served.ok()) << served.error_message();
  EXPECT_EQ(fail->load(), 0);
  EXPECT_EQ(c.Health(""), HealthCheckResponse::NOT_SERVING);
  const std::string metrics = Get(d->metrics_port(), "/metrics");
  EXPECT_NE(metrics.find("imagegen_requests_total{method=\"ar\",model=\"fmnist-gpt\",outcome="
                         "\"internal\"} 2"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("imagegen_requests_total{method=\"ar\",model=\"fmnist-t2i\",outcome="
                         "\"ok\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("imagegen_engine_failed_steps_in_a_row{model=\"fmnist-gpt\"} 2"),
            std::string::npos)
      << metrics;
  d->Stop(seconds(30));
}

// An engine that cannot start leaves the daemon alive but never ready; the error comes back.
TEST(ServerStartupTest, AFailedStartIsReturnedAndTheServiceStaysNotServing) {
  auto listening = server::Daemon::Listen(Options());
  ASSERT_TRUE(listening.ok()) << listening.status().ToString();
  std::unique_ptr<server::Daemon> d = std::move(listening).value();
  Status st =
      d->Load([](const EngineOptions&, EngineListener*) -> StatusOr<std::unique_ptr<Engine>> {
        return NotFound("model fmnist-gpt: no such directory");
      });
  EXPECT_EQ(st.code(), Code::kNotFound);
  Client c(d->port());
  EXPECT_EQ(c.Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(c.Health(kService), HealthCheckResponse::NOT_SERVING);
  v1::GenerateResponse resp;
  EXPECT_EQ(c.Generate("ar", &resp).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(d->Load([](const EngineOptions& eo, EngineListener* l) {
               return Engine::Start(eo, l);
             }).code(),
            Code::kOk)
      << "a failed Load can be retried";
  EXPECT_EQ(c.Health(kService), HealthCheckResponse::SERVING);
}

// Options that do not go together are refused before anything listens.
TEST(ServerStartupTest, BadOptionsAreRefused) {
  server::DaemonOptions o = Options();
  o.tls_cert = "/nonexistent/cert.pem";
  EXPECT_EQ(server::Daemon::Listen(o).status().code(), Code::kInvalidArgument);
  o.tls_key = "/nonexistent/key.pem";
  EXPECT_EQ(server::Daemon::Listen(o).status().code(), Code::kInvalidArgument);
  o = Options();
  o.tls_client_ca = "/nonexistent/ca.pem";
  EXPECT_EQ(server::Daemon::Listen(o).status().code(), Code::kInvalidArgument);
  o = Options();
  o.engine_stall_seconds = -1;
  Status bad = server::Daemon::Listen(o).status();
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("--engine-stall-seconds"), std::string::npos) << bad.ToString();
  o = Options();
  o.engine_failed_steps = -1;
  bad = server::Daemon::Listen(o).status();
  EXPECT_NE(bad.message().find("--engine-failed-steps"), std::string::npos) << bad.ToString();
  o = Options();
  o.engine_probe_seconds = -1;
  bad = server::Daemon::Listen(o).status();
  EXPECT_NE(bad.message().find("--engine-probe-seconds"), std::string::npos) << bad.ToString();
  o = Options();
  o.engine.fail_steps_for_seconds = -1;
  bad = server::Daemon::Listen(o).status();
  EXPECT_NE(bad.message().find("--inject-step-failures-seconds"), std::string::npos)
      << bad.ToString();
  o = Options();
  o.default_method = "no-such-method";
  auto d = server::Daemon::Listen(o);
  ASSERT_TRUE(d.ok());
  Status st = (*d)->Load(&Engine::Start);
  EXPECT_EQ(st.field(), "--default-method") << st.ToString();
}

// A second daemon on a port that one already serves is refused: it must not share the port
// (gRPC sets SO_REUSEPORT by default, and two daemons then split the connections).
TEST(ServerStartupTest, APortInUseIsRefused) {
  auto first = server::Daemon::Listen(Options());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  server::DaemonOptions o = Options();
  o.listen = "127.0.0.1:" + std::to_string((*first)->port());
  auto second = server::Daemon::Listen(o);
  EXPECT_EQ(second.status().code(), Code::kUnavailable) << second.status().ToString();
  EXPECT_NE(second.status().message().find(o.listen), std::string::npos)
      << second.status().ToString();
  o = Options();
  o.metrics_listen = "127.0.0.1:" + std::to_string((*first)->metrics_port());
  auto third = server::Daemon::Listen(o);
  EXPECT_EQ(third.status().code(), Code::kUnavailable) << third.status().ToString();
  EXPECT_NE(third.status().message().find("--metrics-listen"), std::string::npos)
      << third.status().ToString();
}

}  // namespace
}  // namespace imagegen::testing
