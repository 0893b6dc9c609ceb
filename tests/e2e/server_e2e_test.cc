// End-to-end tests: the real imagegen-server started on loopback, spoken to over gRPC with the
// generated stubs, the real CLI and the Python example client, and scraped by a real Prometheus
// server (Debian's) using the scrape config in deploy/.
#include <gtest/gtest.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "imagegen/v1/imagegen.grpc.pb.h"
#include "engine/util/read_file.h"
#include "tests/e2e/classify.h"
#include "tests/e2e/e2e_paths.h"
#include "tests/e2e/process.h"
#include "tests/http_client.h"
#include "tests/temp_dir.h"
#include "tests/build_paths.h"

namespace imagegen::testing {
namespace {

namespace v1 = imagegen::v1;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr char kService[] = "imagegen.v1.ImageGeneration";

// The daemon on loopback ports chosen by the kernel (reported through --port-file). It serves
// fmnist-gpt alone unless `flags` name --models or `default_models` keeps the daemon's own
// default (the bundled fmnist-gpt and fmnist-t2i).
class Daemon {
 public:
  // `env`: NAME=value entries that replace the inherited ones.
  explicit Daemon(const std::string& name, std::vector<std::string> flags = {},
                  bool default_models = false, std::vector<std::string> env = {})
      : dir_(TempDir(name)) {
    std::vector<std::string> argv = {
        ServerBinary(), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--port-file",
        dir_ + "/ports", "--models-dir", TestModelsDir(),
        // One step-cost calibration shared by the tests' daemons (and the engine tests).
        "--cache-dir", SharedStepCostCache()};
    if (!default_models) argv.insert(argv.end(), {"--models", "fmnist-gpt"});
    argv.insert(argv.end(), flags.begin(), flags.end());
    proc_ = std::make_unique<Process>(argv, dir_ + "/server.log", env);
    for (int i = 0; i < 600 && port_ == 0; ++i) {
      std::this_thread::sleep_for(milliseconds(50));
      std::istringstream in(Slurp(dir_ + "/ports"));
      in >> port_ >> metrics_port_ >> http_port_;
      if (proc_->Wait(milliseconds(0)) >= 0) break;
    }
    if (port_ == 0) throw std::runtime_error("daemon did not start: " + proc_->Log());
  }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  int metrics_port() const { return metrics_port_; }
  int http_port() const { return http_port_; }
  Process& proc() { return *proc_; }
  const std::string& dir() const { return dir_; }

