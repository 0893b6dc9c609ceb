#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <prometheus/text_serializer.h>

#include <cstring>

namespace imagegen::server {
namespace {

void WriteAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

std::string Response(int code, const char* reason, const std::string& type,
                     const std::string& body) {
  return "HTTP/1.1 " + std::to_string(code) + " " + reason + "\r\nContent-Type: " + type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" +
         body;
}

}  // namespace

StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::vector<std::shared_ptr<prometheus::Collectable>> sources) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return InvalidArgument("metrics address must be host:port");
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
      rc != 0) {
    return InvalidArgument("metrics address " + address + ": " + ::gai_strerror(rc));
  }
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->sources_ = std::move(sources);
  std::string err = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      s->listen_fd_ = fd;
      break;
    }
    err = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (s->listen_fd_ < 0) return Unavailable("cannot listen on " + address + ": " + err);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  MetricsHttpServer* raw = s.get();
  s->thread_ = std::thread([raw] { raw->Serve(); });
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
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

void MetricsHttpServer::Serve() {
  while (!stop_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;  // wakes up to notice stop_
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Handle(fd);
    ::close(fd);
  }
}

void MetricsHttpServer::Handle(int fd) const {
  std::string req;
  char buf[2048];
  while (req.find("\r\n\r\n") == std::string::npos && req.size() < 16384) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) return;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    req.append(buf, static_cast<size_t>(n));
  }
  const auto line_end = req.find("\r\n");
  const std::string line = req.substr(0, line_end);
  const auto sp1 = line.find(' '), sp2 = line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos) {
    WriteAll(fd, Response(400, "Bad Request", "text/plain", "bad request\n"));
    return;
  }
  const std::string method = line.substr(0, sp1);
  std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  if (method != "GET" && method != "HEAD") {
    WriteAll(fd, Response(405, "Method Not Allowed", "text/plain", "GET only\n"));
    return;
  }
  std::string resp;
  if (path == "/metrics") {
    resp = Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", Render());
  } else if (path == "/") {
    resp = Response(200, "OK", "text/plain", "imagegen metrics: GET /metrics\n");
  } else {
    resp = Response(404, "Not Found", "text/plain", "not found; metrics are at /metrics\n");
  }
  if (method == "HEAD") resp = resp.substr(0, resp.find("\r\n\r\n") + 4);
  WriteAll(fd, resp);
}

}  // namespace imagegen::server
