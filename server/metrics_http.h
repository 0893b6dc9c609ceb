// The /metrics endpoint: prometheus-cpp collectables rendered in the Prometheus text format
// (prometheus-cpp's own TextSerializer), served over HTTP/1.1 by GNU libmicrohttpd.
//
// Why not prometheus-cpp's Exposer: it serves through civetweb, which starts its threads with
// 100 KiB stacks, and glibc refuses stacks smaller than the process's static TLS; LibTorch's
// and cuBLAS's libraries take about 140 KiB of it, so in this process the Exposer cannot start
// ("null context when constructing CivetServer"). libmicrohttpd's threads get the default stack.
//
// One event-loop thread (epoll) serves every connection, so a client that sends slowly or not
// at all holds one connection slot, never the thread: scrapes go on beside 500 such sockets
// (tests/metrics_http_test.cc). A connection idle for `kIdleTimeoutSeconds` is closed; at most
// `kMaxConnections` are open at once; a request header over 32 KiB is refused by the library.
//
// GET /metrics -> 200 with the metrics; GET / -> a pointer to /metrics; other paths 404, other
// methods 405 (HEAD is GET without the body). Thread-safe.
#pragma once

#include <prometheus/collectable.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/util/status.h"

struct MHD_Daemon;

namespace imagegen::server {

class MetricsHttpServer {
 public:
  static constexpr unsigned kIdleTimeoutSeconds = 10;
  static constexpr unsigned kMaxConnections = 1024;

  // `address` is host:port (port 0 picks a free one). The collectables must outlive the server.
  static StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::vector<std::shared_ptr<prometheus::Collectable>> sources);
  ~MetricsHttpServer();  // closes every connection and joins the server's thread

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }
  // The text exposition of every source, as served.
  std::string Render() const;

 private:
  MetricsHttpServer() = default;

  std::vector<std::shared_ptr<prometheus::Collectable>> sources_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

}  // namespace imagegen::server
