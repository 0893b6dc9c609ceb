// The /metrics endpoint: a small HTTP/1.1 server that renders prometheus-cpp collectables in the
// Prometheus text format (prometheus-cpp's own TextSerializer).
//
// Why not prometheus-cpp's Exposer: it serves through civetweb, which starts its threads with
// 100 KiB stacks, and glibc refuses stacks smaller than the process's static TLS; LibTorch's
// and cuBLAS's libraries take about 140 KiB of it, so in this process the Exposer cannot start
// ("null context when constructing CivetServer"). This server's one thread has a default stack.
//
// GET /metrics -> 200 with the metrics; GET / -> a pointer to /metrics; other paths 404, other
// methods 405. One connection at a time (Prometheus scrapes a few times a minute), closed after
// each response; a client that sends nothing for 5 s is dropped. Thread-safe.
#pragma once

#include <prometheus/collectable.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/util/status.h"

namespace imagegen::server {

class MetricsHttpServer {
 public:
  // `address` is host:port (port 0 picks a free one). The collectables must outlive the server.
  static StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::vector<std::shared_ptr<prometheus::Collectable>> sources);
  ~MetricsHttpServer();  // stops accepting and joins the thread

  int port() const { return port_; }
  // The text exposition of every source, as served.
  std::string Render() const;

 private:
  MetricsHttpServer() = default;
  void Serve();
  void Handle(int fd) const;

  std::vector<std::shared_ptr<prometheus::Collectable>> sources_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace imagegen::server
