// The HTTP API (server/http_api.h) without an engine: how a body becomes a GenerateRequest
// (ParseImagesRequest, every parameter), what the server answers before the models are loaded
// (OpenAI's error shape), and that clients which connect and then send slowly or nothing do not
// stop other requests (the same test as /metrics'); with the bundled model in-process, that a
// failed request counts none of its images. With the daemon and the official SDK:
// tests/e2e/openai_sdk_check.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "server/convert.h"
#include "server/forwarded.h"
#include "server/http_api.h"
#include "server/metrics.h"
#include "server/service.h"
#include "tests/build_paths.h"
#include "tests/http_client.h"

namespace imagegen::testing {
namespace {

using server::ImagesRequest;
using server::ParseImagesRequest;

std::vector<ModelInfo> Models() {
  ModelInfo c;
  c.name = "fmnist-gpt";
  c.image_width = c.image_height = 28;
  c.num_classes = 2;
  c.class_names = {"t-shirt", "bag"};
  ModelInfo t = c;
  t.name = "fmnist-t2i";
  t.num_classes = 0;
  t.class_names.clear();
  t.prompted = true;
  return {c, t};
}

// The parameter an invalid body is refused for ("ok" when it parses).
std::string Refused(const std::string& body, ImagesRequest* out = nullptr) {
  ImagesRequest r;
  std::string param, message;
  const bool ok = ParseImagesRequest(body, Models(), 8, 16, out ? out : &r, &param, &message);
  if (!ok) {
    EXPECT_FALSE(message.empty()) << body;
  }
  return ok ? "ok" : param.empty() ? "(body)" : param;
}

TEST(HttpApiParseTest, BodiesBecomeGenerateRequestsAndBadParametersAreNamed) {
  ImagesRequest r;
  ASSERT_EQ(Refused(R"({"prompt": "bag", "n": 3, "size": "112x112", "seed": 5, "method": "sjd",
                        "cfg_scale": 2.5, "top_k": 10, "top_p": 0.9, "temperature": 0.8,
                        "window": 8, "user": "u", "response_format": "b64_json",
                        "quality": "auto", "background": "opaque", "output_format": "png",
                        "priority": -3})",
                    &r),
            "ok");
  EXPECT_EQ(r.req.class_name(), "bag");  // the first model is class-conditional
  EXPECT_TRUE(r.req.prompt().empty());
  EXPECT_EQ(r.req.n(), 3);
  EXPECT_EQ(r.req.output().scale(), 4);
  EXPECT_EQ(r.size, "112x112");
  EXPECT_EQ(r.req.seed(), 5u);
  EXPECT_EQ(r.req.method(), "sjd");
  EXPECT_DOUBLE_EQ(r.req.cfg_scale(), 2.5);
  EXPECT_EQ(r.req.top_k(), 10);
  EXPECT_EQ(r.req.window(), 8);
  EXPECT_EQ(r.req.user(), "u");  // OpenAI's end-user id: imagegen's fair-share key
  EXPECT_EQ(r.req.priority(), -3);
  EXPECT_FALSE(r.stream);