  std::shared_ptr<grpc::Channel> Channel() const {
    return grpc::CreateChannel(target(), grpc::InsecureChannelCredentials());
  }
  std::unique_ptr<v1::ImageGeneration::Stub> Stub() const {
    return v1::ImageGeneration::NewStub(Channel());
  }
  // ListModels; a failed call throws (gtest reports it and ends the test).
  v1::ListModelsResponse Models() const {
    grpc::ClientContext ctx;
    v1::ListModelsResponse resp;
    const grpc::Status st = Stub()->ListModels(&ctx, v1::ListModelsRequest(), &resp);
    if (!st.ok()) throw std::runtime_error("ListModels: " + st.error_message());
    return resp;
  }
  HealthCheckResponse::ServingStatus Health(const std::string& service) const {
    auto stub = grpc::health::v1::Health::NewStub(Channel());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
    HealthCheckRequest req;
    req.set_service(service);
    HealthCheckResponse resp;
    grpc::Status st = stub->Check(&ctx, req, &resp);
    return st.ok() ? resp.status() : HealthCheckResponse::UNKNOWN;
  }
  // Until the models are loaded ("imagegen.v1.ImageGeneration" SERVING).
  // Up to 300 s: a loaded machine's start (a warm-up, a calibration) takes tens of seconds. A
  // daemon that exits meanwhile ends the wait at once (a fresh-machine run once waited the
  // whole 300 s for one that another process's signal had ended while it loaded).
  void WaitReady() const {
    for (int i = 0; i < 6000; ++i) {
      if (Health(kService) == HealthCheckResponse::SERVING) return;
      if (const int code = proc_->Wait(milliseconds(0)); code >= 0) {
        throw std::runtime_error("daemon exited (" + std::to_string(code) +
                                 ") before it became ready: " + proc_->Log());
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    throw std::runtime_error("daemon never became ready: " + proc_->Log());
  }
  std::string Metrics() const { return HttpGet(metrics_port_, "/metrics").second; }
  // The state accounting: polls until every Generate/GenerateStream call opened has been
  // closed (imagegen_calls_opened_total == imagegen_calls_closed_total), up to 120 s.
  bool CallsBalanced() const {
    for (int i = 0; i < 2400; ++i) {
      const std::string m = Metrics();
      if (MetricValue(m, "imagegen_calls_opened_total") ==
          MetricValue(m, "imagegen_calls_closed_total")) {
        return true;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
  }
  // Polls /metrics until `series` has `value` (true) or 120 s pass (false): generous, so that
  // a loaded machine does not fail the test.
  // Polls until `series` has `value`, up to 120 s; on failure says what it saw last.
  ::testing::AssertionResult WaitMetric(const std::string& series, double value) const {
    std::string last;
    for (int i = 0; i < 2400; ++i) {
      last = Metrics();
      if (MetricValue(last, series) == value) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(milliseconds(50));
    }
    std::string seen;
    const std::string name = series.substr(0, series.find('{'));
    std::istringstream in(last);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind(name, 0) == 0) seen += "\n  " + line;
    }
    return ::testing::AssertionFailure()
           << series << " never was " << value << "; last seen:"
           << (seen.empty() ? " nothing (scrape: " + std::to_string(last.size()) + " bytes)"
                            : seen);
  }

 private:
  std::string dir_;
  std::unique_ptr<Process> proc_;
  int port_ = 0, metrics_port_ = 0, http_port_ = 0;
};

v1::GenerateRequest Request(const std::string& cls, uint64_t seed, const std::string& method) {
  v1::GenerateRequest r;
  r.set_class_name(cls);
  r.set_seed(seed);
  r.set_method(method);
  return r;
}

const google::rpc::BadRequest* Violations(const grpc::Status& st, google::rpc::BadRequest* out) {
  google::rpc::Status s;
  if (!s.ParseFromString(st.error_details())) return nullptr;
  for (const auto& d : s.details()) {
    if (d.UnpackTo(out)) return out;
  }
  return nullptr;
}

std::string Slots(const std::string& model = "fmnist-gpt") {
  return "imagegen_kv_cache_slots_in_use{model=\"" + model + "\"}";
}

std::string Requests(const std::string& method, const std::string& outcome) {
  return "imagegen_requests_total{method=\"" + method + "\",model=\"fmnist-gpt\",outcome=\"" +
         outcome + "\"}";
}

TEST(E2eTest, UnaryAndStreamGiveThePngOfTheClassAndTheStreamReassemblesTheGrid) {
  // No preview budget: under a sanitizer on a loaded machine a preview can cost more than the
  // 5% share earns in a whole request, and this test counts previews (the budget has its own
  // test, EngineTest.PreviewsTakeNoMoreThanTheirShareOfTheEngine). Whole windows: a lone
  // scd-gm request would otherwise be planned on this machine's calibration, which on a loaded
  // machine may find one node a step fastest (once here: 196 forwards); its planned windows
  // are EngineTest.GoodputPlansALoneMatchRequestAndItStillDrawsTheArGmImage's, on a fixed cost.
  Daemon d("unary_stream", {"--preview-share", "0", "--window-policy", "full"});
  d.WaitReady();
  EXPECT_EQ(d.Health(""), HealthCheckResponse::SERVING);
  auto stub = d.Stub();
  // Classes the bundled classifier recognises best; the seeds are fixed, so are the images.
  const std::vector<std::pair<std::string, int>> classes = {
      {"trouser", 1}, {"sandal", 5}, {"bag", 8}};
  for (const auto& [name, id] : classes) {
    v1::GenerateRequest req = Request(name, 21, "scd-mc");
    req.mutable_output()->set_include_tokens(true);
    grpc::ClientContext uctx;
    v1::GenerateResponse unary;
    ASSERT_TRUE(stub->Generate(&uctx, req, &unary).ok());
    std::string err;
    EXPECT_EQ(ClassifyPng(unary.image_png(), &err), id) << name << " " << err;
    EXPECT_EQ(unary.tokens_size(), 196);
    EXPECT_EQ(unary.stats().seed(), 21u);
    EXPECT_EQ(unary.stats().class_id(), id);
    EXPECT_LT(unary.stats().nfe(), 196);  // it did speculate
    EXPECT_NEAR(unary.stats().step_compression(), 196.0 / unary.stats().nfe(), 1e-9);

    req.set_preview_every(5);
    req.set_stream_drafts(true);
    grpc::ClientContext sctx;
    auto reader = stub->GenerateStream(&sctx, req);
    v1::GenerateStreamResponse msg;
    std::vector<int> grid(196, -1);
    // A message may merge several steps when the client reads slower than the engine steps:
    // step numbers rise, positions arrive in order and once each.
    int committed = 0, last_step = 0, previews = 0;
    std::optional<v1::GenerateResponse> final;
    while (reader->Read(&msg)) {
      if (msg.has_step()) {
        const auto& s = msg.step();
        EXPECT_GT(s.step(), last_step);
        last_step = s.step();
        for (int i = 0; i < s.positions_size(); ++i) {
          ASSERT_EQ(s.positions(i), committed) << "positions arrive in order, once each";
          grid[static_cast<size_t>(committed++)] = s.tokens(i);
        }
        EXPECT_EQ(s.committed(), committed);
        if (s.draft_positions_size() > 0) {
          EXPECT_EQ(s.draft_positions(0), committed);
        }
        if (!s.preview_png().empty()) ++previews;  // due every 5 steps (merged steps may skip)
      } else {
        ASSERT_TRUE(msg.has_final());
        final = msg.final();
      }
    }
    ASSERT_TRUE(reader->Finish().ok());
    ASSERT_TRUE(final.has_value());
    EXPECT_EQ(committed, 196);
    EXPECT_EQ(std::vector<int>(final->tokens().begin(), final->tokens().end()), grid);
    // The same request and seed: the same image whichever RPC carried it.
    EXPECT_EQ(std::vector<int>(unary.tokens().begin(), unary.tokens().end()), grid);
    EXPECT_EQ(final->image_png(), unary.image_png());
    EXPECT_EQ(final->stats().nfe(), last_step);
    EXPECT_GT(previews, 0);
    EXPECT_LE(previews, last_step / 5);
  }
  // ListModels describes the bundled model.
  const v1::ListModelsResponse models = d.Models();
  ASSERT_EQ(models.models_size(), 1);
  EXPECT_EQ(models.models(0).name(), "fmnist-gpt");
  EXPECT_EQ(models.models(0).classes(7).name(), "sneaker");
  EXPECT_EQ(models.default_method(), "scd-mc");
  EXPECT_EQ(models.models(0).draft_model(), "fmnist-draft");
  // The match rule through the daemon: scd-gm (by preset, and as a policy of its parts at
  // another window) draws the very image ar-gm draws for the seed, in fewer forwards.
  std::vector<v1::GenerateResponse> same;
  for (int i = 0; i < 3; ++i) {
    v1::GenerateRequest req = Request("sneaker", 33, i == 0 ? "ar-gm" : "scd-gm");
    if (i == 2) {
      req.set_method("scd-gs");
      req.set_window(12);
      req.mutable_policy()->set_acceptance(v1::ACCEPTANCE_MATCH);
    }
    req.mutable_output()->set_include_tokens(true);
    grpc::ClientContext ctx;
    same.emplace_back();
    ASSERT_TRUE(stub->Generate(&ctx, req, &same.back()).ok()) << i;
  }
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(std::vector<int>(same[i].tokens().begin(), same[i].tokens().end()),
              std::vector<int>(same[0].tokens().begin(), same[0].tokens().end()))
        << i;
    EXPECT_EQ(same[i].image_png(), same[0].image_png()) << i;
    EXPECT_LT(same[i].stats().nfe(), 196) << i << ": mean window " << same[i].stats().mean_window();
  }
  EXPECT_EQ(same[0].stats().nfe(), 196);
}

// Health once ready; reflection lists and describes the services, as grpcurl and grpc_cli
// would ask. (The not-yet-ready state while the models load is shown in-process, with the
// loading held back, by tests/server_startup_test.cc.)
TEST(E2eTest, HealthAndReflectionListTheServices) {
  Daemon d("startup");
  EXPECT_EQ(d.Health(""), HealthCheckResponse::SERVING);  // alive as soon as the port is open
  d.WaitReady();
  EXPECT_EQ(d.Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(d.Health(kService), HealthCheckResponse::SERVING);
  EXPECT_EQ(d.Health("no.such.Service"), HealthCheckResponse::UNKNOWN);  // NOT_FOUND

  namespace refl = grpc::reflection::v1alpha;
  auto rstub = refl::ServerReflection::NewStub(d.Channel());
  grpc::ClientContext ctx;
  auto stream = rstub->ServerReflectionInfo(&ctx);
  refl::ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  refl::ServerReflectionRequest describe;
  describe.set_file_containing_symbol(kService);
  ASSERT_TRUE(stream->Write(describe));
  stream->WritesDone();
  std::set<std::string> services;
  size_t descriptor_bytes = 0;
  refl::ServerReflectionResponse r;
  while (stream->Read(&r)) {
    for (const auto& sv : r.list_services_response().service()) services.insert(sv.name());
    for (const auto& f : r.file_descriptor_response().file_descriptor_proto())
      descriptor_bytes += f.size();
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(services.count(kService), 1u);
  EXPECT_EQ(services.count("grpc.health.v1.Health"), 1u);
  EXPECT_GT(descriptor_bytes, 1000u);
}

TEST(E2eTest, CancelMidStreamAndDeadlinesFreeTheSlot) {
  Daemon d("cancel");
  d.WaitReady();
  auto stub = d.Stub();
  grpc::ClientContext ctx;
  auto reader = stub->GenerateStream(&ctx, Request("coat", 3, "ar"));
  v1::GenerateStreamResponse msg;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&msg));
  EXPECT_EQ(MetricValue(d.Metrics(), Slots()), 2);  // one request with guidance: two slots
  ctx.TryCancel();
  while (reader->Read(&msg)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(d.WaitMetric(Requests("ar", "cancelled"), 1));
  EXPECT_TRUE(d.WaitMetric(Slots(), 0));

  // The deadline must pass mid-generation. One AR image alone can take under 300 ms on a fast
  // CPU (it did once, on a 2-core VM), so 16 other AR requests share its steps: each step then
  // feeds 34 rows, and its 196 steps take well over the deadline on any CPU.
  constexpr int kLoad = 16;
  std::vector<std::thread> load;
  std::atomic<int> loaded{0};
  for (int k = 0; k < kLoad; ++k) {
    load.emplace_back([&stub, &loaded, k] {
      grpc::ClientContext c;
      v1::GenerateResponse r;
      EXPECT_TRUE(stub->Generate(&c, Request("bag", 40 + static_cast<uint64_t>(k), "ar"), &r).ok());
      ++loaded;
    });
  }
  // Until they all run (polled; on a very fast machine they may be done first).
  const std::string active = "imagegen_active_requests{model=\"fmnist-gpt\"}";
  for (int i = 0; i < 2400 && !(MetricValue(d.Metrics(), active) >= kLoad) && loaded < kLoad; ++i) {
    std::this_thread::sleep_for(milliseconds(50));
  }
  grpc::ClientContext dctx;
  dctx.set_deadline(std::chrono::system_clock::now() + milliseconds(300));
  v1::GenerateResponse resp;
  EXPECT_EQ(stub->Generate(&dctx, Request("coat", 4, "ar"), &resp).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  for (auto& t : load) t.join();
  EXPECT_TRUE(d.WaitMetric(Requests("ar", "deadline_exceeded"), 1));
  EXPECT_TRUE(d.WaitMetric(Slots(), 0));
  EXPECT_TRUE(d.WaitMetric(active, 0));
  EXPECT_TRUE(d.CallsBalanced());
}

// One request running (2 slots, all there are) and room for one in the queue: of seven more sent
// at once, at least one finds the queue full and gets RESOURCE_EXHAUSTED with a RetryInfo, and
// the metric counts exactly the ones the clients saw. (It used to wait for the queue depth to be
// 1 and then send one request; on a loaded machine the running request could finish first, and
// the test waited in vain: every outcome the timing allows is accepted now.)
TEST(E2eTest, FullQueueIsResourceExhaustedWithRetryInfo) {
  Daemon d("queue", {"--max-slots", "2", "--max-queue", "1"});
  d.WaitReady();
  auto stub = d.Stub();
  grpc::ClientContext a;
  auto ra = stub->GenerateStream(&a, Request("coat", 5, "ar"));
  v1::GenerateStreamResponse msg;
  ASSERT_TRUE(ra->Read(&msg));  // running: holds both slots for ~195 more steps
  constexpr int kMore = 7;
  std::vector<grpc::Status> st(kMore);
  std::vector<std::thread> threads;
  for (int i = 0; i < kMore; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext c;
      v1::GenerateResponse resp;
      st[i] = stub->Generate(&c, Request("coat", 10 + i, "ar"), &resp);
    });
  }
  for (auto& t : threads) t.join();
  int exhausted = 0;
  for (const grpc::Status& s : st) {
    if (s.ok()) continue;  // queued, then ran
    ASSERT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    ++exhausted;
    google::rpc::Status details;
    ASSERT_TRUE(details.ParseFromString(s.error_details()));
    google::rpc::RetryInfo retry;
    ASSERT_EQ(details.details_size(), 1);
    ASSERT_TRUE(details.details(0).UnpackTo(&retry));
    EXPECT_GT(retry.retry_delay().seconds() * 1e9 + retry.retry_delay().nanos(), 0);
  }
  EXPECT_GE(exhausted, 1);
  a.TryCancel();  // it may have finished already: the queued request waited for it
  while (ra->Read(&msg)) {
  }
  ra->Finish();
  EXPECT_TRUE(d.WaitMetric(Slots(), 0));
  EXPECT_TRUE(d.CallsBalanced());
  // Every call counted once: the rejected ones as such, the others ok, and the first one ok or
  // cancelled (whichever came first: its last step or the cancel).
  const std::string m = d.Metrics();
  auto count = [&](const std::string& outcome) {
    const double v = MetricValue(m, Requests("ar", outcome));
    return std::isnan(v) ? 0.0 : v;
  };
  EXPECT_EQ(count("resource_exhausted"), exhausted);
  EXPECT_EQ(count("ok") + count("cancelled"), kMore - exhausted + 1);
  EXPECT_GE(count("ok"), kMore - exhausted);
}

// A request of priority -1 that finds both KV slots held by a stream of priority 5 takes them
// (--preemption, the default): the stream waits, recomputes its entries and completes, and as
// an ar request it draws the same image as it does alone. Its statistics and the metric count
// the preemption (both 0 if the stream ended before the urgent request came: a loaded machine
// may be that slow; the image must match either way).
TEST(E2eTest, AnUrgentRequestPreemptsALessUrgentStreamThatThenCompletes) {
  Daemon d("preempt", {"--max-slots", "2"});
  d.WaitReady();
  auto stub = d.Stub();
  v1::GenerateRequest low = Request("coat", 5, "ar");
  low.set_priority(5);
  grpc::ClientContext a;
  auto ra = stub->GenerateStream(&a, low);
  v1::GenerateStreamResponse msg;
  ASSERT_TRUE(ra->Read(&msg));  // running: holds both slots for ~195 more steps
  v1::GenerateRequest urgent = Request("bag", 6, "ar");
  urgent.set_priority(-1);
  grpc::ClientContext b;
  v1::GenerateResponse ur;
  ASSERT_TRUE(stub->Generate(&b, urgent, &ur).ok());
  EXPECT_EQ(ur.stats().preemptions(), 0);
  std::optional<v1::GenerateResponse> final;
  while (ra->Read(&msg)) {
    if (msg.has_final()) final = msg.final();
  }
  ASSERT_TRUE(ra->Finish().ok());
  ASSERT_TRUE(final.has_value());
  const int64_t preempted = final->stats().preemptions();
  std::printf("the stream was preempted %lld time(s); prefill forwards %lld\n",
              static_cast<long long>(preempted),
              static_cast<long long>(final->stats().prefill_forwards()));
  EXPECT_LE(preempted, 1);
  if (preempted == 1) {
    EXPECT_GE(final->stats().prefill_forwards(), 1);  // it recomputed its entries
  }
  EXPECT_EQ(MetricValue(d.Metrics(), "imagegen_preemptions_total"), static_cast<double>(preempted));
  low.set_priority(0);
  low.mutable_output()->set_include_tokens(true);
  grpc::ClientContext c;
  v1::GenerateResponse alone;
  ASSERT_TRUE(stub->Generate(&c, low, &alone).ok());
  EXPECT_EQ(std::vector<int>(alone.tokens().begin(), alone.tokens().end()),
            std::vector<int>(final->tokens().begin(), final->tokens().end()));
  EXPECT_TRUE(d.WaitMetric(Slots(), 0));
  EXPECT_TRUE(d.CallsBalanced());
}

TEST(E2eTest, EachInvalidFieldIsNamedInBadRequest) {
  Daemon d("invalid");
  d.WaitReady();
  auto stub = d.Stub();
  struct Case {
    std::string want;
    std::function<void(v1::GenerateRequest&)> edit;
  };
  const std::vector<Case> cases = {
      {"class_id", [](v1::GenerateRequest& r) { r.clear_class_name(); }},
      {"class_name", [](v1::GenerateRequest& r) { r.set_class_name("unicorn"); }},
      // Echoed values are truncated: a long one stays INVALID_ARGUMENT (it used to overflow
      // the trailers and come back as RESOURCE_EXHAUSTED, the "queue full" code).
      {"class_name", [](v1::GenerateRequest& r) { r.set_class_name(std::string(3000, 'x')); }},
      {"method", [](v1::GenerateRequest& r) { r.set_method(std::string(3000, 'm')); }},
      {"class_id", [](v1::GenerateRequest& r) { r.set_class_id(10); }},
      {"class_id", [](v1::GenerateRequest& r) { r.set_class_id(-1); }},
      {"cfg_scale", [](v1::GenerateRequest& r) { r.set_cfg_scale(std::nan("")); }},
      {"cfg_scale", [](v1::GenerateRequest& r) { r.set_cfg_scale(1000); }},
      {"temperature", [](v1::GenerateRequest& r) { r.set_temperature(-1); }},
      {"top_k", [](v1::GenerateRequest& r) { r.set_top_k(-1); }},
      {"top_k", [](v1::GenerateRequest& r) { r.set_top_k(513); }},
      {"top_p", [](v1::GenerateRequest& r) { r.set_top_p(0); }},
      {"top_p", [](v1::GenerateRequest& r) { r.set_top_p(1.5); }},
      {"method", [](v1::GenerateRequest& r) { r.set_method("jacobi-magic"); }},
      {"window", [](v1::GenerateRequest& r) { r.set_window(0); }},
      {"window", [](v1::GenerateRequest& r) { r.set_window(197); }},
      {"window",
       [](v1::GenerateRequest& r) {
         r.set_method("sjd-pac");
         r.set_window(8);
       }},
      {"policy.tree_depth",
       [](v1::GenerateRequest& r) {
         r.set_method("sjd-pac");
         r.mutable_policy()->set_tree_depth(9);
       }},
      {"policy.tree_branches",
       [](v1::GenerateRequest& r) {
         r.set_method("sjd");
         r.mutable_policy()->set_tree_branches(40);
       }},
      {"policy.cool_delta",
       [](v1::GenerateRequest& r) {
         r.set_method("cool-sd");
         r.mutable_policy()->set_cool_delta(-1);
       }},
      {"policy.gsd_group",
       [](v1::GenerateRequest& r) {
         r.set_method("gsd");
         r.mutable_policy()->set_gsd_group(0);
       }},
      {"policy.draft",
       [](v1::GenerateRequest& r) {
         r.mutable_policy()->set_draft(static_cast<v1::DraftSource>(42));
       }},
      {"policy.coupling",
       [](v1::GenerateRequest& r) {
         r.set_method("sd");
         r.mutable_policy()->set_coupling(v1::COUPLING_GUMBEL);
       }},
      {"policy.coupling",  // the match rule keeps Gumbel-max drafts only
       [](v1::GenerateRequest& r) {
         r.set_method("scd-gm");
         r.mutable_policy()->set_coupling(v1::COUPLING_MAXIMAL);
       }},
      {"preview_every", [](v1::GenerateRequest& r) { r.set_preview_every(-3); }},
      {"output.scale", [](v1::GenerateRequest& r) { r.mutable_output()->set_scale(99); }},
      {"user", [](v1::GenerateRequest& r) { r.set_user(std::string(257, 'u')); }},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest req = Request("dress", 1, "scd-mc");
    c.edit(req);
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    grpc::Status st = stub->Generate(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.want;
    google::rpc::BadRequest br;
    ASSERT_NE(Violations(st, &br), nullptr) << c.want << ": " << st.error_message();
    ASSERT_EQ(br.field_violations_size(), 1);
    EXPECT_EQ(br.field_violations(0).field(), c.want) << st.error_message();
    EXPECT_FALSE(br.field_violations(0).description().empty());
    EXPECT_LT(st.error_message().size(), 600u) << c.want;
  }
  for (const std::string& model : {std::string("no-such-model"), std::string(3000, 'q')}) {
    v1::GenerateRequest req = Request("dress", 1, "scd-mc");
    req.set_model(model);
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    const grpc::Status st = stub->Generate(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
    EXPECT_LT(st.error_message().size(), 600u);
  }
  const std::string m = d.Metrics();
  EXPECT_GE(MetricValue(m, Requests("scd-mc", "invalid_argument")), 5);
  // Labels stay bounded whatever the client sends.
  EXPECT_EQ(m.find("jacobi-magic"), std::string::npos);
  EXPECT_EQ(m.find("no-such-model"), std::string::npos);
  EXPECT_TRUE(d.CallsBalanced());
}

// A body that is not a GenerateRequest, or one over the size limit, is INVALID_ARGUMENT naming
// "request", and is counted (it used to be INTERNAL with an empty message, uncounted).
TEST(E2eTest, UnparseableAndOversizedBodiesAreInvalidArgumentAndCounted) {
  Daemon d("bodies");
  d.WaitReady();
  grpc::GenericStub generic(d.Channel());
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
  grpc::Slice slice(std::string("\xff\xff\xff\xff"));
  grpc::ByteBuffer req(&slice, 1), resp;
  auto call = generic.PrepareUnaryCall(&ctx, "/imagegen.v1.ImageGeneration/Generate", req, &cq);
  call->StartCall();
  grpc::Status st;
  call->Finish(&resp, &st, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  google::rpc::BadRequest br;
  ASSERT_NE(Violations(st, &br), nullptr) << st.error_message();
  EXPECT_EQ(br.field_violations(0).field(), "request");
  cq.Shutdown();

  auto stub = d.Stub();
  v1::GenerateRequest big = Request("dress", 1, "ar");
  big.set_class_name(std::string(100000, 'x'));  // a 100 kB body; the limit is 64 KiB
  grpc::ClientContext ctx2;
  v1::GenerateResponse r;
  const grpc::Status st2 = stub->Generate(&ctx2, big, &r);
  EXPECT_EQ(st2.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st2.error_message();
  ASSERT_NE(Violations(st2, &br), nullptr) << st2.error_message();
  EXPECT_EQ(br.field_violations(0).field(), "request");
  EXPECT_LT(st2.error_message().size(), 200u);
  // Neither body was read, so their method is "unknown".
  EXPECT_TRUE(d.WaitMetric(Requests("unknown", "invalid_argument"), 2)) << d.Metrics();
  EXPECT_TRUE(d.CallsBalanced());
}

// A stream whose client stops reading (its HTTP/2 window is 1 KiB, and it never reads) is
// ended after --stream-stall-seconds: ABORTED, its engine request cancelled and its slots
// freed, while the other calls complete. Every call opened is closed.
TEST(E2eTest, AStreamWhoseClientStopsReadingIsEndedAndOthersGoOn) {
  Daemon d("stall", {"--stream-stall-seconds", "2"});
  d.WaitReady();
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto slow_channel =
      grpc::CreateCustomChannel(d.target(), grpc::InsecureChannelCredentials(), args);
  auto slow_stub = v1::ImageGeneration::NewStub(slow_channel);
  grpc::ClientContext slow_ctx;
  v1::GenerateRequest slow = Request("bag", 3, "ar");  // 196 steps, a preview in every one
  slow.set_preview_every(1);
  slow.mutable_output()->set_scale(16);
  auto reader = slow_stub->GenerateStream(&slow_ctx, slow);  // read only at the end
  // A stream whose client reads every step and stops at its last message, the image (at scale
  // 16, more than the 1 KiB window): it was counted OK when that write began
  // (StartWriteAndFinish), then cancelled as stalled; now it ends ABORTED, counted "aborted" as
  // the other stall.
  grpc::ClientContext last_ctx;
  v1::GenerateRequest last = Request("bag", 4, "sjd");
  last.mutable_output()->set_scale(16);
  auto last_reader = slow_stub->GenerateStream(&last_ctx, last);
  v1::GenerateStreamResponse step;
  bool last_final_seen = false;
  while (last_reader->Read(&step)) {
    last_final_seen |= step.has_final();
    if (step.has_final() || step.step().committed() == step.step().total()) break;
  }
  EXPECT_FALSE(last_final_seen);

  auto stub = d.Stub();
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    const grpc::Status st = stub->Generate(&ctx, Request("sneaker", 10 + i, "scd-mc"), &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  EXPECT_TRUE(d.WaitMetric("imagegen_stream_stalls_total", 2));
  EXPECT_TRUE(d.WaitMetric(Requests("ar", "aborted"), 1));
  EXPECT_TRUE(d.WaitMetric(Requests("sjd", "aborted"), 1));
  EXPECT_TRUE(d.WaitMetric(Slots(), 0));
  EXPECT_FALSE(MetricValue(d.Metrics(), Requests("sjd", "ok")) >= 1) << d.Metrics();
  v1::GenerateStreamResponse m;
  bool final_seen = false;
  while (reader->Read(&m)) final_seen |= m.has_final();
  EXPECT_FALSE(final_seen);
  EXPECT_FALSE(reader->Finish().ok());
  while (last_reader->Read(&m)) {
  }
  EXPECT_FALSE(last_reader->Finish().ok());  // the cancellation reaches the client first
  EXPECT_TRUE(d.CallsBalanced());
  EXPECT_EQ(MetricValue(d.Metrics(), "imagegen_calls_opened_total"), 5);
}

// A CA, a server certificate for 127.0.0.1 and a client certificate (tests/make_test_pki.sh), in
// the directory `name` (under the test's temporary directory).
std::string MakeCertificates(const std::string& name = "pki") {
  const std::string d = TempDir(name);
  std::string out;
  if (RunCommand(
          {std::string(testing::SourceDir()) + "/tests/make_test_pki.sh", d, "server", "client"},
          &out, d + "/openssl.log") != 0) {
    throw std::runtime_error("openssl failed: " + Slurp(d + "/openssl.log"));
  }
  return d;
}

grpc::StatusCode CallWith(const std::shared_ptr<grpc::Channel>& ch, const std::string& token) {
  auto stub = v1::ImageGeneration::NewStub(ch);
  grpc::ClientContext ctx;
  // Generous: under the sanitizers on a loaded 2-core machine one image has taken over 30 s
  // (DEADLINE_EXCEEDED in an ASan run beside other builds). The rejections come back at once.
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(180));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  v1::GenerateResponse resp;
  return stub->Generate(&ctx, Request("sneaker", 9, "sjd"), &resp).error_code();
}

TEST(E2eTest, TlsAndBearerTokenAcceptTheRightTokenOnly) {
  const std::string pki = MakeCertificates();
  { std::ofstream(pki + "/token") << "s3cret-token-0123456789\n"; }
  Daemon d("tls", {"--tls-cert", pki + "/server.pem", "--tls-key", pki + "/server.key",
                   "--token-file", pki + "/token", "--http-listen", "127.0.0.1:0"});
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = Slurp(pki + "/ca.pem");
  auto tls = grpc::CreateChannel(d.target(), grpc::SslCredentials(o));
  // Health stays open (probes send no token). Up to 300 s for the models to load (a loaded
  // 2-core machine took over 10 s).
  auto health = grpc::health::v1::Health::NewStub(tls);
  HealthCheckResponse hr;
  for (int i = 0; i < 6000 && hr.status() != HealthCheckResponse::SERVING; ++i) {
    grpc::ClientContext ctx;
    HealthCheckRequest hq;
    hq.set_service(kService);
    health->Check(&ctx, hq, &hr);
    if (hr.status() != HealthCheckResponse::SERVING) std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_EQ(hr.status(), HealthCheckResponse::SERVING);
  EXPECT_EQ(CallWith(tls, "s3cret-token-0123456789"), grpc::StatusCode::OK);
  EXPECT_EQ(CallWith(tls, "s3cret-token-0123456788"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(CallWith(tls, "s3cret"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(CallWith(tls, ""), grpc::StatusCode::UNAUTHENTICATED);
  // Plaintext to a TLS port never reaches the service.
  auto plain = grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials());
  EXPECT_NE(CallWith(plain, "s3cret-token-0123456789"), grpc::StatusCode::OK);
  EXPECT_TRUE(d.WaitMetric(
      "imagegen_requests_total{method=\"sjd\",model=\"fmnist-gpt\",outcome=\"unauthenticated\"}",
      3));
  // The HTTP API speaks HTTPS with the same certificate (it was plaintext whatever the TLS
  // flags, the bearer tokens with it): curl checks the server against the CA.
  ASSERT_NE(d.http_port(), 0);
  const std::string https = "https://127.0.0.1:" + std::to_string(d.http_port());
  auto curl = [&](std::vector<std::string> args, const std::string& log) {
    std::vector<std::string> argv = {"/usr/bin/curl", "-sS", "--noproxy", "*",  "--cacert",
                                     pki + "/ca.pem", "-o",  "/dev/null", "-w", "%{http_code}"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::string out;
    RunCommand(argv, &out, pki + "/" + log);
    return out;
  };
  EXPECT_EQ(curl({https + "/health/ready"}, "curl1.log"), "200");
  const std::string image = R"({"prompt": "sneaker", "seed": 3})";
  EXPECT_EQ(curl({"-H", "Authorization: Bearer s3cret-token-0123456789", "-d", image,
                  https + "/v1/images/generations"},
                 "curl2.log"),
            "200");
  EXPECT_EQ(curl({"-d", image, https + "/v1/images/generations"}, "curl3.log"), "401");
  // Plaintext HTTP to it gets no HTTP answer.
  const std::string plain_http =
      Fetch(d.http_port(), "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(plain_http.find("HTTP/1.1"), std::string::npos) << plain_http;
  // Not a PEM: refused at start, naming the flag (gRPC said only "cannot listen on").
  { std::ofstream(pki + "/garbage.pem") << "not a pem\n"; }
  std::string out;
  EXPECT_EQ(RunCommand({ServerBinary(), "--listen", "127.0.0.1:0", "--models-dir", TestModelsDir(),
                        "--tls-cert", pki + "/garbage.pem", "--tls-key", pki + "/server.key"},
                       &out, pki + "/garbage.log"),
            2);
  EXPECT_NE(out.find("--tls-cert: holds no PEM CERTIFICATE"), std::string::npos) << out;
  // The HTTP API cannot check client certificates: with mTLS it is refused at start.
  EXPECT_EQ(RunCommand({ServerBinary(), "--listen", "127.0.0.1:0", "--models-dir", TestModelsDir(),
                        "--tls-cert", pki + "/server.pem", "--tls-key", pki + "/server.key",
                        "--tls-client-ca", pki + "/ca.pem", "--http-listen", "127.0.0.1:0"},
                       &out, pki + "/mtls-http.log"),
            2);
  EXPECT_NE(out.find("--http-listen: the HTTP API cannot require client certificates"),
            std::string::npos)
      << out;

  // Mutual TLS: the client must present a certificate the CA signed.
  Daemon m("mtls", {"--tls-cert", pki + "/server.pem", "--tls-key", pki + "/server.key",
                    "--tls-client-ca", pki + "/ca.pem"});
  auto no_cert = grpc::CreateChannel(m.target(), grpc::SslCredentials(o));
  grpc::SslCredentialsOptions oc = o;
  oc.pem_cert_chain = Slurp(pki + "/client.pem");
  oc.pem_private_key = Slurp(pki + "/client.key");
  auto with_cert = grpc::CreateChannel(m.target(), grpc::SslCredentials(oc));
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  for (int i = 0; i < 6000; ++i) {  // until the models are loaded (up to 300 s)
    code = CallWith(with_cert, "");
    if (code != grpc::StatusCode::UNAVAILABLE) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  EXPECT_EQ(code, grpc::StatusCode::OK);
  EXPECT_EQ(CallWith(no_cert, ""), grpc::StatusCode::UNAVAILABLE);
}

// Certificate rotation (server/tls.h): a renewed certificate written over the files is served
// on the gRPC port and the HTTP API's from the next handshake on, without a restart; a broken
// one (not a certificate, or the key of another) is refused, logged and counted, and both ports
// keep the last good one; with --tls-poll-seconds 0 a SIGHUP has them read.
TEST(E2eTest, TlsCertificatesRotateOnBothPortsAndABrokenPairIsRefused) {
  const std::string a = MakeCertificates("pki_a"), b = MakeCertificates("pki_b");
  const std::string live = TempDir("pki_live");
  // As a mounted Secret changes: each file replaced by a rename (the key first, so that for a
  // moment the pair does not match).
  auto install = [&](const std::string& cert, const std::string& key) {
    for (const auto& [from, to] : {std::pair{key, std::string("key.pem")}, {cert, "cert.pem"}}) {
      { std::ofstream(live + "/new") << Slurp(from); }
      std::filesystem::rename(live + "/new", live + "/" + to);
    }
  };
  install(a + "/server.pem", a + "/server.key");
  Daemon d("tls_rotation", {"--tls-cert", live + "/cert.pem", "--tls-key", live + "/key.pem",
                            "--tls-poll-seconds", "1", "--http-listen", "127.0.0.1:0"});
  // A new connection (a new handshake) that trusts only `ca`, on each port; `service` SERVING
  // (the process's "" answers while the models load).
  auto grpc_ok = [&](const std::string& ca, const std::string& service = "") {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = Slurp(ca + "/ca.pem");
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // no connection shared across channels
    auto ch = grpc::CreateCustomChannel(d.target(), grpc::SslCredentials(o), args);
    auto health = grpc::health::v1::Health::NewStub(ch);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(20));
    HealthCheckRequest hq;
    hq.set_service(service);
    HealthCheckResponse hr;
    return health->Check(&ctx, hq, &hr).ok() && hr.status() == HealthCheckResponse::SERVING;
  };
  auto https_ok = [&](const std::string& ca) {
    std::string out;
    RunCommand({"/usr/bin/curl", "-sS", "--noproxy", "*", "--cacert", ca + "/ca.pem", "-o",
                "/dev/null", "-w", "%{http_code}",
                "https://127.0.0.1:" + std::to_string(d.http_port()) + "/health/live"},
               &out, live + "/curl.log");
    return out == "200";
  };
  // Until both ports serve the certificate `ca` signed (up to 120 s; the poll is 1 s).
  auto both_serve = [&](const std::string& ca) {
    for (int i = 0; i < 240; ++i) {
      if (grpc_ok(ca) && https_ok(ca)) return true;
      std::this_thread::sleep_for(milliseconds(500));
    }
    return false;
  };
  auto not_after = [](const std::string& cert) {
    std::string out;
    RunCommand({"/bin/bash", "-c",
                "date -d \"$(openssl x509 -enddate -noout -in '" + cert + "' | cut -d= -f2)\" +%s"},
               &out, cert + ".end.log");
    return std::stod(out);
  };
  const std::string expiry = "imagegen_tls_certificate_expiration_timestamp_seconds";
  ASSERT_TRUE(both_serve(a)) << d.proc().Log();
  EXPECT_FALSE(grpc_ok(b));
  EXPECT_FALSE(https_ok(b));
  EXPECT_EQ(MetricValue(d.Metrics(), expiry), not_after(a + "/server.pem"));

  install(b + "/server.pem", b + "/server.key");
  ASSERT_TRUE(both_serve(b)) << d.proc().Log();
  EXPECT_FALSE(grpc_ok(a));
  EXPECT_FALSE(https_ok(a));
  EXPECT_TRUE(d.WaitMetric(expiry, not_after(b + "/server.pem")));
  EXPECT_GE(MetricValue(d.Metrics(), "imagegen_tls_certificate_reloads_total{outcome=\"ok\"}"), 1);
  EXPECT_NE(d.proc().Log().find("TLS certificate read again: CN=server, valid until "),
            std::string::npos)
      << d.proc().Log();
  // The Python client over TLS (--tls-ca) draws an image once the models are loaded.
  bool ready = false;
  for (int i = 0; i < 600 && !ready; ++i) {
    ready = grpc_ok(b, kService);
    if (!ready) std::this_thread::sleep_for(milliseconds(200));
  }
  ASSERT_TRUE(ready) << d.proc().Log();
  auto python = [&](const std::string& target, std::vector<std::string> flags,
                    const std::string& log) {
    std::vector<std::string> argv = {"/usr/bin/python3",
                                     std::string(SourceDir()) + "/client/python/example_client.py",
                                     "--target",
                                     target,
                                     "--class-name",
                                     "trouser",
                                     "--seed",
                                     "21",
                                     "--out",
                                     live + "/" + log + ".png"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    std::string out;
    const int code = RunCommand(argv, &out, live + "/" + log + ".log",
                                {"PYTHONPATH=" + std::string(PythonStubs())});
    return std::pair{code, out};
  };
  auto [py_code, py_out] = python(d.target(), {"--tls-ca", b + "/ca.pem"}, "py_tls");
  ASSERT_EQ(py_code, 0) << py_out;
  std::string err;
  EXPECT_EQ(ClassifyPng(Slurp(live + "/py_tls.png"), &err), 1) << err;
  EXPECT_NE(python(d.target(), {"--tls-ca", a + "/ca.pem"}, "py_old_ca").first, 0);

  // Broken pairs: refused (counted each poll), and B is still served on both ports.
  const std::string errors = "imagegen_tls_certificate_reloads_total{outcome=\"error\"}";
  auto refused = [&](const std::string& why) {
    const double before = MetricValue(d.Metrics(), errors);
    for (int i = 0; i < 2400; ++i) {
      if (MetricValue(d.Metrics(), errors) > before &&
          d.proc().Log().find(why) != std::string::npos) {
        return true;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
  };
  { std::ofstream(live + "/new") << "not a certificate\n"; }
  std::filesystem::rename(live + "/new", live + "/cert.pem");
  ASSERT_TRUE(refused("the certificate served stays: --tls-cert: holds no PEM CERTIFICATE"))
      << d.proc().Log();
  EXPECT_TRUE(grpc_ok(b));
  EXPECT_TRUE(https_ok(b));
  { std::ofstream(live + "/new") << Slurp(a + "/server.pem"); }  // A's certificate, B's key
  std::filesystem::rename(live + "/new", live + "/cert.pem");
  ASSERT_TRUE(refused("--tls-key: not the private key of --tls-cert's first certificate"))
      << d.proc().Log();
  EXPECT_TRUE(grpc_ok(b));
  EXPECT_TRUE(https_ok(b));
  EXPECT_FALSE(grpc_ok(a));
  // A's key too: the pair is good again, and served.
  install(a + "/server.pem", a + "/server.key");
  ASSERT_TRUE(both_serve(a)) << d.proc().Log();
  d.proc().Signal(SIGTERM);
  ASSERT_EQ(d.proc().Wait(seconds(60)), 0) << d.proc().Log();

  // Only on SIGHUP (and over mutual TLS: the client CA is served from the same files).
  install(a + "/server.pem", a + "/server.key");
  { std::ofstream(live + "/ca.pem") << Slurp(a + "/ca.pem"); }
  Daemon h("tls_sighup", {"--tls-cert", live + "/cert.pem", "--tls-key", live + "/key.pem",
                          "--tls-client-ca", live + "/ca.pem", "--tls-poll-seconds", "0"});
  auto mtls_ok = [&](const std::string& ca, const std::string& client) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = Slurp(ca + "/ca.pem");
    o.pem_cert_chain = Slurp(client + "/client.pem");
    o.pem_private_key = Slurp(client + "/client.key");
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto health = grpc::health::v1::Health::NewStub(
        grpc::CreateCustomChannel(h.target(), grpc::SslCredentials(o), args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(20));
    HealthCheckRequest hq;
    HealthCheckResponse hr;
    return health->Check(&ctx, hq, &hr).ok();
  };
  EXPECT_TRUE(mtls_ok(a, a));
  EXPECT_FALSE(mtls_ok(a, b));  // a client certificate the CA did not sign
  install(b + "/server.pem", b + "/server.key");
  { std::ofstream(live + "/ca.pem") << Slurp(b + "/ca.pem"); }
  h.proc().Signal(SIGHUP);
  bool rotated = false;
  for (int i = 0; i < 240 && !rotated; ++i) {
    rotated = mtls_ok(b, b);
    if (!rotated) std::this_thread::sleep_for(milliseconds(500));
  }
  EXPECT_TRUE(rotated) << h.proc().Log();
  EXPECT_NE(h.proc().Log().find("SIGHUP: TLS certificate read again"), std::string::npos)
      << h.proc().Log();
  EXPECT_FALSE(mtls_ok(b, a));  // A's client certificate: not signed by the CA served now
  // The Python client over mutual TLS (--tls-cert, --tls-key), and without its certificate.
  for (int i = 0; i < 600; ++i) {  // until the models are loaded
    auto [code, out] = python(h.target(),
                              {"--tls-ca", b + "/ca.pem", "--tls-cert", b + "/client.pem",
                               "--tls-key", b + "/client.key"},
                              "py_mtls");
    if (code == 0 || out.find("UNAVAILABLE: models are loading") == std::string::npos) {
      EXPECT_EQ(code, 0) << out;
      break;
    }
    std::this_thread::sleep_for(milliseconds(200));
  }
  EXPECT_EQ(ClassifyPng(Slurp(live + "/py_mtls.png"), &err), 1) << err;
  auto [no_cert, no_cert_out] = python(h.target(), {"--tls-ca", b + "/ca.pem"}, "py_no_cert");
  EXPECT_NE(no_cert, 0) << no_cert_out;
}

// The daemons' TLS mirrors (server/tls.h) in the directory `tmp` (their $TMPDIR), by name.
std::vector<std::string> TlsMirrors(const std::string& tmp) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(tmp)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("imagegen-tls-", 0) == 0) names.push_back(name);
  }
  return names;
}

// A daemon killed with SIGKILL cannot remove the copy of its key that gRPC reads (the mirror
// under $TMPDIR, server/tls.h); the next daemon to start there removes it and says so (on
// Kubernetes the pod's emptyDir /tmp outlives a killed container).
TEST(E2eTest, TheKeyCopyOfAKilledTlsDaemonIsRemovedByTheNextOne) {
  const std::string pki = MakeCertificates("pki_killed");
  const std::string tmp = TempDir("tls_killed_tmp");
  const std::vector<std::string> flags = {"--tls-cert", pki + "/server.pem", "--tls-key",
                                          pki + "/server.key"};
  auto mirrors = [&] { return TlsMirrors(tmp); };
  std::string first;
  {
    Daemon killed("tls_killed_1", flags, false, {"TMPDIR=" + tmp});
    ASSERT_EQ(mirrors().size(), 1u);
    first = mirrors()[0];
    EXPECT_EQ(Slurp(tmp + "/" + first + "/current/key.pem"), Slurp(pki + "/server.key"));
    killed.proc().Signal(SIGKILL);
    ASSERT_GE(killed.proc().Wait(seconds(60)), 0);
  }
  ASSERT_EQ(mirrors(), std::vector<std::string>{first}) << "SIGKILL left nothing behind?";
  Daemon next("tls_killed_2", flags, false, {"TMPDIR=" + tmp});
  const std::vector<std::string> now = mirrors();
  ASSERT_EQ(now.size(), 1u);
  EXPECT_NE(now[0], first);
  EXPECT_NE(next.proc().Log().find("removed the TLS mirror of a daemon that is gone: " + tmp + "/" +
                                   first),
            std::string::npos)
      << next.proc().Log();
}

// Named API keys (server/auth.h) and trusted proxies (server/forwarded.h): a key's name is in
// the request line, its priority is its requests' default and the most urgent they may ask for
// (PERMISSION_DENIED naming `priority` on gRPC, 403 on HTTP), its usage is counted under its
// name (imagegen_key_*), a trusted proxy's
// X-Forwarded-For names the caller while anyone else's is ignored, and SIGHUP reads the key
// file again (a broken file keeps the keys).
TEST(E2eTest, ApiKeysNameTenantsBoundPrioritiesAndReloadOnSighup) {
  const std::string dir = TempDir("api_keys_file");
  const std::string keys = dir + "/keys";
  {
    std::ofstream(keys) << "# e2e\ntok-batch name=batch priority=5\ntok-app name=app\n"
                           "tok-capped name=capped max_in_flight=1  # one image at a time\n";
  }
  Daemon d("api_keys", {"--token-file", keys, "--token-file-poll-seconds", "0", "--http-listen",
                        "127.0.0.1:0", "--log-format", "json", "--trusted-proxies", "127.0.0.0/8",
                        "--stream-stall-seconds", "300"});
  d.WaitReady();
  auto stub = d.Stub();
  auto call = [&](const std::string& token, int priority, const std::string& id,
                  const std::string& forwarded_for, int n = 1) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    ctx.AddMetadata("authorization", "Bearer " + token);
    ctx.AddMetadata("x-request-id", id);
    if (!forwarded_for.empty()) ctx.AddMetadata("x-forwarded-for", forwarded_for);
    v1::GenerateRequest q = Request("bag", 21, "ar");
    q.set_priority(priority);
    q.set_n(n);
    v1::GenerateResponse resp;
    return stub->Generate(&ctx, q, &resp);
  };
  EXPECT_TRUE(call("tok-batch", 0, "k-batch-default", "").ok());
  EXPECT_TRUE(call("tok-batch", 7, "k-batch-7", "").ok());
  const grpc::Status denied = call("tok-batch", 2, "k-batch-2", "");
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED) << denied.error_message();
  google::rpc::BadRequest br;
  ASSERT_NE(Violations(denied, &br), nullptr);
  EXPECT_EQ(br.field_violations(0).field(), "priority");
  EXPECT_TRUE(call("tok-app", -3, "k-app-forwarded", "198.51.100.7, 203.0.113.9").ok());
  // max_in_flight=1: while the key's stream is in flight a second call is RESOURCE_EXHAUSTED
  // with RetryInfo; a call of 2 images never fits (INVALID_ARGUMENT naming n); once the stream
  // has ended the key's next call runs. The stream is held in flight by its client: large
  // previews in every step and a 1 KiB read-ahead, read only once the checks are done (as in
  // AStreamWhoseClientStopsReadingIsEndedAndOthersGoOn; the stall limit is 300 s here).
  {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
    auto slow = v1::ImageGeneration::NewStub(
        grpc::CreateCustomChannel(d.target(), grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext sctx;
    sctx.AddMetadata("authorization", "Bearer tok-capped");
    sctx.AddMetadata("x-request-id", "k-capped-stream");
    v1::GenerateRequest held = Request("shirt", 31, "ar");
    held.set_preview_every(1);
    held.mutable_output()->set_scale(16);
    auto reader = slow->GenerateStream(&sctx, held);
    v1::GenerateStreamResponse msg;
    if (!reader->Read(&msg)) {  // the call has begun: its image counts
      const grpc::Status ended = reader->Finish();
      FAIL() << "the held stream ended before its first message: " << ended.error_code() << " "
             << ended.error_message();
    }
    const grpc::Status busy = call("tok-capped", 0, "k-capped-busy", "");
    ASSERT_EQ(busy.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << busy.error_message();
    EXPECT_NE(busy.error_message().find("max_in_flight is 1"), std::string::npos)
        << busy.error_message();
    google::rpc::Status details;
    ASSERT_TRUE(details.ParseFromString(busy.error_details()));
    google::rpc::RetryInfo retry;
    ASSERT_EQ(details.details_size(), 1);
    EXPECT_TRUE(details.details(0).UnpackTo(&retry));
    EXPECT_TRUE(call("tok-app", 0, "k-app-meanwhile", "").ok());  // another key is not held
    // The HTTP API: 429 with Retry-After.
    const std::string capped_body = R"({"prompt": "bag", "seed": 24, "method": "ar"})";
    const std::string capped_http =
        Fetch(d.http_port(),
              "POST /v1/images/generations HTTP/1.0\r\nHost: 127.0.0.1\r\n"
              "Content-Type: application/json\r\nX-Request-Id: k-capped-http\r\n"
              "Authorization: Bearer tok-capped\r\nContent-Length: " +
                  std::to_string(capped_body.size()) + "\r\n\r\n" + capped_body);
    EXPECT_EQ(capped_http.rfind("HTTP/1.1 429", 0), 0u) << capped_http.substr(0, 300);
    EXPECT_NE(capped_http.find("Retry-After: "), std::string::npos) << capped_http.substr(0, 300);
    bool final_seen = false;
    while (reader->Read(&msg)) final_seen |= msg.has_final();
    EXPECT_TRUE(final_seen);
    ASSERT_TRUE(reader->Finish().ok());
  }
  const grpc::Status two = call("tok-capped", 0, "k-capped-n2", "", 2);
  ASSERT_EQ(two.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << two.error_message();
  ASSERT_NE(Violations(two, &br), nullptr);
  EXPECT_EQ(br.field_violations(0).field(), "n");
  // The call's images are given back when its outcome is recorded, before its status is sent:
  // no wait is needed.
  EXPECT_TRUE(call("tok-capped", 0, "k-capped-after", "").ok());
  // HTTP: the same floor, as OpenAI's 403 shape naming the parameter; X-Forwarded-For from a
  // trusted proxy (loopback here) names the caller.
  const std::string body = R"({"prompt": "bag", "seed": 22, "method": "ar", "priority": 1})";
  const std::string http = Fetch(d.http_port(),
                                 "POST /v1/images/generations HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                                 "Content-Type: application/json\r\nX-Request-Id: k-http-2\r\n"
                                 "Authorization: Bearer tok-batch\r\n"
                                 "X-Forwarded-For: 192.0.2.44\r\nContent-Length: " +
                                     std::to_string(body.size()) + "\r\n\r\n" + body);
  ASSERT_EQ(http.rfind("HTTP/1.1 403", 0), 0u) << http.substr(0, 300);
  const nlohmann::json err = nlohmann::json::parse(http.substr(http.find("\r\n\r\n") + 4));
  EXPECT_EQ(err["error"]["param"], "priority") << err;
  EXPECT_EQ(err["error"]["code"], "permission_denied") << err;
  // Usage per key: calls by outcome, images, their tokens and target forwards (ar: one per
  // token).
  EXPECT_TRUE(d.WaitMetric(R"(imagegen_key_requests_total{key="batch",outcome="ok"})", 2));
  EXPECT_TRUE(
      d.WaitMetric(R"(imagegen_key_requests_total{key="batch",outcome="permission_denied"})", 2));
  EXPECT_TRUE(d.WaitMetric(R"(imagegen_key_requests_total{key="app",outcome="ok"})", 2));
  EXPECT_TRUE(d.WaitMetric(R"(imagegen_key_images_total{key="batch"})", 2));
  EXPECT_TRUE(d.WaitMetric(R"(imagegen_key_image_tokens_total{key="batch"})", 2 * 196));
  EXPECT_TRUE(d.WaitMetric(R"(imagegen_key_target_forwards_total{key="batch"})", 2 * 196));
  EXPECT_TRUE(d.WaitMetric(R"(imagegen_key_images_total{key="app"})", 2));
  EXPECT_TRUE(
      d.WaitMetric(R"(imagegen_key_requests_total{key="capped",outcome="resource_exhausted"})", 2));

  // Rotation: SIGHUP with a new file; the old keys stop working, the new one works.
  { std::ofstream(keys) << "tok-new name=rotated\n"; }
  // Whether a daemon's log says `text` within 120 s.
  auto logged = [](Daemon& daemon, const std::string& text) {
    for (int i = 0; i < 2400; ++i) {
      if (daemon.proc().Log().find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
  };
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(logged(d, "SIGHUP: --token-file read again: 1 keys")) << d.proc().Log();
  EXPECT_EQ(call("tok-app", 0, "k-app-old", "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(call("tok-new", 0, "k-new", "").ok());
  // A broken file keeps the keys as they were.
  { std::ofstream(keys) << "tok-x name=a/b\n"; }
  d.proc().Signal(SIGHUP);
  ASSERT_TRUE(logged(d, "kept as it was")) << d.proc().Log();
  EXPECT_TRUE(call("tok-new", 0, "k-new-again", "").ok());

  d.proc().Signal(SIGTERM);
  ASSERT_EQ(d.proc().Wait(seconds(60)), 0) << d.proc().Log();
  std::map<std::string, nlohmann::json> calls;
  std::istringstream in(d.proc().Log());
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", "") == "request") {
      calls[j["request_id"].get<std::string>()] = j;
    }
  }
  ASSERT_EQ(calls.size(), 14u) << d.proc().Log();
  EXPECT_EQ(calls["k-batch-default"]["key"], "batch");
  EXPECT_EQ(calls["k-batch-default"]["priority"], 5);  // the key's default
  EXPECT_EQ(calls["k-batch-7"]["priority"], 7);
  EXPECT_EQ(calls["k-batch-2"]["outcome"], "permission_denied");
  EXPECT_FALSE(calls["k-batch-default"].contains("addr"));  // no X-Forwarded-For
  EXPECT_EQ(calls["k-app-forwarded"]["key"], "app");
  EXPECT_EQ(calls["k-app-forwarded"]["priority"], -3);  // no floor: as asked
  EXPECT_EQ(calls["k-app-forwarded"]["addr"], "ipv4:203.0.113.9");
  EXPECT_EQ(calls["k-http-2"]["status"], 403);
  EXPECT_EQ(calls["k-http-2"]["addr"], "ipv4:192.0.2.44");
  EXPECT_EQ(calls["k-app-old"]["outcome"], "unauthenticated");
  EXPECT_EQ(calls["k-new"]["key"], "rotated");
  EXPECT_EQ(calls["k-new-again"]["outcome"], "ok");
  EXPECT_EQ(calls["k-capped-stream"]["outcome"], "ok");
  EXPECT_EQ(calls["k-capped-busy"]["outcome"], "resource_exhausted");
  EXPECT_EQ(calls["k-capped-n2"]["outcome"], "invalid_argument");
  EXPECT_EQ(calls["k-capped-after"]["key"], "capped");

  // Not a trusted proxy: X-Forwarded-For is ignored. And without SIGHUP, a change of the key
  // file is read within --token-file-poll-seconds (the file replaced by a rename, as a
  // Kubernetes Secret volume does).
  const std::string keys2 = dir + "/keys2";
  ASSERT_TRUE(WriteFileAtomically(keys2, "tok-one\n").ok());
  Daemon u("api_keys_untrusted", {"--token-file", keys2, "--token-file-poll-seconds", "0.2",
                                  "--log-format", "json", "--trusted-proxies", "10.0.0.0/8"});
  u.WaitReady();
  auto call_u = [&](const std::string& token, const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    ctx.AddMetadata("authorization", "Bearer " + token);
    ctx.AddMetadata("x-request-id", id);
    ctx.AddMetadata("x-forwarded-for", "203.0.113.9");
    v1::GenerateResponse resp;
    return u.Stub()->Generate(&ctx, Request("bag", 23, "ar"), &resp).error_code();
  };
  ASSERT_EQ(call_u("tok-one", "k-untrusted"), grpc::StatusCode::OK);
  ASSERT_TRUE(WriteFileAtomically(keys2, "tok-two name=two\n").ok());
  ASSERT_TRUE(logged(u, "the file changed: --token-file read again: 1 keys")) << u.proc().Log();
  EXPECT_EQ(call_u("tok-one", "k-one-old"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call_u("tok-two", "k-two"), grpc::StatusCode::OK);
  u.proc().Signal(SIGTERM);
  ASSERT_EQ(u.proc().Wait(seconds(60)), 0) << u.proc().Log();
  const std::string log = u.proc().Log();
  ASSERT_NE(log.find(R"("request_id":"k-untrusted")"), std::string::npos) << log;
  EXPECT_EQ(log.find("203.0.113.9"), std::string::npos) << log;
  // Read once at start and once after the change: an unchanged file is not read again.
  size_t reads = 0;
  for (size_t at = log.find("read again"); at != std::string::npos;
       at = log.find("read again", at + 1)) {
    ++reads;
  }
  EXPECT_EQ(reads, 1u) << log;
  RemoveTree(dir);
}

// With the decode thread on (the CUDA default; off on the CPU), so that the images finished
// during the drain are completed from that thread and counted before the daemon exits.
TEST(E2eTest, SigtermDrainsInFlightStreamsThenExitsZero) {
  Daemon d("sigterm",
           {"--grace-seconds", "60", "--http-listen", "127.0.0.1:0", "--decode-thread", "1"});
  d.WaitReady();
  // The HTTP port's health routes (for load balancers that do not speak gRPC): ready now.
  EXPECT_EQ(HttpGet(d.http_port(), "/health"),
            std::make_pair(200, std::string(R"({"status":"ready"})")));
  EXPECT_EQ(HttpGet(d.http_port(), "/health/ready").first, 200);
  EXPECT_EQ(HttpGet(d.http_port(), "/health/live").first, 200);
  auto stub = d.Stub();
  grpc::ClientContext a, b;
  auto ra = stub->GenerateStream(&a, Request("shirt", 1, "ar"));
  auto rb = stub->GenerateStream(&b, Request("pullover", 2, "sjd"));
  v1::GenerateStreamResponse msg;
  ASSERT_TRUE(ra->Read(&msg));
  ASSERT_TRUE(rb->Read(&msg));
  EXPECT_EQ(d.Health(kService), HealthCheckResponse::SERVING);
  // The CLI's health command (the image's HEALTHCHECK): exit 0 while serving, 1 once draining.
  std::string out;
  EXPECT_EQ(
      RunCommand({CliBinary(), "health", "--target", d.target()}, &out, d.dir() + "/health1.log"),
      0)
      << out;
  EXPECT_NE(out.find("SERVING"), std::string::npos) << out;
  d.proc().Signal(SIGTERM);
  // Draining: health NOT_SERVING, new calls refused, the streams go on.
  bool not_serving = false;
  for (int i = 0; i < 3000 && !not_serving; ++i) {
    not_serving = d.Health(kService) == HealthCheckResponse::NOT_SERVING &&
                  d.Health("") == HealthCheckResponse::NOT_SERVING;
    if (!not_serving) std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_TRUE(not_serving);
  EXPECT_EQ(HttpGet(d.http_port(), "/health"),
            std::make_pair(503, std::string(R"({"status":"draining"})")));
  EXPECT_EQ(HttpGet(d.http_port(), "/health/live").first, 200);  // alive while it drains
  EXPECT_EQ(
      RunCommand({CliBinary(), "health", "--target", d.target()}, &out, d.dir() + "/health2.log"),
      1)
      << out;
  EXPECT_NE(out.find("NOT_SERVING"), std::string::npos) << out;
  grpc::ClientContext c;
  v1::GenerateResponse resp;
  EXPECT_EQ(stub->Generate(&c, Request("shirt", 3, "ar"), &resp).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  for (auto* r : {ra.get(), rb.get()}) {
    bool final = false;
    while (r->Read(&msg)) final |= msg.has_final();
    EXPECT_TRUE(final);
    EXPECT_TRUE(r->Finish().ok());
  }
  EXPECT_EQ(d.proc().Wait(seconds(60)), 0) << d.proc().Log();
  EXPECT_NE(d.proc().Log().find("stopped: 2 images"), std::string::npos) << d.proc().Log();
  EXPECT_NE(d.proc().Log().find("images decoded on their own thread"), std::string::npos);
}

// SIGTERM while the models load (here a start-up warm-up of 4 methods at 5 loads, about a
// minute on the 2-core CPU): nothing is in flight, so the daemon exits at once with status 0
// instead of warming up, turning ready and draining. Power: without the handler the log has
// "ready:" and no "while loading" line.
TEST(E2eTest, SigtermWhileLoadingExitsAtOnceWithoutBecomingReady) {
  Daemon d("sigterm_loading", {"--warmup=1", "--warmup_methods=ar,sjd,scd-mc,sjd-pac",
                               "--warmup_concurrency=1,2,4,8,16"});
  // The port is open and the models load: NOT_SERVING (UNKNOWN if the call itself failed).
  EXPECT_NE(d.Health(kService), HealthCheckResponse::SERVING);
  d.proc().Signal(SIGTERM);
  EXPECT_EQ(d.proc().Wait(seconds(120)), 0) << d.proc().Log();
  const std::string log = d.proc().Log();
  EXPECT_NE(log.find("received SIGTERM while loading the models: exiting"), std::string::npos)
      << log;
  EXPECT_EQ(log.find("ready:"), std::string::npos) << log;
  EXPECT_EQ(log.find("warm-up:"), std::string::npos) << log;  // it never finished
}

// The quick exit of a SIGTERM while the models load skips the destructors, which remove the
// copy of the TLS files that gRPC reads (server/tls.h): it removes that copy itself. Power:
// without it the copy (a key) stays in $TMPDIR.
TEST(E2eTest, ATlsDaemonStoppedWhileLoadingLeavesNoKeyCopy) {
  const std::string pki = MakeCertificates("pki_loading");
  const std::string tmp = TempDir("tls_loading_tmp");
  auto mirrors = [&] { return TlsMirrors(tmp).size(); };
  Daemon d(
      "tls_loading",
      {"--warmup=1", "--warmup_methods=ar,sjd,scd-mc,sjd-pac", "--warmup_concurrency=1,2,4,8,16",
       "--tls-cert", pki + "/server.pem", "--tls-key", pki + "/server.key"},
      false, {"TMPDIR=" + tmp});
  ASSERT_EQ(mirrors(), 1u);
  d.proc().Signal(SIGTERM);
  EXPECT_EQ(d.proc().Wait(seconds(120)), 0) << d.proc().Log();
  EXPECT_NE(d.proc().Log().find("received SIGTERM while loading the models: exiting"),
            std::string::npos)
      << d.proc().Log();
  EXPECT_EQ(mirrors(), 0u) << d.proc().Log();
}

// SIGTERM as soon as the daemon is ready, with a stream in flight, is a drain: the stream ends
// with its image and the daemon exits 0 once it has. The thread that watches for signals while
// the models load must not take it for one that came before (it once did for up to 0.1 s after
// the service turned SERVING, cutting the stream). Power: with that window the log says
// "while loading" and the stream ends without its final message.
TEST(E2eTest, SigtermRightAfterReadyDrainsTheStreamInFlight) {
  Daemon d("sigterm_ready", {"--grace-seconds", "60"});
  // Polled without pauses, so that the signal comes within milliseconds of SERVING.
  const auto give_up = std::chrono::steady_clock::now() + seconds(300);
  while (d.Health(kService) != HealthCheckResponse::SERVING) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << d.proc().Log();
  }
  auto stub = d.Stub();
  grpc::ClientContext ctx;
  auto r = stub->GenerateStream(&ctx, Request("shirt", 1, "ar"));
  v1::GenerateStreamResponse msg;
  ASSERT_TRUE(r->Read(&msg));
  d.proc().Signal(SIGTERM);
  bool final = false;
  while (r->Read(&msg)) final |= msg.has_final();
  EXPECT_TRUE(final);
  EXPECT_TRUE(r->Finish().ok());
  EXPECT_EQ(d.proc().Wait(seconds(60)), 0) << d.proc().Log();
  const std::string log = d.proc().Log();
  EXPECT_EQ(log.find("while loading"), std::string::npos) << log;
  EXPECT_NE(log.find("stopped: 1 images"), std::string::npos) << log;
}

// SIGHUP while the models load (a short warm-up here) is not lost: the key file it asks to read
// again is read once the daemon is ready. Power: a loader that swallows the signal leaves the
// old key working and never logs the reload.
TEST(E2eTest, SighupWhileLoadingReadsTheKeyFileOnceReady) {
  const std::string dir = TempDir("sighup_loading_keys");
  const std::string keys = dir + "/keys";
  ASSERT_TRUE(WriteFileAtomically(keys, "tok-old\n").ok());
  Daemon d("sighup_loading", {"--token-file", keys, "--token-file-poll-seconds", "0", "--warmup=1",
                              "--warmup_methods=ar,sjd", "--warmup_concurrency=1,2"});
  ASSERT_TRUE(WriteFileAtomically(keys, "tok-new name=new\n").ok());
  EXPECT_NE(d.Health(kService), HealthCheckResponse::SERVING);  // still loading
  d.proc().Signal(SIGHUP);
  d.WaitReady();
  bool reloaded = false;
  for (int i = 0; i < 2400 && !reloaded; ++i) {
    reloaded = d.proc().Log().find("SIGHUP: --token-file read again: 1 keys") != std::string::npos;
    if (!reloaded) std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_TRUE(reloaded) << d.proc().Log();
  auto call = [&](const std::string& token) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    ctx.AddMetadata("authorization", "Bearer " + token);
    v1::GenerateResponse resp;
    return d.Stub()->Generate(&ctx, Request("bag", 5, "ar"), &resp).error_code();
  };
  EXPECT_EQ(call("tok-old"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call("tok-new"), grpc::StatusCode::OK);
  const std::string log = d.proc().Log();
  EXPECT_NE(log.find("warm-up:"), std::string::npos) << log;
  EXPECT_LT(log.find("warm-up:"), log.find("SIGHUP: --token-file read again")) << log;
  RemoveTree(dir);
}

// The daemon's log (server/request_log.h), here as JSON lines: every generation call, from
// either front, is one `request` line that names it by the id the response carries back
// (x-request-id: the client's when it sends a valid one, else the server's), with its outcome
// and the same NFE and seed the response reports; a busy model gets `stats` lines; and
// --log-requests=false writes no request line.
TEST(E2eTest, RequestLogNamesEveryCallByTheIdItEchoes) {
  Daemon d("request_log",
           {"--http-listen", "127.0.0.1:0", "--log-format", "json", "--log-stats-seconds", "0.5"});
  d.WaitReady();
  auto stub = d.Stub();
  auto id_of = [](const grpc::ClientContext& ctx) {
    for (const auto* md : {&ctx.GetServerInitialMetadata(), &ctx.GetServerTrailingMetadata()}) {
      const auto it = md->find("x-request-id");
      if (it != md->end()) return std::string(it->second.data(), it->second.size());
    }
    return std::string();
  };
  const std::regex server_id("req_[0-9a-f]{32}");

  grpc::ClientContext c1;  // the client's id; a user and a priority; the caller's trace
  c1.AddMetadata("x-request-id", "e2e-grpc-1");
  c1.AddMetadata("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
  v1::GenerateResponse r1;
  v1::GenerateRequest q1 = Request("bag", 11, "sjd");
  q1.set_user("e2e-user");
  q1.set_priority(-2);
  ASSERT_TRUE(stub->Generate(&c1, q1, &r1).ok());
  EXPECT_EQ(id_of(c1), "e2e-grpc-1");

  grpc::ClientContext c2;  // none: the server's
  v1::GenerateResponse r2;
  ASSERT_TRUE(stub->Generate(&c2, Request("sneaker", 12, "ar"), &r2).ok());
  const std::string id2 = id_of(c2);
  EXPECT_TRUE(std::regex_match(id2, server_id)) << id2;

  grpc::ClientContext c3;  // an invalid one: refused, naming it
  c3.AddMetadata("x-request-id", std::string(200, 'x'));
  v1::GenerateResponse r3;
  const grpc::Status s3 = stub->Generate(&c3, Request("bag", 13, "ar"), &r3);
  ASSERT_EQ(s3.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  google::rpc::BadRequest br;
  ASSERT_NE(Violations(s3, &br), nullptr);
  EXPECT_EQ(br.field_violations(0).field(), "x-request-id");
  EXPECT_EQ(id_of(c3), "");  // an error carries no metadata (it stays retryable)

  grpc::ClientContext c4;  // a stream; a traceparent to ignore (version ff)
  c4.AddMetadata("x-request-id", "e2e-stream-1");
  c4.AddMetadata("traceparent", "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
  auto reader = stub->GenerateStream(&c4, Request("trouser", 14, "scd-mc"));
  v1::GenerateStreamResponse msg;
  int64_t stream_nfe = 0;
  while (reader->Read(&msg)) {
    if (msg.has_final()) stream_nfe = msg.final().stats().nfe();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(id_of(c4), "e2e-stream-1");

  // The HTTP API: the header in, the same header out.
  const std::string body = R"({"prompt": "bag", "seed": 15, "method": "ar"})";
  const std::string http = Fetch(d.http_port(),
                                 "POST /v1/images/generations HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                                 "Content-Type: application/json\r\nX-Request-Id: e2e-http-1\r\n"
                                 "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-"
                                 "00f067aa0ba902b7-00\r\nContent-Length: " +
                                     std::to_string(body.size()) + "\r\n\r\n" + body);
  ASSERT_EQ(http.rfind("HTTP/1.1 200", 0), 0u) << http.substr(0, 300);
  EXPECT_NE(http.find("\r\nx-request-id: e2e-http-1\r\n"), std::string::npos)
      << http.substr(0, http.find("\r\n\r\n"));

  // A stats line for the model the calls kept busy.
  bool stats = false;
  for (int i = 0; i < 2400 && !stats; ++i) {
    stats = d.proc().Log().find(R"("event":"stats")") != std::string::npos;
    if (!stats) std::this_thread::sleep_for(milliseconds(50));
  }
  EXPECT_TRUE(stats) << d.proc().Log();

  // Stopped, the daemon has written every line (the log is flushed before it exits).
  d.proc().Signal(SIGTERM);
  ASSERT_EQ(d.proc().Wait(seconds(60)), 0) << d.proc().Log();
  std::map<std::string, nlohmann::json> calls;
  int request_lines = 0;
  nlohmann::json stats_line;
  std::istringstream in(d.proc().Log());
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("ts") && j.contains("event")) << line;
    if (j["event"] == "request") {
      request_lines += 1;
      calls[j["request_id"].get<std::string>()] = j;
    } else if (j["event"] == "stats" && j["images_per_second"].get<double>() > 0) {
      stats_line = j;
    }
  }
  EXPECT_EQ(request_lines, 5);
  ASSERT_EQ(calls.size(), 5u) << d.proc().Log();
  const nlohmann::json& g1 = calls["e2e-grpc-1"];
  EXPECT_EQ(g1["api"], "grpc");
  EXPECT_EQ(g1["model"], "fmnist-gpt");
  EXPECT_EQ(g1["method"], "sjd");
  EXPECT_EQ(g1["outcome"], "ok");
  EXPECT_EQ(g1["nfe"], r1.stats().nfe());
  EXPECT_EQ(g1["tokens"], 196);
  EXPECT_EQ(g1["seed"], "11");
  EXPECT_EQ(g1["peer"].get<std::string>().rfind("ipv4:127.0.0.1:", 0), 0u) << g1;
  EXPECT_EQ(g1["user"], "e2e-user");
  EXPECT_EQ(g1["priority"], -2);
  EXPECT_EQ(g1["trace_id"], "0af7651916cd43dd8448eb211c80319c");
  EXPECT_EQ(g1["parent_span_id"], "b7ad6b7169203331");
  EXPECT_FALSE(calls[id2].contains("trace_id"));
  EXPECT_FALSE(calls["e2e-stream-1"].contains("trace_id"));  // ignored, as the spec says
  EXPECT_FALSE(calls[id2].contains("user"));  // none named, priority 0: neither is written
  EXPECT_FALSE(calls[id2].contains("priority"));
  EXPECT_EQ(calls[id2]["method"], "ar");
  EXPECT_EQ(calls[id2]["nfe"], 196);
  std::string id3;  // the refused call's: the server's, found in its log line
  for (const auto& [id, j] : calls) {
    if (j["outcome"] == "invalid_argument") id3 = id;
  }
  EXPECT_TRUE(std::regex_match(id3, server_id)) << id3;
  EXPECT_EQ(calls[id3]["outcome"], "invalid_argument");
  EXPECT_NE(calls[id3]["error"].get<std::string>().find("x-request-id"), std::string::npos);
  EXPECT_FALSE(calls[id3].contains("nfe"));
  EXPECT_EQ(calls["e2e-stream-1"]["api"], "grpc-stream");
  EXPECT_EQ(calls["e2e-stream-1"]["nfe"], stream_nfe);
  const nlohmann::json& h1 = calls["e2e-http-1"];
  EXPECT_EQ(h1["api"], "http");
  EXPECT_EQ(h1["status"], 200);
  EXPECT_EQ(h1["outcome"], "ok");
  EXPECT_EQ(h1["seed"], "15");
  EXPECT_EQ(h1["nfe"], 196);
  EXPECT_EQ(h1["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(h1["parent_span_id"], "00f067aa0ba902b7");
  ASSERT_FALSE(stats_line.is_null()) << d.proc().Log();
  EXPECT_EQ(stats_line["model"], "fmnist-gpt");
  EXPECT_GT(stats_line["tokens_per_second"].get<double>(), 0);

  // Off: no request lines (and no stats lines), the daemon's own messages still in text.
  Daemon quiet("request_log_off", {"--log-requests=false", "--log-stats-seconds", "0"});
  quiet.WaitReady();
  grpc::ClientContext c5;
  v1::GenerateResponse r5;
  ASSERT_TRUE(quiet.Stub()->Generate(&c5, Request("bag", 16, "ar"), &r5).ok());
  EXPECT_TRUE(std::regex_match(id_of(c5), server_id));  // the id is still sent back
  quiet.proc().Signal(SIGTERM);
  ASSERT_EQ(quiet.proc().Wait(seconds(60)), 0) << quiet.proc().Log();
  const std::string log = quiet.proc().Log();
  EXPECT_EQ(log.find("imagegen-server: request"), std::string::npos) << log;
  EXPECT_EQ(log.find("imagegen-server: stats"), std::string::npos) << log;
  EXPECT_NE(log.find("imagegen-server: stopped: 1 images"), std::string::npos) << log;
}

// A real Prometheus server scrapes the daemon with deploy/prometheus.yml (target and intervals
// adapted to the test), and its HTTP API gives the acceptance rate and NFE per image (the same as
// the responses' own totals); it loads the alerting rules (deploy/prometheus-rules.yml) and
// evaluates them without error.
TEST(E2eTest, PrometheusScrapesAcceptanceRateAndNfe) {
  // Its requests run one at a time: without a ceiling on a lone request's window, scd-mc
  // speculates whatever the shared step-cost calibration says (one measured beside another
  // test put the CPU ceiling at 1 node for every method, and scd-mc verified no draft).
  Daemon d("prometheus", {"--lone-request-max-window", "0"});
  d.WaitReady();
  auto stub = d.Stub();
  // What the responses say, per method: Prometheus must compute the same ratios from the series.
  std::map<std::string, int64_t> nfe_sum, verified_sum, accepted_sum, images;
  for (const auto& [method, seed] : std::vector<std::pair<std::string, int>>{
           {"scd-mc", 1}, {"scd-mc", 2}, {"scd-mc", 3}, {"ar", 4}}) {
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    ASSERT_TRUE(stub->Generate(&ctx, Request("bag", seed, method), &resp).ok());
    // Last token to pixels, within the response's time.
    EXPECT_GT(resp.stats().decode_seconds(), 0);
    EXPECT_LT(resp.stats().decode_seconds(), resp.stats().total_seconds());
    nfe_sum[method] += resp.stats().nfe();
    verified_sum[method] += resp.stats().drafts_verified();
    accepted_sum[method] += resp.stats().drafts_accepted();
    images[method] += 1;
  }
  // scd-mc speculated (how much depends on the goodput controller's windows, which follow the
  // step-cost calibration this machine measured, under whatever else it ran: not asserted here).
  ASSERT_GT(verified_sum["scd-mc"], 0);
  ASSERT_GT(accepted_sum["scd-mc"], 0);
  EXPECT_LT(nfe_sum["scd-mc"], images["scd-mc"] * 196);
  // promtool lints the exposition: nothing to report.
  const std::string dir = d.dir();
  { std::ofstream(dir + "/metrics.txt") << d.Metrics(); }
  std::string lint;
  EXPECT_EQ(RunCommand({"/bin/bash", "-c", "promtool check metrics < '" + dir + "/metrics.txt'"},
                       &lint, dir + "/promtool.log"),
            0)
      << lint;
  EXPECT_EQ(lint, "");
  // The goodput controller's series (the default window policy).
  const std::string text = Slurp(dir + "/metrics.txt");
  // The process's own (server/process_metrics.h): its memory is at least the models' hundreds
  // of MB, its descriptors count the listening sockets, it started before the scrape.
  EXPECT_GT(MetricValue(text, "process_resident_memory_bytes"), 100e6) << text.size();
  EXPECT_GT(MetricValue(text, "process_open_fds"), 3);
  EXPECT_GT(MetricValue(text, "process_cpu_seconds_total"), 0);
  EXPECT_LE(MetricValue(text, "process_start_time_seconds"),
            static_cast<double>(std::time(nullptr)));
  for (const char* series : {"imagegen_step_cost_ratio_count{model=\"fmnist-gpt\"}",
                             "imagegen_step_predicted_seconds_total{model=\"fmnist-gpt\"}",
                             "imagegen_controller_expected_tokens_total{model=\"fmnist-gpt\"}",
                             "imagegen_controller_committed_tokens_total{model=\"fmnist-gpt\"}",
                             "imagegen_request_decode_seconds_count{method=\"scd-mc\",model="
                             "\"fmnist-gpt\"} 3",
                             "imagegen_request_window_tokens_bucket{method=\"scd-mc\",model="
                             "\"fmnist-gpt\",le=\"32\"}"}) {
    EXPECT_NE(text.find(series), std::string::npos) << series;
  }

  std::string config = Slurp(std::string(SourceDir()) + "/deploy/prometheus.yml");
  config = std::regex_replace(config, std::regex("imagegen:9464"),
                              "127.0.0.1:" + std::to_string(d.metrics_port()));
  config = std::regex_replace(config, std::regex("scrape_interval: \\w+"), "scrape_interval: 1s");
  config = std::regex_replace(config, std::regex("evaluation_interval: \\w+"),
                              "evaluation_interval: 1s");
  { std::ofstream(dir + "/prometheus.yml") << config; }
  // The alerting rules beside it, as prometheus.yml names them.
  {
    std::ofstream(dir + "/prometheus-rules.yml")
        << Slurp(std::string(SourceDir()) + "/deploy/prometheus-rules.yml");
  }
  const int port = FreePort();
  Process prom({"/usr/bin/prometheus", "--config.file=" + dir + "/prometheus.yml",
                "--storage.tsdb.path=" + dir + "/tsdb",
                "--web.listen-address=127.0.0.1:" + std::to_string(port), "--log.level=warn"},
               dir + "/prometheus.log");
  auto query = [&](const std::string& q) -> std::map<std::string, double> {
    auto [code, body] = HttpGet(port, "/api/v1/query?query=" + UrlEncode(q));
    std::map<std::string, double> out;
    if (code != 200) return out;
    using nlohmann::json;
    const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return out;
    for (const json& r : j.value(json::json_pointer("/data/result"), json::array())) {
      if (!r.is_object()) continue;
      const auto method = r.value(json::json_pointer("/metric/method"), std::string());
      const auto value = r.value(json::json_pointer("/value/1"), std::string());
      if (!method.empty() && !value.empty()) out[method] = std::stod(value);
    }
    return out;
  };
  const std::string acceptance =
      "sum by (method) (imagegen_accepted_tokens_total) / sum by (method) "
      "(imagegen_draft_tokens_total)";
  const std::string nfe =
      "sum by (method) (imagegen_target_forwards_total) / sum by (method) (imagegen_images_total)";
  std::map<std::string, double> acc, per_image;
  for (int i = 0; i < 1200 && (acc.count("scd-mc") == 0 || per_image.count("ar") == 0); ++i) {
    std::this_thread::sleep_for(milliseconds(100));
    acc = query(acceptance);
    per_image = query(nfe);
  }
  ASSERT_EQ(acc.count("scd-mc"), 1u) << prom.Log();
  // The series count every step's drafts and forwards: the same totals as the responses'.
  EXPECT_NEAR(acc["scd-mc"], static_cast<double>(accepted_sum["scd-mc"]) / verified_sum["scd-mc"],
              1e-9);
  EXPECT_LT(acc["scd-mc"], 1.0);
  ASSERT_EQ(per_image.count("ar"), 1u);
  EXPECT_EQ(per_image["ar"], 196.0);
  ASSERT_EQ(per_image.count("scd-mc"), 1u);
  EXPECT_NEAR(per_image["scd-mc"], static_cast<double>(nfe_sum["scd-mc"]) / images["scd-mc"], 1e-9);
  std::printf("Prometheus: acceptance rate scd-mc %.3f; NFE per image ar %.0f, scd-mc %.1f\n",
              acc["scd-mc"], per_image["ar"], per_image["scd-mc"]);
  // The real Prometheus loaded deploy/prometheus-rules.yml and evaluates every rule without an
  // error against this daemon's series; on a healthy daemon none fires.
  using nlohmann::json;
  // As many as the file has ("- alert:" lines): each must load and evaluate.
  const std::string file = Slurp(std::string(SourceDir()) + "/deploy/prometheus-rules.yml");
  int in_file = 0;
  for (size_t at = file.find("- alert:"); at != std::string::npos;
       at = file.find("- alert:", at + 1)) {
    in_file += 1;
  }
  ASSERT_GE(in_file, 6);
  int rules = 0, evaluated = 0, firing = -1;  // as of the last answer
  for (int i = 0; i < 600 && evaluated < in_file; ++i) {
    std::this_thread::sleep_for(milliseconds(100));
    auto [code, body] = HttpGet(port, "/api/v1/rules?type=alert");
    const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (code != 200 || !j.is_object()) continue;
    rules = evaluated = firing = 0;
    for (const json& g : j.value(json::json_pointer("/data/groups"), json::array())) {
      for (const json& r : g.value("rules", json::array())) {
        rules += 1;
        evaluated += r.value("health", std::string()) == "ok" ? 1 : 0;
        firing += r.value("state", std::string()) == "inactive" ? 0 : 1;
      }
    }
  }
  EXPECT_EQ(rules, in_file) << prom.Log();
  EXPECT_EQ(evaluated, in_file) << prom.Log();
  EXPECT_EQ(firing, 0);
  std::printf("Prometheus: %d alerting rules loaded, %d evaluated, %d pending or firing\n", rules,
              evaluated, firing);
}

// --help lists each program's own flags (it listed none: Abseil looks for a source file named
// after the program).
TEST(E2eTest, HelpListsTheFlags) {
  const std::string dir = TempDir("help");
  std::string out;
  RunCommand({ServerBinary(), "--help"}, &out, dir + "/server.log");
  for (const char* flag : {"--listen", "--metrics_listen", "--max_queue", "--grace_seconds"}) {
    EXPECT_NE(out.find(flag), std::string::npos) << flag << " in\n" << out;
  }
  RunCommand({CliBinary(), "--help"}, &out, dir + "/cli.log");
  for (const char* flag : {"--target", "--method", "--preview_every", "--token_file"}) {
    EXPECT_NE(out.find(flag), std::string::npos) << flag << " in\n" << out;
  }
}

// Every bad flag value exits 2 naming its flag, before any call: the target is a port nothing
// listens on, where a call would fail UNAVAILABLE with exit 1. Negative sampling values used
// to mean "the model's default" silently, --alignment false meant on, a long --class id and a
// token file of two lines aborted the CLI (the second printing the token).
TEST(E2eTest, CliRefusesBadFlagValuesBeforeAnyCallAndNeverPrintsTheToken) {
  const std::string dir = TempDir("cli-flags");
  const std::string target = "127.0.0.1:" + std::to_string(FreePort());
  {
    std::ofstream(dir + "/two.tok") << "# my key\nsecret-tok-1\nsecret-tok-2\n";
    std::ofstream(dir + "/keyline.tok") << "secret-tok-3\tname=x\n";
    std::ofstream(dir + "/empty.tok") << "\n# nothing\n";
  }
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"models", "--token-file", dir + "/two.tok"}, "--token-file"},
      {{"models", "--token-file", dir + "/keyline.tok"}, "--token-file"},
      {{"models", "--token-file", dir + "/empty.tok"}, "--token-file"},
      {{"generate", "--class", "99999999999"}, "--class"},
      {{"generate", "--class", "bag", "--alignment", "false"}, "--alignment"},
      {{"generate", "--class", "bag", "--cfg", "-2"}, "--cfg"},
      {{"generate", "--class", "bag", "--temperature", "-0.5"}, "--temperature"},
      {{"generate", "--class", "bag", "--top-k", "-5"}, "--top-k"},
      {{"generate", "--class", "bag", "--seed", "-7"}, "--seed"},
      {{"generate", "--class", "bag", "--window", "-3"}, "--window"},
      {{"generate", "--class", "bag", "--n", "0"}, "--n"},
      {{"generate", "--class", "bag", "--timeout", "1e300"}, "--timeout"},
      {{"generate", "--class", "bag", "--preview-every", "5"}, "--preview-every"},
      {{"generate", "--class", "bag", "--drafts"}, "--drafts"},
      {{"generate", "--class", "bag", "--out", dir + "/no/such/dir/x.png"}, "--out"},
      {{"generate", "--class", "bag", "--tls-cert", dir + "/c.pem"}, "--tls-cert"},
      {{"load", "--concurrency", "0"}, "--concurrency"},
      {{"load", "--duration", "-5"}, "--duration"},
  };
  int k = 0;
  for (const auto& [args, flag] : cases) {
    std::vector<std::string> argv = {CliBinary()};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--target", target});
    std::string out;
    EXPECT_EQ(RunCommand(argv, &out, dir + "/cli" + std::to_string(k++) + ".log"), 2)
        << args[1] << " " << out;
    EXPECT_NE(out.find("imagegen: " + flag), std::string::npos) << flag << " in\n" << out;
    EXPECT_EQ(out.find("UNAVAILABLE"), std::string::npos) << out;  // no call was made
    EXPECT_EQ(out.find("secret-tok"), std::string::npos) << out;
  }
}

TEST(E2eTest, CliAndPythonClientsWork) {
  Daemon d("clients", {"--preview-share", "0"});  // previews counted below, as above
  d.WaitReady();
  const std::string dir = d.dir();
  std::string out;
  ASSERT_EQ(RunCommand({CliBinary(), "models", "--target", d.target()}, &out, dir + "/cli1.log"), 0)
      << out;
  EXPECT_NE(out.find("sneaker"), std::string::npos);
  EXPECT_NE(out.find("scd-mc (default)"), std::string::npos);
  ASSERT_EQ(RunCommand({CliBinary(), "generate", "--target", d.target(), "--class", "sneaker",
                        "--seed", "21", "--out", dir + "/sneaker.png"},
                       &out, dir + "/cli2.log"),
            0)
      << out;
  std::string err;
  EXPECT_EQ(ClassifyPng(Slurp(dir + "/sneaker.png"), &err), 7) << err;
  const std::regex server_id("request id req_[0-9a-f]{32}\n");
  EXPECT_TRUE(std::regex_search(out, server_id)) << out;  // the id the server's log names
  ASSERT_EQ(
      RunCommand({CliBinary(), "generate", "--target", d.target(), "--class", "bag", "--stream",
                  "--preview-every", "10", "--preview-dir", dir + "/frames", "--out",
                  dir + "/bag.png", "--method", "ar", "--request-id", "cli-stream-1"},
                 &out, dir + "/cli3.log"),
      0)
      << out;
  EXPECT_NE(out.find("step 196"), std::string::npos);
  EXPECT_NE(out.find("request id cli-stream-1\n"), std::string::npos) << out;
  // Previews come when due (the budget is off for this daemon): some did.
  EXPECT_FALSE(std::filesystem::is_empty(dir + "/frames"));
  EXPECT_EQ(RunCommand({CliBinary(), "generate", "--target", d.target(), "--class", "bag",
                        "--top-p", "0", "--out", dir + "/x.png"},
                       &out, dir + "/cli4.log"),
            1);
  EXPECT_NE(out.find("field top_p"), std::string::npos) << out;
  EXPECT_FALSE(std::regex_search(out, server_id)) << out;  // errors carry no id
  ASSERT_EQ(RunCommand({CliBinary(), "load", "--target", d.target(), "--concurrency", "2",
                        "--duration", "2", "--method", "sjd"},
                       &out, dir + "/cli5.log"),
            0)
      << out;
  EXPECT_NE(out.find("images/s"), std::string::npos);
  EXPECT_NE(out.find("mean window"), std::string::npos) << out;
  EXPECT_NE(out.find("controller: expected"), std::string::npos) << out;
  EXPECT_NE(out.find("step time predicted"), std::string::npos) << out;
  // A permanent error stops the load at once (each client's first request), naming the field;
  // an unknown model is refused before any request.
  EXPECT_EQ(RunCommand({CliBinary(), "load", "--target", d.target(), "--concurrency", "2",
                        "--duration", "600", "--method", "nosuch"},
                       &out, dir + "/cli6.log"),
            1);
  EXPECT_NE(out.find("load stopped: INVALID_ARGUMENT"), std::string::npos) << out;
  EXPECT_NE(out.find("field method"), std::string::npos) << out;
  std::smatch refused;
  ASSERT_TRUE(std::regex_search(out, refused, std::regex("errors INVALID_ARGUMENT: ([0-9]+)")))
      << out;
  EXPECT_LE(std::stoi(refused[1]), 2) << out;
  EXPECT_EQ(RunCommand({CliBinary(), "load", "--target", d.target(), "--model", "nosuch"}, &out,
                       dir + "/cli7.log"),
            2);
  EXPECT_NE(out.find("--model: the server serves no model 'nosuch' (it serves: fmnist-gpt"),
            std::string::npos)
      << out;
  // Any TLS flag turns TLS on: against this plaintext daemon the call fails, where it used to
  // go out in clear without --tls-ca.
  EXPECT_EQ(RunCommand({CliBinary(), "models", "--target", d.target(), "--tls-server-name",
                        "localhost", "--timeout", "5"},
                       &out, dir + "/cli8.log"),
            1)
      << out;
  // A write that fails (no file size allowed) exits 1 and keeps the file that was there, with
  // no temporary file left; it used to exit 0 with the file emptied.
  std::ofstream(dir + "/keep.png") << "old";
  EXPECT_EQ(RunCommand({"/bin/bash", "-c",
                        // the limit on the CLI only: its output goes through a pipe to a
                        // cat that writes the log
                        "set -o pipefail; (ulimit -f 0; trap '' XFSZ; exec \"$0\" \"$@\") "
                        "2>&1 | cat",
                        CliBinary(), "generate", "--target", d.target(), "--class", "bag", "--seed",
                        "3", "--out", dir + "/keep.png"},
                       &out, dir + "/cli9.log"),
            1)
      << out;
  EXPECT_NE(out.find("keep.png: cannot write"), std::string::npos) << out;
  EXPECT_EQ(Slurp(dir + "/keep.png"), "old");
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(e.path().filename().string().find("keep.png.tmp"), std::string::npos) << e.path();
  }

  ASSERT_EQ(
      RunCommand({"/usr/bin/python3", std::string(SourceDir()) + "/client/python/example_client.py",
                  "--target", d.target(), "--class-name", "trouser", "--seed", "21", "--out",
                  dir + "/trouser.png"},
                 &out, dir + "/py.log", {"PYTHONPATH=" + std::string(PythonStubs())}),
      0)
      << out;
  EXPECT_TRUE(std::regex_search(out, server_id)) << out;
  EXPECT_EQ(ClassifyPng(Slurp(dir + "/trouser.png"), &err), 1) << err;
  EXPECT_NE(
      RunCommand({"/usr/bin/python3", std::string(SourceDir()) + "/client/python/example_client.py",
                  "--target", d.target(), "--model", "nosuch", "--out", dir + "/nosuch.png"},
                 &out, dir + "/py2.log", {"PYTHONPATH=" + std::string(PythonStubs())}),
      0);
  EXPECT_NE(out.find("--model: the server serves no model 'nosuch'"), std::string::npos) << out;
}

// A text-to-image model (Janus layout, random weights, its own tokenizer.json: the t2i_toy
// fixture, tools/make_t2i_toy.py) beside the class-conditional GPT: ListModels describes it; a
// text prompt gives exactly the image its token ids give (the server's tokenizer and template
// match the `tokenizers` package's ids); streams reassemble; concurrent requests of one prompt
// share a prefill; the CLI takes --prompt; bad prompts are named.
TEST(E2eTest, TextPromptsAreTokenizedAsTheTokenizersPackageDoes) {
  const char* t2i = std::getenv("IMAGEGEN_T2I_DIR");
  ASSERT_NE(t2i, nullptr) << "run through ctest (the t2i_toy fixture)";
  const std::string models = TempDir("t2i_models");
  for (const std::string m : {"toy-t2i", "fmnist-vq"}) {
    std::filesystem::create_directory_symlink(
        std::filesystem::canonical(std::string(t2i) + "/" + m), models + "/" + m);
  }
  for (const std::string m : {"fmnist-gpt", "fmnist-draft"}) {
    std::filesystem::create_directory_symlink(std::string(TestModelsDir()) + "/" + m,
                                              models + "/" + m);
  }
  const nlohmann::json expected =
      nlohmann::json::parse(Slurp(std::string(t2i) + "/toy-t2i.expected.json"));
  const std::string prompt = expected["prompt"];
  const std::vector<int32_t> ids = expected["ids"];
  Daemon d("t2i", {"--models-dir", models, "--models", "fmnist-gpt,toy-t2i"});
  d.WaitReady();
  auto stub = d.Stub();
  {
    const v1::ListModelsResponse resp = d.Models();
    ASSERT_EQ(resp.models_size(), 2);
    EXPECT_FALSE(resp.models(0).prompted());
    const v1::ModelInfo& m = resp.models(1);
    EXPECT_TRUE(m.prompted());
    EXPECT_TRUE(m.text_prompts());
    EXPECT_EQ(m.max_prompt_len(), 64);
    EXPECT_EQ(m.classes_size(), 0);
    EXPECT_NE(m.prompt_template().find("{prompt}"), std::string::npos);
  }
  auto generate = [&](const std::function<void(v1::GenerateRequest&)>& edit,
                      v1::GenerateResponse* resp) {
    v1::GenerateRequest req;
    req.set_model("toy-t2i");
    req.set_seed(11);
    req.set_method("sjd");
    req.mutable_output()->set_include_tokens(true);
    edit(req);
    grpc::ClientContext ctx;
    return stub->Generate(&ctx, req, resp);
  };
  v1::GenerateResponse by_text, by_ids;
  ASSERT_TRUE(generate([&](v1::GenerateRequest& r) { r.set_prompt(prompt); }, &by_text).ok());
  ASSERT_TRUE(generate(
                  [&](v1::GenerateRequest& r) {
                    for (int32_t id : ids) r.add_prompt_token_ids(id);
                  },
                  &by_ids)
                  .ok());
  EXPECT_EQ(by_text.stats().prompt_tokens(), static_cast<int32_t>(ids.size()));
  EXPECT_EQ(by_text.tokens_size(), 196);
  EXPECT_EQ(std::vector<int32_t>(by_text.tokens().begin(), by_text.tokens().end()),
            std::vector<int32_t>(by_ids.tokens().begin(), by_ids.tokens().end()));
  EXPECT_EQ(by_text.image_png(), by_ids.image_png());
  EXPECT_GT(by_text.stats().prefill_forwards(), 0);

  // Four streams of the same prompt at once: each reassembles its grid; those that arrive
  // while another runs copy its prefill (prefill_forwards 0).
  std::vector<std::thread> streams;
  std::vector<int64_t> prefills(4, -1);
  std::vector<bool> whole(4, false);
  for (int k = 0; k < 4; ++k) {
    streams.emplace_back([&, k] {
      v1::GenerateRequest req;
      req.set_model("toy-t2i");
      req.set_prompt(prompt);
      req.set_seed(static_cast<uint64_t>(100 + k));
      req.set_method("ar");
      req.mutable_output()->set_include_tokens(true);
      grpc::ClientContext ctx;
      auto reader = stub->GenerateStream(&ctx, req);
      std::vector<int32_t> grid(196, -1);
      v1::GenerateStreamResponse msg;
      while (reader->Read(&msg)) {
        if (msg.has_step()) {
          for (int i = 0; i < msg.step().positions_size(); ++i) {
            grid[static_cast<size_t>(msg.step().positions(i))] = msg.step().tokens(i);
          }
        } else {
          whole[static_cast<size_t>(k)] = grid == std::vector<int32_t>(msg.final().tokens().begin(),
                                                                       msg.final().tokens().end());
          prefills[static_cast<size_t>(k)] = msg.final().stats().prefill_forwards();
        }
      }
      EXPECT_TRUE(reader->Finish().ok());
    });
  }
  for (auto& t : streams) t.join();
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(whole[static_cast<size_t>(k)]) << k;
    EXPECT_GE(prefills[static_cast<size_t>(k)], 0) << k;
  }

  struct Case {
    std::string want;
    std::function<void(v1::GenerateRequest&)> edit;
  };
  const std::vector<Case> cases = {
      {"class_id", [](v1::GenerateRequest& r) { r.set_class_id(1); }},
      {"prompt", [](v1::GenerateRequest&) {}},
      {"prompt_token_ids",
       [&](v1::GenerateRequest& r) {
         r.set_prompt(prompt);
         r.add_prompt_token_ids(1);
       }},
      {"prompt",
       [&](v1::GenerateRequest& r) {
         std::string long_prompt;
         for (int i = 0; i < 20; ++i) long_prompt += prompt + " ";
         r.set_prompt(long_prompt);
       }},
      {"prompt_token_ids", [](v1::GenerateRequest& r) { r.add_prompt_token_ids(100000); }},
      {"prompt_token_ids", [](v1::GenerateRequest& r) { r.add_prompt_token_ids(-1); }},
      {"prompt_token_ids",
       [](v1::GenerateRequest& r) {
         for (int i = 0; i < 65; ++i) r.add_prompt_token_ids(7);
       }},
      {"prompt",
       [&](v1::GenerateRequest& r) {
         r.set_model("fmnist-gpt");
         r.set_prompt(prompt);
       }},
  };
  for (const Case& c : cases) {
    v1::GenerateResponse resp;
    const grpc::Status st = generate(c.edit, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.want;
    google::rpc::BadRequest br;
    ASSERT_NE(Violations(st, &br), nullptr) << c.want << ": " << st.error_message();
    EXPECT_EQ(br.field_violations(0).field(), c.want) << st.error_message();
  }

  const std::string dir = d.dir();
  std::string out;
  ASSERT_EQ(
      RunCommand({CliBinary(), "generate", "--target", d.target(), "--model", "toy-t2i", "--prompt",
                  prompt, "--seed", "11", "--method", "sjd", "--out", dir + "/boot.png"},
                 &out, dir + "/cli.log"),
      0)
      << out;
  EXPECT_NE(out.find("prompt of " + std::to_string(ids.size()) + " tokens"), std::string::npos)
      << out;
  EXPECT_EQ(Slurp(dir + "/boot.png"), by_text.image_png());
  ASSERT_EQ(RunCommand({CliBinary(), "models", "--target", d.target()}, &out, dir + "/cli2.log"),
            0);
  EXPECT_NE(out.find("text-to-image: prompts of at most 64 tokens"), std::string::npos) << out;
  EXPECT_TRUE(d.CallsBalanced());
}

// The daemon as a user starts it (no --models): the bundled text-to-image model beside
// fmnist-gpt, drawing what a typed prompt names; LlamaGen's cfg_interval is taken and reported,
// and a bad one is named.
TEST(E2eTest, TheDefaultDaemonDrawsWhatTheBundledTextModelsPromptNames) {
  Daemon d("bundled_t2i", {}, /*default_models=*/true);
  d.WaitReady();
  auto stub = d.Stub();
  {
    const v1::ListModelsResponse resp = d.Models();
    ASSERT_EQ(resp.models_size(), 2);
    EXPECT_EQ(resp.models(0).name(), "fmnist-gpt");
    EXPECT_EQ(resp.models(1).name(), "fmnist-t2i");
    EXPECT_TRUE(resp.models(1).prompted());
    EXPECT_TRUE(resp.models(1).text_prompts());
  }
  // A request alone runs at most the nodes this machine's step-cost calibration makes fastest
  // for its method, which the daemon says at start. The calibration is measured (or reused) on
  // whatever machine runs the test, loaded or not: with a ceiling of one node scd-mc drafts
  // nothing and takes 196 forwards, with more it speculates. Ceilings of 1-6, 8 and 12 nodes and
  // none all draw the asserted classes for these seeds (a probe on 2026-12-06, nfe 196 down to
  // 36), so the classes do not depend on the calibration.
  const std::string log = d.proc().Log();
  std::smatch said;
  ASSERT_TRUE(std::regex_search(
      log, said,
      std::regex("fmnist-t2i: a request alone runs at most \\(nodes, by the step-cost "
                 "calibration\\):[^\\n]* scd-mc ([0-9]+) of")))
      << log;
  const int lone_nodes = std::stoi(said[1].str());
  ASSERT_GE(lone_nodes, 1);
  // Classes the bundled classifier recognises best; the seeds are fixed, so are the images.
  for (const auto& [prompt, id] : std::vector<std::pair<std::string, int>>{
           {"a pair of trousers", 1}, {"a sandal", 5}, {"a small bag", 8}}) {
    v1::GenerateRequest req;
    req.set_model("fmnist-t2i");
    req.set_prompt(prompt);
    req.set_seed(21);
    req.set_method("scd-mc");
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    ASSERT_TRUE(stub->Generate(&ctx, req, &resp).ok()) << prompt;
    std::string err;
    EXPECT_EQ(ClassifyPng(resp.image_png(), &err), id) << prompt << " " << err;
    if (lone_nodes > 1) {
      EXPECT_LT(resp.stats().nfe(), 196) << prompt << ": at most " << lone_nodes << " nodes";
    } else {
      EXPECT_EQ(resp.stats().nfe(), 196) << prompt << ": one node a step";
    }
    EXPECT_EQ(resp.stats().cfg_interval(), -1);
  }
  v1::GenerateRequest req;
  req.set_model("fmnist-t2i");
  req.set_prompt("a dark coat");
  req.set_cfg_interval(20);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  ASSERT_TRUE(stub->Generate(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.stats().cfg_interval(), 20);
  req.set_cfg_interval(-2);
  grpc::ClientContext bad;
  const grpc::Status st = stub->Generate(&bad, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  google::rpc::BadRequest br;
  ASSERT_NE(Violations(st, &br), nullptr);
  EXPECT_EQ(br.field_violations(0).field(), "cfg_interval");
  EXPECT_TRUE(d.CallsBalanced());
}

// `n` images per request and negative prompts, on the bundled text-to-image model. The images
// of one request copy one prefill and image i is the image its seed (seed + i) draws alone
// (method ar: one token a step whatever the load, so the images are fixed); a stream tags every
// message with its image's index and ends after the last image; the metrics count one call
// and n images; the CLI and the Python client write one file per image. A negative prompt
// steers the image away from what it names: "a bag" with the negative prompt "a light bag" is
// darker than "a bag" alone, and much darker than with "a dark bag" (the brightness the
// training captions name). Bad values are named.
TEST(E2eTest, NImagesShareOnePrefillAndANegativePromptSteersAwayFromWhatItNames) {
  Daemon d("t2i_n", {"--models", "fmnist-t2i", "--max-images", "8"});
  d.WaitReady();
  auto stub = d.Stub();
  EXPECT_EQ(d.Models().max_images(), 8);
  auto request = [](const std::string& prompt, int n, uint64_t seed) {
    v1::GenerateRequest r;
    r.set_model("fmnist-t2i");
    r.set_prompt(prompt);
    r.set_seed(seed);
    r.set_method("ar");
    r.set_n(n);
    r.mutable_output()->set_include_tokens(true);
    return r;
  };
  auto tokens = [](const auto& repeated) {
    return std::vector<int>(repeated.begin(), repeated.end());
  };
  grpc::ClientContext c1;
  v1::GenerateResponse three;
  ASSERT_TRUE(stub->Generate(&c1, request("a sandal", 3, 40), &three).ok());
  ASSERT_EQ(three.more_images_size(), 2);
  const std::vector<const v1::GenerateResponse*> images = {&three, &three.more_images(0),
                                                           &three.more_images(1)};
  int prefilled = 0;
  for (int i = 0; i < 3; ++i) {
    const v1::GenerateResponse& im = *images[static_cast<size_t>(i)];
    EXPECT_EQ(im.index(), i);
    EXPECT_EQ(im.stats().seed(), 40u + static_cast<uint64_t>(i));
    if (i > 0) {
      EXPECT_EQ(im.more_images_size(), 0);
    }
    EXPECT_EQ(im.tokens_size(), 196);
    std::string err;
    EXPECT_EQ(ClassifyPng(im.image_png(), &err), 5) << "image " << i << " " << err;
    prefilled += im.stats().prefill_forwards() > 0 ? 1 : 0;
    grpc::ClientContext c;
    v1::GenerateResponse one;
    ASSERT_TRUE(
        stub->Generate(&c, request("a sandal", 1, 40 + static_cast<uint64_t>(i)), &one).ok());
    EXPECT_EQ(one.index(), 0);
    EXPECT_EQ(tokens(one.tokens()), tokens(im.tokens())) << "image " << i;
  }
  EXPECT_EQ(prefilled, 1) << "the request's images copy the first one's prefill";
  EXPECT_NE(tokens(images[0]->tokens()), tokens(images[1]->tokens()));

  grpc::ClientContext c2;
  auto reader = stub->GenerateStream(&c2, request("a sandal", 2, 50));
  std::vector<std::vector<int>> grids(2, std::vector<int>(196, -1));
  std::set<int> finals;
  v1::GenerateStreamResponse m;
  while (reader->Read(&m)) {
    if (m.has_step()) {
      const int i = m.step().index();
      ASSERT_TRUE(i == 0 || i == 1) << i;
      EXPECT_EQ(finals.count(i), 0u) << "a step of image " << i << " after its final";
      for (int k = 0; k < m.step().positions_size(); ++k) {
        grids[static_cast<size_t>(i)][static_cast<size_t>(m.step().positions(k))] =
            m.step().tokens(k);
      }
    } else {
      const int i = m.final().index();
      EXPECT_TRUE(finals.insert(i).second) << "two finals for image " << i;
      EXPECT_EQ(tokens(m.final().tokens()), grids[static_cast<size_t>(i)]) << "image " << i;
      EXPECT_EQ(m.final().stats().seed(), 50u + static_cast<uint64_t>(i));
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(finals.size(), 2u);
  // 3 + 3 + 2 images in 5 calls.
  EXPECT_TRUE(d.WaitMetric("imagegen_images_total{method=\"ar\",model=\"fmnist-t2i\"}", 8));
  EXPECT_TRUE(d.WaitMetric(
      "imagegen_requests_total{method=\"ar\",model=\"fmnist-t2i\",outcome=\"ok\"}", 5));

  auto brightness = [&](const std::string& negative) {
    v1::GenerateRequest r = request("a bag", 8, 100);
    r.set_negative_prompt(negative);
    grpc::ClientContext c;
    v1::GenerateResponse resp;
    const grpc::Status st = stub->Generate(&c, r, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    std::vector<std::string> pngs = {resp.image_png()};
    for (const auto& more : resp.more_images()) pngs.push_back(more.image_png());
    EXPECT_EQ(pngs.size(), 8u);
    double sum = 0;
    for (const std::string& png : pngs) {
      std::string err;
      const double b = InkBrightness(png, &err);
      EXPECT_GE(b, 0) << err;
      sum += b;
    }
    return sum / static_cast<double>(pngs.size());
  };
  const double plain = brightness(""), not_dark = brightness("a dark bag"),
               not_light = brightness("a light bag");
  std::printf("mean brightness of 8 bags: %.1f alone, %.1f not dark, %.1f not light\n", plain,
              not_dark, not_light);
  // Measured 182.9, 193.6 and 107.8; the margins allow other CPUs' rounding to draw other
  // images of the same distributions.
  EXPECT_LT(not_light, plain - 30);
  EXPECT_GT(not_dark - not_light, 40);

  auto field = [&](const v1::GenerateRequest& r) {
    grpc::ClientContext c;
    v1::GenerateResponse resp;
    const grpc::Status st = stub->Generate(&c, r, &resp);
    google::rpc::BadRequest br;
    return st.error_code() == grpc::StatusCode::INVALID_ARGUMENT && Violations(st, &br) != nullptr
               ? br.field_violations(0).field()
               : "status " + std::to_string(st.error_code());
  };
  EXPECT_EQ(field(request("a bag", 9, 1)), "n");  // --max-images 8
  EXPECT_EQ(field(request("a bag", -1, 1)), "n");
  v1::GenerateRequest r = request("a bag", 1, 1);
  r.set_negative_prompt("a dark bag");
  r.set_cfg_scale(1);  // no guidance row: a negative prompt would change nothing
  EXPECT_EQ(field(r), "negative_prompt");
  r.clear_cfg_scale();
  r.add_negative_prompt_token_ids(1);
  EXPECT_EQ(field(r), "negative_prompt_token_ids");  // both forms
  r.clear_negative_prompt();
  r.add_negative_prompt_token_ids(5000);
  EXPECT_EQ(field(r), "negative_prompt_token_ids");  // ids < 886

  const std::string dir = d.dir();
  std::string out;
  ASSERT_EQ(RunCommand({CliBinary(), "generate", "--target", d.target(), "--model", "fmnist-t2i",
                        "--prompt", "a bag", "--negative-prompt", "a dark bag", "--n", "2",
                        "--stream", "--seed", "3", "--out", dir + "/bag.png"},
                       &out, dir + "/cli.log"),
            0)
      << out;
  EXPECT_TRUE(std::filesystem::exists(dir + "/bag_0.png")) << out;
  EXPECT_TRUE(std::filesystem::exists(dir + "/bag_1.png")) << out;
  ASSERT_EQ(
      RunCommand({"/usr/bin/python3", std::string(SourceDir()) + "/client/python/example_client.py",
                  "--target", d.target(), "--model", "fmnist-t2i", "--prompt", "a sandal", "--n",
                  "2", "--seed", "40", "--out", dir + "/sandal.png"},
                 &out, dir + "/py.log", {"PYTHONPATH=" + std::string(PythonStubs())}),
      0)
      << out;
  EXPECT_TRUE(std::filesystem::exists(dir + "/sandal_1.png")) << out;
  EXPECT_TRUE(d.CallsBalanced());
}

// The HTTP front with the official `openai` package as its client (tests/e2e/openai_sdk_check.py,
// the venv's Python): models.list; images.generate with n = 1 and 4, a size and imagegen's
// options; a stream with partial images; BadRequestError naming the parameter, NotFoundError,
// AuthenticationError (the daemon wants a token); two clients that hang up (a stream, and a
// request for 16 images) are both cancelled and the slots are free. Then, on a daemon with 2 KV
// slots and a queue of 1, RateLimitError with Retry-After. Every HTTP generation is counted as a
// call, opened and closed.
TEST(E2eTest, OpenAiSdkDrawsStreamsAndRaisesItsErrors) {
  const std::string token = TempDir("http_token") + "/token";
  { std::ofstream(token) << "s3cret\n"; }
  const std::string script = std::string(SourceDir()) + "/tests/e2e/openai_sdk_check.py";
  {
    Daemon d("http_api",
             {"--http-listen", "127.0.0.1:0", "--preview-share", "0", "--token-file", token},
             /*default_models=*/true);
    d.WaitReady();
    ASSERT_GT(d.http_port(), 0);
    std::string out;
    EXPECT_EQ(RunCommand({ConfiguredPython(), script, "--base-url",
                          "http://127.0.0.1:" + std::to_string(d.http_port()) + "/v1", "--api-key",
                          "s3cret", "--mode", "api"},
                         &out, d.dir() + "/sdk.log"),
              0)
        << out;
    std::printf("%s", out.c_str());
    EXPECT_TRUE(d.WaitMetric(Requests("ar", "cancelled"), 2));
    EXPECT_TRUE(d.WaitMetric(Slots(), 0));
    EXPECT_TRUE(d.CallsBalanced());
  }
  Daemon d("http_queue", {"--http-listen", "127.0.0.1:0", "--preview-share", "0", "--max-slots",
                          "2", "--max-queue", "1"});
  d.WaitReady();
  std::string out;
  EXPECT_EQ(RunCommand({ConfiguredPython(), script, "--base-url",
                        "http://127.0.0.1:" + std::to_string(d.http_port()) + "/v1", "--mode",
                        "ratelimit"},
                       &out, d.dir() + "/sdk.log"),
            0)
      << out;
  std::printf("%s", out.c_str());
  EXPECT_TRUE(d.WaitMetric(Slots(), 0));
  EXPECT_TRUE(d.CallsBalanced());
}

// The playground page (GET / on the HTTP port) in Debian's headless Chromium, driven by
// Selenium (tests/e2e/playground_check.py): it loads with no console errors and nothing from
// another origin, a generation completes with every cell of the grid decided, the grid
// animates (at least three distinct intermediate frames), the race view reports ar's NFE
// (one per token) and the speculative method's (fewer), and scd-gm's race against ar-gm draws
// the same PNG (sjd's against ar another). Full windows: the goodput controller
// would shrink sjd's window towards ar's on a loaded machine.
TEST(E2eTest, PlaygroundAnimatesAndRacesInChromium) {
  const std::string script = std::string(SourceDir()) + "/tests/e2e/playground_check.py";
  const std::string token = TempDir("playground_key") + "/token";
  { std::ofstream(token) << "s3cret\n"; }
  // Then a daemon with a token: the page asks for the key first (no call fails on the way, so
  // the console stays clean) and then works as without one.
  for (const bool with_token : {false, true}) {
    SCOPED_TRACE(with_token ? "with a token" : "without a token");
    std::vector<std::string> flags = {"--http-listen", "127.0.0.1:0", "--window-policy",
                                      "full",          "--models",    "fmnist-gpt,fmnist-mar"};
    if (with_token) flags.insert(flags.end(), {"--token-file", token});
    Daemon d(with_token ? "playground_token" : "playground", flags);
    d.WaitReady();
    ASSERT_GT(d.http_port(), 0);
    std::vector<std::string> argv = {ConfiguredPython(), script, "--base-url",
                                     "http://127.0.0.1:" + std::to_string(d.http_port())};
    if (with_token) {
      argv.insert(argv.end(), {"--api-key", "s3cret"});
    } else {
      argv.insert(argv.end(), {"--screenshot", d.dir() + "/playground.png"});
    }
    std::string out;
    EXPECT_EQ(RunCommand(argv, &out, d.dir() + "/chromium.log", {}, std::chrono::seconds(900)), 0)
        << out;
    std::printf("%s", out.c_str());
    if (!with_token) {
      // The continuous-token family: cspd against its baseline mar, whose iterations decide
      // several tokens each, so the race says cspd took more forwards (the paper's rule
      // accepts almost no draft: docs/continuous.md).
      std::vector<std::string> mar = {
          ConfiguredPython(), script,
          "--base-url",       "http://127.0.0.1:" + std::to_string(d.http_port()),
          "--model",          "fmnist-mar",
          "--method",         "cspd",
          "--klass",          "trouser"};
      EXPECT_EQ(RunCommand(mar, &out, d.dir() + "/chromium_mar.log", {}, std::chrono::seconds(900)),
                0)
          << out;
      std::printf("%s", out.c_str());
    }
    EXPECT_TRUE(d.WaitMetric(Requests("ar", "ok"), 1));
    EXPECT_TRUE(d.WaitMetric(Requests("sjd", "ok"), 2));
    EXPECT_TRUE(d.WaitMetric(Slots(), 0));
    EXPECT_TRUE(d.CallsBalanced());
  }
}

// The continuous-token family beside the GPT in one daemon: ListModels describes both, the CLI
// streams a cspd image of the requested class, mar is a continuous model's default method, bad
// fields are named, and the metrics count the requests by method.
TEST(E2eTest, MarAndGptServedSideBySideAndCspdStreams) {
  Daemon d("mar", {"--models", "fmnist-gpt,fmnist-mar"});
  d.WaitReady();
  auto stub = d.Stub();
  const v1::ListModelsResponse models = d.Models();
  ASSERT_EQ(models.models_size(), 2);
  const v1::ModelInfo& mar = models.models(1);
  EXPECT_EQ(mar.name(), "fmnist-mar");
  EXPECT_TRUE(mar.continuous());
  EXPECT_FALSE(models.models(0).continuous());
  EXPECT_EQ(mar.token_dim(), 16);  // 2x2 patches of 4-channel latents
  EXPECT_EQ(mar.draft_model(), "fmnist-mar-draft");
  ASSERT_EQ(mar.methods_size(), 2);
  EXPECT_EQ(mar.methods(1), "cspd");

  const std::string dir = d.dir();
  std::string out;
  ASSERT_EQ(RunCommand({CliBinary(), "generate", "--target", d.target(), "--model", "fmnist-mar",
                        "--class", "trouser", "--seed", "5", "--method", "cspd", "--window", "4",
                        // The target draws 90% alone (CPU time: the e2e run covers the
                        // drafting, verification and streaming of the last windows).
                        "--prefill", "0.9", "--stream", "--preview-every", "10", "--preview-dir",
                        dir + "/frames", "--out", dir + "/trouser.png"},
                       &out, dir + "/cli.log"),
            0)
      << out;
  EXPECT_NE(out.find("method cspd"), std::string::npos) << out;
  EXPECT_NE(out.find("49/49"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::is_empty(dir + "/frames"));
  std::string err;
  EXPECT_EQ(ClassifyPng(Slurp(dir + "/trouser.png"), &err), 1) << err;
  // The Python example on the continuous model (method mar, counted below): its steps carry
  // positions, not token ids (it used to fail, finding the grid unassembled).
  ASSERT_EQ(
      RunCommand({"/usr/bin/python3", std::string(SourceDir()) + "/client/python/example_client.py",
                  "--target", d.target(), "--model", "fmnist-mar", "--class-name", "bag", "--seed",
                  "4", "--out", dir + "/bag.png"},
                 &out, dir + "/py.log", {"PYTHONPATH=" + std::string(PythonStubs())}),
      0)
      << out;
  EXPECT_EQ(ClassifyPng(Slurp(dir + "/bag.png"), &err), 8) << err;

  // No method: mar, the continuous model's default (the daemon's default is scd-mc).
  v1::GenerateRequest r = Request("sneaker", 3, "");
  r.set_model("fmnist-mar");
  r.mutable_continuous()->set_num_iter(16);
  grpc::ClientContext c1;
  v1::GenerateResponse resp;
  ASSERT_TRUE(stub->Generate(&c1, r, &resp).ok());
  EXPECT_EQ(resp.stats().method(), "mar");
  EXPECT_EQ(resp.stats().nfe(), 16);
  EXPECT_EQ(resp.tokens_size(), 0);  // continuous tokens are not ids
  EXPECT_EQ(ClassifyPng(resp.image_png(), &err), 7) << err;

  // Fields that do not apply are named.
  google::rpc::BadRequest br;
  for (const auto& [field, edit] : std::vector<std::pair<
           std::string, std::function<void(v1::GenerateRequest&)>>>{{"top_k",
                                                                     [](v1::GenerateRequest& q) {
                                                                       q.set_top_k(5);
                                                                     }},
                                                                    {"continuous.num_iter",
                                                                     [](v1::GenerateRequest& q) {
                                                                       q.mutable_continuous()
                                                                           ->set_num_iter(1000);
                                                                     }},
                                                                    {"continuous.prefill",
                                                                     [](v1::GenerateRequest& q) {
                                                                       q.set_method("cspd");
                                                                       q.mutable_continuous()
                                                                           ->set_prefill(2);
                                                                     }},
                                                                    {"method",
                                                                     [](v1::GenerateRequest& q) {
                                                                       q.set_method("sjd");
                                                                     }}}) {
    v1::GenerateRequest bad = Request("sneaker", 3, "");
    bad.set_model("fmnist-mar");
    edit(bad);
    grpc::ClientContext c;
    grpc::Status st = stub->Generate(&c, bad, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    ASSERT_NE(Violations(st, &br), nullptr) << field << ": " << st.error_message();
    EXPECT_EQ(br.field_violations(0).field(), field) << st.error_message();
  }
  EXPECT_TRUE(d.WaitMetric(
      "imagegen_requests_total{method=\"cspd\",model=\"fmnist-mar\",outcome=\"ok\"}", 1));
  EXPECT_TRUE(d.WaitMetric(
      "imagegen_requests_total{method=\"mar\",model=\"fmnist-mar\",outcome=\"ok\"}", 2));
}

}  // namespace
}  // namespace imagegen::testing
