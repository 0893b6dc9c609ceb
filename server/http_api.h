// The HTTP front (issue 18): the OpenAI Images API and the playground page on their own port
// (--http-listen), served by GNU libmicrohttpd (the library of /metrics) on one event-loop
// thread (epoll), so a slow or idle client holds a connection slot, never the thread.
//
//   POST /v1/images/generations   OpenAI's request and response shapes; imagegen's options
//                                 (seed, method, cfg_scale, ...) as extra fields; `stream`
//                                 answers with server-sent events (partial images, then each
//                                 image's completed event)
//   GET  /v1/models               the loaded models and what they accept
//   GET  /, /playground           the playground page (server/playground/, compiled in) and
//                                 its files: the grid drawn live from `stream_steps` events;
//                                 /playground/config says whether the API wants a token
//
// A request goes through the same checks as a gRPC call (ImageGenerationService::Resolve: the
// bearer token, loading and draining, every field) and into the same engine. Errors are
// OpenAI's error JSON with the matching status: 400 naming the parameter, 401, 404, 413, 429
// with Retry-After, 503. While a generation runs its connection is suspended (it holds no
// thread); a watchdog notices a client that hangs up and cancels its images. Engine events are
// turned into PNG, base64 and JSON on the service's encoder pool, never on the engine thread
// or the event loop. Thread-safe.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/util/status.h"
#include "imagegen/v1/imagegen.pb.h"
#include "server/service.h"
#include "server/tls.h"

struct MHD_Daemon;

namespace imagegen::server {

// A POST /v1/images/generations body, as the gRPC request it asks for.
struct ImagesRequest {
  v1::GenerateRequest req;
  bool stream = false;
  bool stream_steps = false;  // stream: an imagegen.step event per engine step (the playground)
  int partial_images = 0;     // stream: partial images per image
  std::string size;           // as echoed: "WxH"
};

// Parses the JSON body against the loaded models (a class-conditional model takes its class
// name as the prompt; `size` picks the PNG's upscaling). On failure returns false with the
// parameter (empty: the body as a whole) and a message. `max_images`: n at most (the
// daemon's --max-images).
bool ParseImagesRequest(const std::string& body, const std::vector<ModelInfo>& models,
                        int max_partial_images, int64_t max_images, ImagesRequest* out,
                        std::string* param, std::string* message);

class HttpApi {
 public:
  static constexpr unsigned kIdleTimeoutSeconds = 30;
  static constexpr unsigned kMaxConnections = 1024;
  static constexpr size_t kMaxBodyBytes = 64 << 10;
  static constexpr int kMaxPartialImages = 8;

  // `address` is host:port (port 0 picks a free one); `service` must outlive the server. With
  // `certificate` (the gRPC port's --tls-cert/--tls-key), the port speaks HTTPS only
  // (libmicrohttpd over GnuTLS).
  static StatusOr<std::unique_ptr<HttpApi>> Start(
      const std::string& address, ImageGenerationService* service,
      std::shared_ptr<const ServerCertificate> certificate = nullptr);
  ~HttpApi();  // Stop(now) if still running

  HttpApi(const HttpApi&) = delete;
  HttpApi& operator=(const HttpApi&) = delete;

  int port() const { return port_; }
  // HTTPS: the certificate for the handshakes that begin from now on (connections already set
  // up keep theirs). GnuTLS does not copy a certificate, and a session may refer to it while it
  // lasts, so one that was replaced stays in memory until every connection accepted before it
  // was replaced has closed (a connection's handshake takes the certificate current then, never
  // an older one). Does nothing on a plain-HTTP server.
  void SetCertificate(std::shared_ptr<const ServerCertificate> certificate);
  // HTTPS: the certificates in memory (the current one and those connections may still use).
  int64_t certificates_held() const;
  // Requests whose connection is still open (the accounting check of the tests).
  int64_t open_requests() const;
  // Waits up to `deadline` for the open requests to be answered, then ends the rest (their
  // images cancelled) and closes the port. Idempotent.
  void Stop(std::chrono::system_clock::time_point deadline);

  struct Shared;  // the state requests share with the server (outlives it while they run)

 private:
  HttpApi() = default;

  std::shared_ptr<Shared> shared_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

}  // namespace imagegen::server