  ImagesRequest t;
  ASSERT_EQ(Refused(R"({"model": "fmnist-t2i", "prompt": "a dark bag", "stream": true,
                        "partial_images": 2, "negative_prompt": "a light bag",
                        "cfg_interval": 3})",
                    &t),
            "ok");
  EXPECT_EQ(t.req.prompt(), "a dark bag");  // a text-to-image model: the prompt itself
  EXPECT_EQ(t.req.negative_prompt(), "a light bag");
  EXPECT_EQ(t.req.cfg_interval(), 3);
  EXPECT_TRUE(t.stream);
  EXPECT_EQ(t.partial_images, 2);
  EXPECT_FALSE(t.stream_steps);
  EXPECT_EQ(t.size, "28x28");
  ImagesRequest steps;
  ASSERT_EQ(Refused(R"({"prompt": "bag", "stream": true, "stream_steps": true})", &steps), "ok");
  EXPECT_TRUE(steps.stream_steps);
  EXPECT_EQ(t.req.output().scale(), 1);
  // An unknown model parses (the engine answers 404 naming it).
  EXPECT_EQ(Refused(R"({"model": "dall-e-3", "prompt": "x"})"), "ok");

  EXPECT_EQ(Refused("not json"), "(body)");
  EXPECT_EQ(Refused("[1, 2]"), "(body)");
  EXPECT_EQ(Refused(R"({"n": 2})"), "prompt");
  EXPECT_EQ(Refused(R"({"prompt": 7})"), "prompt");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "n": "2"})"), "n");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "n": 0})"), "n");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "n": 1.5})"), "n");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "seed": -1})"), "seed");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "cfg_scale": "high"})"), "cfg_scale");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "size": "1024x1024"})"), "size");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "size": "56x28"})"), "size");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "size": "auto"})"), "ok");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "response_format": "url"})"), "response_format");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "output_format": "jpeg"})"), "output_format");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "background": "transparent"})"), "background");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "quality": "hd"})"), "quality");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "stream": "yes"})"), "stream");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "partial_images": 2})"), "partial_images");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "stream": true, "partial_images": 9})"), "partial_images");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "stream_steps": true})"), "stream_steps");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "stream": true, "stream_steps": 1})"), "stream_steps");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "style": "vivid"})"), "style");  // unknown
  {
    // Upscaled images are at most 4096 px a side (kMaxOutputSide): a 384-px model goes to 10x,
    // a 28-px one to 16x.
    std::vector<ModelInfo> big = Models();
    big[0].image_width = big[0].image_height = 384;
    EXPECT_EQ(server::MaxScale(big[0]), 10);
    EXPECT_EQ(server::MaxScale(Models()[0]), 16);
    ImagesRequest r;
    std::string param, message;
    EXPECT_TRUE(ParseImagesRequest(R"({"prompt": "bag", "size": "3840x3840"})", big, 8, 16, &r,
                                   &param, &message))
        << message;
    EXPECT_EQ(r.req.output().scale(), 10);
    EXPECT_FALSE(ParseImagesRequest(R"({"prompt": "bag", "size": "4224x4224"})", big, 8, 16, &r,
                                    &param, &message));
    EXPECT_EQ(param, "size");
    EXPECT_NE(message.find("up to 10x"), std::string::npos) << message;
  }
  {
    // An unknown name is echoed at most 64 bytes long, in the message and in `param`; n's bound
    // is the server's --max-images (16 here), not the parser's own.
    ImagesRequest r;
    std::string param, message;
    const std::string body = R"({"prompt": "bag", ")" + std::string(3000, 'k') + R"(": 1})";
    ASSERT_FALSE(ParseImagesRequest(body, Models(), 8, 16, &r, &param, &message));
    EXPECT_LE(param.size(), 64u);
    EXPECT_LT(message.size(), 600u) << message;
    EXPECT_NE(message.find("(3000 bytes)"), std::string::npos) << message;
    ASSERT_FALSE(
        ParseImagesRequest(R"({"prompt": "bag", "n": 17})", Models(), 8, 16, &r, &param, &message));
    EXPECT_EQ(param, "n");
    EXPECT_NE(message.find("[1, 16]"), std::string::npos) << message;
  }
  EXPECT_EQ(Refused(R"({"prompt": "bag", "priority": 0.5})"), "priority");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "priority": 3000000000})"), "priority");
  EXPECT_EQ(Refused(R"({"prompt": "bag", "user": 12})"), "user");
}

