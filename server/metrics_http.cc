#include "server/metrics_http.h"

#include <microhttpd.h>
#include <unistd.h>

#include <prometheus/text_serializer.h>

#include <cstring>

#include "server/http_util.h"

namespace imagegen::server {
namespace {

// libmicrohttpd's request handler. A body (a POST's) is refused before it is read.
MHD_Result Handle(void* cls, MHD_Connection* c, const char* url, const char* method,
                  const char* /*version*/, const char* /*upload_data*/,
                  size_t* /*upload_data_size*/, void** /*con_cls*/) {
  const auto* server = static_cast<const MetricsHttpServer*>(cls);
  if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0 &&
      std::strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
    return HttpReply(c, MHD_HTTP_METHOD_NOT_ALLOWED, "GET only\n", "text/plain");
  }
  const std::string path = url;  // the library strips the query string
  if (path == "/metrics") {
    return HttpReply(c, MHD_HTTP_OK, server->Render(), "text/plain; version=0.0.4; charset=utf-8");
  }
  if (path == "/")
    return HttpReply(c, MHD_HTTP_OK, "imagegen metrics: GET /metrics\n", "text/plain");
  return HttpReply(c, MHD_HTTP_NOT_FOUND, "not found; metrics are at /metrics\n", "text/plain");
}

}  // namespace

StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::vector<std::shared_ptr<prometheus::Collectable>> sources) {
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->sources_ = std::move(sources);
  ASSIGN_OR_RETURN(const int fd, ListenTcp(address, &s->port_));
  // The library owns the socket from here (MHD_stop_daemon closes it).
  s->daemon_ = MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD, 0, nullptr, nullptr, &Handle, s.get(),
                                MHD_OPTION_LISTEN_SOCKET, static_cast<MHD_socket>(fd),
                                MHD_OPTION_CONNECTION_TIMEOUT, kIdleTimeoutSeconds,
                                MHD_OPTION_CONNECTION_LIMIT, kMaxConnections, MHD_OPTION_END);
  if (s->daemon_ == nullptr) {
    ::close(fd);
    return Unavailable("cannot start the metrics HTTP server on " + address);
  }
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

std::string MetricsHttpServer::Render() const {
  std::vector<prometheus::MetricFamily> families;
  for (const auto& src : sources_) {
    auto f = src->Collect();
    families.insert(families.end(), std::make_move_iterator(f.begin()),
                    std::make_move_iterator(f.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace imagegen::server
