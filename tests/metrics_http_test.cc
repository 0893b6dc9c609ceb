// The /metrics HTTP server (server/metrics_http.h) on loopback: what it answers, and that
// clients which connect and then send slowly or nothing do not stop scrapes (the hand-written
// server it replaced served one connection at a time and waited 5 s per silent socket, so 500
// of them held a scrape for about 40 minutes).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "server/metrics.h"
#include "server/metrics_http.h"
#include "tests/http_client.h"

namespace imagegen::testing {
namespace {

using server::MetricsHttpServer;
using Clock = std::chrono::steady_clock;

std::string Scrape(int port) { return Fetch(port, "GET /metrics HTTP/1.0\r\n\r\n"); }

class MetricsHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_ = std::make_shared<prometheus::Registry>();
    prometheus::BuildCounter()
        .Name("imagegen_test_total")
        .Help("A counter for the test.")
        .Register(*registry_)
        .Add({{"kind", "x"}})
        .Increment(3);
    auto s = MetricsHttpServer::Start("127.0.0.1:0", {registry_});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(s).value();
    ASSERT_GT(server_->port(), 0);
  }

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpTest, ServesMetricsAndRefusesOtherPathsAndMethods) {
  const std::string m = Scrape(server_->port());
  EXPECT_EQ(m.rfind("HTTP/1.0 200", 0) == 0 || m.rfind("HTTP/1.1 200", 0) == 0, true) << m;
  EXPECT_NE(m.find("text/plain; version=0.0.4"), std::string::npos) << m;
  EXPECT_NE(m.find("imagegen_test_total{kind=\"x\"} 3"), std::string::npos) << m;
  EXPECT_EQ(m.substr(m.find("\r\n\r\n") + 4), server_->Render());

  const std::string q = Fetch(server_->port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n");
  EXPECT_NE(q.find("imagegen_test_total"), std::string::npos) << q;
  const std::string head = Fetch(server_->port(), "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_NE(head.find(" 200 "), std::string::npos) << head;
  EXPECT_EQ(head.find("imagegen_test_total"), std::string::npos) << head;
  EXPECT_NE(Fetch(server_->port(), "GET /nope HTTP/1.0\r\n\r\n").find(" 404 "), std::string::npos);
  EXPECT_NE(Fetch(server_->port(), "POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc")
                .find(" 405 "),
            std::string::npos);
  // Not HTTP: no metrics (the library closes the connection).
  EXPECT_EQ(Fetch(server_->port(), "GARBAGE\r\n\r\n").find("imagegen_test_total"),
            std::string::npos);
}

// 500 sockets hold connections open: half sent part of a request line and then nothing, half
// trickle one byte every 200 ms. Ten scrapes in a row all complete (the limit per scrape is
// 30 s; the old server needed 5 s per silent socket ahead of it).
TEST_F(MetricsHttpTest, SlowAndSilentClientsDoNotStopScrapes) {
  constexpr int kSlow = 500;
  std::vector<int> fds;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = Connect(server_->port());
    ASSERT_GE(fd, 0) << "connect " << i;
    SendAll(fd, "GET /metr");
    fds.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    while (!stop.load()) {
      for (int i = 0; i < kSlow; i += 2) SendAll(fds[i], "i");
      for (int k = 0; k < 4 && !stop.load(); ++k) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  });
  int ok = 0;
  for (int i = 0; i < 10; ++i) {
    if (Scrape(server_->port()).find("imagegen_test_total") != std::string::npos) ++ok;
  }
  stop.store(true);
  trickle.join();
  EXPECT_EQ(ok, 10);
  for (int fd : fds) ::close(fd);
}

// A connection that sends nothing is closed by the server after its idle timeout.
TEST_F(MetricsHttpTest, IdleConnectionIsClosed) {
  const int fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  bool closed = false;
  ReadUntilClosed(fd, std::chrono::seconds(MetricsHttpServer::kIdleTimeoutSeconds + 30), &closed);
  EXPECT_TRUE(closed);
  ::close(fd);
}

TEST(MetricsHttpStartTest, BadAddressesAreErrors) {
  EXPECT_FALSE(MetricsHttpServer::Start("no-port", {}).ok());
  EXPECT_FALSE(MetricsHttpServer::Start("256.1.1.1:0", {}).ok());
  auto a = MetricsHttpServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(a.ok());
  auto b = MetricsHttpServer::Start("127.0.0.1:" + std::to_string((*a)->port()), {});
  EXPECT_FALSE(b.ok());  // the port is taken
}

// A failed CUDA graph capture leaves its bucket without a graph until the restart: one in the
// start-up warm-up counts as a served step's does (the alert reads this counter), while the
// warm-up's steps themselves are not served steps and count nowhere else. Before, the warm-up
// (where most captures happen) dropped them.
TEST(MetricsTest, WarmupCaptureFailuresCountAndTheirStepsDoNot) {
  server::Metrics m;
  StepSample s;
  s.model = "m";
  s.seconds = 0.1;
  s.graph_capture_failures = 2;
  m.OnWarmupStep(s);
  s.graph_capture_failures = 1;
  m.OnStep(s);
  const std::string text = prometheus::TextSerializer().Serialize(m.registry()->Collect());
  EXPECT_NE(text.find("imagegen_cuda_graph_capture_failures_total{model=\"m\"} 3"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("imagegen_engine_steps_total{model=\"m\"} 1"), std::string::npos) << text;
}

// The engine thread's run-queue wait: counted over the steps that have a reading, and in the
// stats line's totals with those steps' time, so that the share leaves out steps without one.
TEST(MetricsTest, CpuWaitCountsTheStepsWithAReading) {
  server::Metrics m;
  StepSample s;
  s.model = "m";
  s.seconds = 0.4;
  s.cpu_wait_seconds = 0.1;
  m.OnStep(s);
  s.cpu_wait_seconds = 0.3;
  m.OnStep(s);
  s.cpu_wait_seconds = -1;  // unknown
  m.OnStep(s);
  const std::string text = prometheus::TextSerializer().Serialize(m.registry()->Collect());
  EXPECT_NE(text.find("imagegen_engine_cpu_wait_seconds_total{model=\"m\"} 0.4"), std::string::npos)
      << text;
  const server::WorkTotals t = m.Totals().at("m");
  EXPECT_EQ(t.cpu_wait_steps, 2);
  EXPECT_DOUBLE_EQ(t.cpu_wait_seconds, 0.4);
  EXPECT_NEAR(*t.CpuWaitShare(), 0.5, 1e-12);  // of 0.8 s, not of all three steps' 1.2
}

}  // namespace
}  // namespace imagegen::testing