// Who a request is for, the engine's fair-share key: its user, else the caller's host (gRPC's
// peer names and HttpPeer's, without the port: one machine's connections are one client; one
// spelling per address, so gRPC's escaped IPv6 peers and HttpPeer's are one client, and two
// IPv6 hosts two).
TEST(HttpApiParseTest, TheClientIsTheUserElseThePeersHost) {
  const server::TrustedProxies none;
  auto client = [&](const std::string& user, const std::string& peer) {
    return server::ClientOf(user, none.ClientAddress(peer, ""));
  };
  EXPECT_EQ(client("alice", "ipv4:10.0.0.7:51234"), "user:alice");
  EXPECT_EQ(client("", "ipv4:10.0.0.7:51234"), "ipv4:10.0.0.7");
  EXPECT_EQ(client("", "ipv4:10.0.0.7:40000"), client("", "ipv4:10.0.0.7:51234"));
  EXPECT_EQ(client("", "ipv6:[::1]:51234"), "ipv6:[::1]");
  EXPECT_EQ(client("", "ipv6:%5B::1%5D:51234"), "ipv6:[::1]");  // gRPC's escaping
  EXPECT_EQ(client("", "ipv6:%5B::1%5D"), "ipv6:[::1]");
  EXPECT_EQ(client("", "ipv6:[::1]"), "ipv6:[::1]");
  EXPECT_EQ(client("", "ipv6:[::ffff:10.0.0.7]:1"), "ipv4:10.0.0.7");
  EXPECT_NE(client("", "ipv6:%5B::1%5D:51234"), client("", "ipv6:%5B::2%5D:51234"));
  EXPECT_NE(client("", "ipv6:%5B2001:db8::5%5D:1"), client("", "ipv6:%5B2001:db8::6%5D:1"));
  EXPECT_EQ(client("", "unix:/run/imagegen.sock"), "unix:/run/imagegen.sock");
  EXPECT_EQ(client("", ""), "");
  // A user that looks like an address is still a user.
  EXPECT_NE(client("ipv4:10.0.0.7", "ipv4:10.0.0.8:1"), client("", "ipv4:10.0.0.7:1"));
}

class HttpApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = server::HttpApi::Start("127.0.0.1:0", &service_);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    api_ = std::move(s).value();
    ASSERT_GT(api_->port(), 0);
  }

  server::Metrics metrics_;
  server::ImageGenerationService service_{&metrics_, server::TokenAuth(), server::ServiceOptions()};
  std::unique_ptr<server::HttpApi> api_;
};

// Before the models are loaded every route answers at once, in OpenAI's error shape.
TEST_F(HttpApiTest, AnswersInOpenAiErrorShapeWhileTheModelsLoad) {
  const std::string models = Fetch(api_->port(), "GET /v1/models HTTP/1.0\r\n\r\n");
  EXPECT_NE(models.find(" 503 "), std::string::npos) << models;
  EXPECT_NE(models.find(R"("message":"models are loading")"), std::string::npos) << models;
  const std::string body = R"({"prompt": "bag"})";
  const std::string gen =
      Fetch(api_->port(), "POST /v1/images/generations HTTP/1.0\r\nContent-Length: " +
                              std::to_string(body.size()) + "\r\n\r\n" + body);
  EXPECT_NE(gen.find(" 503 "), std::string::npos) << gen;
  EXPECT_NE(gen.find(R"("type":"server_error")"), std::string::npos) << gen;
  const std::string nope = Fetch(api_->port(), "GET /v1/nope HTTP/1.0\r\n\r\n");
  EXPECT_NE(nope.find(" 404 "), std::string::npos) << nope;
  EXPECT_NE(nope.find(R"("error":)"), std::string::npos) << nope;
  const std::string get = Fetch(api_->port(), "GET /v1/images/generations HTTP/1.0\r\n\r\n");
  EXPECT_NE(get.find(" 405 "), std::string::npos) << get;
  EXPECT_EQ(api_->open_requests(), 0);
}

