#include "server/http_util.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

namespace imagegen::server {

MHD_Result HttpReply(MHD_Connection* c, unsigned code, const std::string& body, const char* type,
                     double retry_after, const HttpHeaders& headers) {
  MHD_Response* r = MHD_create_response_from_buffer(body.size(), const_cast<char*>(body.data()),
                                                    MHD_RESPMEM_MUST_COPY);
  if (r == nullptr) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  if (retry_after >= 0) {
    const std::string s = std::to_string(static_cast<int64_t>(std::ceil(retry_after)));
    MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, s.c_str());
  }
  for (const auto& [name, value] : headers) {
    MHD_add_response_header(r, name.c_str(), value.c_str());
  }
  const MHD_Result ok = MHD_queue_response(c, code, r);
  MHD_destroy_response(r);
  return ok;
}

std::string HttpPeer(MHD_Connection* c) {
  const MHD_ConnectionInfo* ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  if (ci == nullptr || ci->client_addr == nullptr) return "";
  char host[INET6_ADDRSTRLEN] = {};
  const sockaddr* a = ci->client_addr;
  if (a->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(a);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    return std::string("ipv4:") + host + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (a->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    return std::string("ipv6:[") + host + "]:" + std::to_string(ntohs(in6->sin6_port));
  }
  return "";
}

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

}  // namespace imagegen::server
