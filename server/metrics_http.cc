#include "server/metrics_http.h"

#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <prometheus/text_serializer.h>

#include <cerrno>
#include <cstring>

namespace imagegen::server {
namespace {

MHD_Result Reply(MHD_Connection* c, unsigned code, const char* type, const std::string& body) {
  MHD_Response* r = MHD_create_response_from_buffer(body.size(), const_cast<char*>(body.data()),
                                                    MHD_RESPMEM_MUST_COPY);
  if (r == nullptr) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  const MHD_Result ok = MHD_queue_response(c, code, r);
  MHD_destroy_response(r);
  return ok;
}

// libmicrohttpd's request handler. A body (a POST's) is refused before it is read.
MHD_Result Handle(void* cls, MHD_Connection* c, const char* url, const char* method,
                  const char* /*version*/, const char* /*upload_data*/,
                  size_t* /*upload_data_size*/, void** /*con_cls*/) {
  const auto* server = static_cast<const MetricsHttpServer*>(cls);
  if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0 &&
      std::strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
    return Reply(c, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
  }
  const std::string path = url;  // the library strips the query string
  if (path == "/metrics") {
    return Reply(c, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", server->Render());
  }
  if (path == "/") return Reply(c, MHD_HTTP_OK, "text/plain", "imagegen metrics: GET /metrics\n");
  return Reply(c, MHD_HTTP_NOT_FOUND, "text/plain", "not found; metrics are at /metrics\n");
}

}  // namespace

StatusOr<int> ListenTcp(const std::string& address, int* port) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return InvalidArgument("the address must be host:port");
  std::string host = address.substr(0, colon);
  const std::string service = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
      rc != 0) {
    return InvalidArgument("address " + address + ": " + ::gai_strerror(rc));
  }
  int fd = -1;
  std::string err = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (s < 0) continue;
    const int one = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s, a->ai_addr, a->ai_addrlen) == 0 && ::listen(s, 128) == 0) {
      fd = s;
      break;
    }
    err = std::strerror(errno);
    ::close(s);
  }
  ::freeaddrinfo(res);
  if (fd < 0) return Unavailable("cannot listen on " + address + ": " + err);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  *port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return fd;
}

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