// The playground's files are served while the models load (the page says so itself), with a
// Content-Security-Policy that lets it load this server's files only, and no token.
TEST_F(HttpApiTest, ServesThePlaygroundPageAndItsFiles) {
  for (const char* path : {"/", "/playground"}) {
    const std::string page = Fetch(api_->port(), std::string("GET ") + path + " HTTP/1.0\r\n\r\n");
    EXPECT_NE(page.find(" 200 "), std::string::npos) << page;
    EXPECT_NE(page.find("Content-Type: text/html; charset=utf-8"), std::string::npos) << page;
    EXPECT_NE(page.find("Content-Security-Policy: default-src 'self'"), std::string::npos) << page;
    EXPECT_NE(page.find(R"(<script src="playground.js")"), std::string::npos) << page;
  }
  const std::string js = Fetch(api_->port(), "GET /playground.js HTTP/1.0\r\n\r\n");
  EXPECT_NE(js.find("Content-Type: text/javascript"), std::string::npos) << js.substr(0, 300);
  EXPECT_NE(js.find("imagegen.step"), std::string::npos);
  const std::string css = Fetch(api_->port(), "GET /playground.css HTTP/1.0\r\n\r\n");
  EXPECT_NE(css.find("Content-Type: text/css"), std::string::npos) << css.substr(0, 300);
  const std::string config = Fetch(api_->port(), "GET /playground/config HTTP/1.0\r\n\r\n");
  EXPECT_NE(config.find(R"({"auth_required":false})"), std::string::npos) << config;
  const std::string post = Fetch(api_->port(), "POST / HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
  EXPECT_NE(post.find(" 405 "), std::string::npos) << post;
  EXPECT_EQ(api_->open_requests(), 0);
}

// 500 sockets hold connections open: half sent part of a request line and then nothing, half
// trickle one byte every 200 ms. Ten requests in a row are all answered (each within 30 s).
TEST_F(HttpApiTest, SlowAndSilentClientsDoNotStopOthers) {
  constexpr int kSlow = 500;
  std::vector<int> fds;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = Connect(api_->port());
    ASSERT_GE(fd, 0) << "connect " << i;
    SendAll(fd, "POST /v1/images/gen");
    fds.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    while (!stop.load()) {
      for (int i = 0; i < kSlow; i += 2) SendAll(fds[static_cast<size_t>(i)], "e");
      for (int k = 0; k < 4 && !stop.load(); ++k) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  });
  int answered = 0;
  for (int i = 0; i < 10; ++i) {
    const std::string r = Fetch(api_->port(), "GET /v1/models HTTP/1.0\r\n\r\n");
    if (r.find(R"("error":)") != std::string::npos) ++answered;
  }
  stop.store(true);
  trickle.join();
  EXPECT_EQ(answered, 10);
  for (int fd : fds) ::close(fd);
}

// The bundled class-conditional model served in-process (engine, metrics, service and the HTTP
// API on a free port), for the tests that need generation. Members end in reverse order: the
// HTTP API first, the engine last.
struct Served {
  std::unique_ptr<Engine> engine;
  server::Metrics metrics;
  std::unique_ptr<server::ImageGenerationService> service;
  std::unique_ptr<server::HttpApi> api;
};

std::unique_ptr<Served> Serve(EngineListener* listener,
                              std::shared_ptr<std::atomic<int64_t>> fail_steps) {
  EngineOptions eo;
  eo.models_dir = TestModelsDir();
  eo.models = {"fmnist-gpt"};
  eo.fixed_step_cost = {0.01, 1e-4, 1e-3};
  eo.warmup = 0;
  eo.cpu_threads = 1;
  eo.fail_steps = std::move(fail_steps);
  auto engine = Engine::Start(eo, listener);
  if (!engine.ok()) {
    ADD_FAILURE() << engine.status().ToString();
    return nullptr;
  }
  auto s = std::make_unique<Served>();
  s->engine = std::move(*engine);
  s->metrics.SetEngine(s->engine.get());
  s->service = std::make_unique<server::ImageGenerationService>(&s->metrics, server::TokenAuth(),
                                                                server::ServiceOptions());
  if (Status st = s->service->SetEngine(s->engine.get()); !st.ok()) {
    ADD_FAILURE() << st.ToString();
    return nullptr;
  }
  auto api = server::HttpApi::Start("127.0.0.1:0", s->service.get());
  if (!api.ok()) {
    ADD_FAILURE() << api.status().ToString();
    return nullptr;
  }
  s->api = std::move(*api);
  return s;
}

// A body over the 64 KiB limit is refused as soon as that is known: from its Content-Length,
// answered before any of it is read; a chunked one, by closing the connection once it passes
// the limit. Both used to be read to their last byte (a client could hold the connection by
// trickling a "terabyte"). And a request still
// sending its body does not hold the drain for the whole grace: only generation requests do.
TEST(HttpApiEngineTest,
     OversizedBodiesAreRefusedBeforeTheyAreReadAndHalfSentOnesDoNotHoldTheDrain) {
  std::unique_ptr<Served> served = Serve(nullptr, nullptr);
  ASSERT_NE(served, nullptr);
  std::unique_ptr<server::HttpApi>& api_ = served->api;
  const std::string announced =
      "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: 1000000000000\r\n\r\n{\"prompt\": ";
  const std::string chunk(8192, 'x');
  std::string chunked =
      "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 9; ++i) chunked += "2000\r\n" + chunk + "\r\n";  // 72 KiB, no last chunk
  for (const bool by_length : {true, false}) {
    const std::string& request = by_length ? announced : chunked;
    SCOPED_TRACE(by_length ? "Content-Length" : "chunked");
    const int fd = Connect(api_->port());
    ASSERT_GE(fd, 0);
    SendAll(fd, request);  // and nothing more: the rest of the body never comes
    bool closed = false;
    const std::string r = ReadUntilClosed(fd, std::chrono::seconds(20), &closed);
    ::close(fd);
    EXPECT_TRUE(closed);
    if (by_length) {  // answered, naming the limit
      EXPECT_NE(r.find("HTTP/1.1 400"), std::string::npos) << r.substr(0, 300);
      EXPECT_NE(r.find("65536 bytes"), std::string::npos) << r.substr(0, 600);
    } else {  // libmicrohttpd cannot answer mid-body: closed once the limit is passed
      EXPECT_EQ(r, "");
    }
  }
  // An unknown parameter's long name, cut for the echo: it was cut inside a UTF-8 character,
  // and the error's JSON threw out of the HTTP thread (std::terminate).
  std::string utf8_key;
  for (int i = 0; i < 40; ++i) utf8_key += "\xc3\xa9";  // é
  const std::string utf8_body = R"({"prompt": "bag", ")" + utf8_key + R"(": 1})";
  const std::string refused = Fetch(api_->port(),
                                    "POST /v1/images/generations HTTP/1.0\r\n"
                                    "Content-Length: " +
                                        std::to_string(utf8_body.size()) + "\r\n\r\n" + utf8_body);
  EXPECT_NE(refused.find(" 400 "), std::string::npos) << refused.substr(0, 300);
  EXPECT_NE(refused.find("unknown parameter"), std::string::npos) << refused.substr(0, 600);
  // A request that sent half its body, then nothing: Stop with a minute's grace returns at once.
  const int fd = Connect(api_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{");
  for (int i = 0; i < 200 && api_->open_requests() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(api_->open_requests(), 1);
  const auto t0 = std::chrono::steady_clock::now();
  api_->Stop(std::chrono::system_clock::now() + std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  ::close(fd);
}

// With the engine (in-process, the bundled model): a unary request whose second image fails
// after its first finished answers 500 and counts no image. The first image used to be counted
// (imagegen_images_total, the key's usage, the request log) when it was encoded, although the
// client never got it; gRPC counts an image only when it goes out.
TEST(HttpApiEngineTest, AFailedRequestCountsNoneOfItsImages) {
  // Once a step holds fewer requests than the most it held (an image finished), every later
  // step fails: the other image ends INTERNAL.
  class FailAfterFirstImage : public EngineListener {
   public:
    explicit FailAfterFirstImage(std::shared_ptr<std::atomic<int64_t>> fail) : fail_(fail) {}
    void OnStep(const StepSample& s) override {
      most_ = std::max(most_, s.requests);
      if (s.requests < most_) fail_->store(1 << 20);
    }

   private:
    std::shared_ptr<std::atomic<int64_t>> fail_;
    int64_t most_ = 0;
  };
  auto fail = std::make_shared<std::atomic<int64_t>>(0);
  FailAfterFirstImage listener(fail);
  std::unique_ptr<Served> served = Serve(&listener, fail);
  ASSERT_NE(served, nullptr);
  // scd-mc: the two images (seeds 5 and 6) take different numbers of steps.
  const std::string body =
      R"({"model": "fmnist-gpt", "prompt": "bag", "n": 2, "seed": 5, "method": "scd-mc"})";
  const std::string r = Fetch(served->api->port(),
                              "POST /v1/images/generations HTTP/1.0\r\n"
                              "Content-Type: application/json\r\n"
                              "Content-Length: " +
                                  std::to_string(body.size()) + "\r\n\r\n" + body);
  ASSERT_NE(r.find(" 500 "), std::string::npos) << r.substr(0, 300);
  EXPECT_EQ(r.find("b64_json"), std::string::npos);
  served->api->Stop(std::chrono::system_clock::now());
  served->engine->Shutdown(std::chrono::milliseconds(0));
  EXPECT_EQ(served->engine->Stats().completed, 1) << "the first image did finish in the engine";
  int64_t counted = 0;
  for (const auto& [model, totals] : served->metrics.Totals()) counted += totals.images;
  EXPECT_EQ(counted, 0);
}

}  // namespace
}  // namespace imagegen::testing
