// Raw HTTP/1.x over loopback sockets for the tests of the daemon's HTTP servers (/metrics and
// the OpenAI Images API): connect, send, read until the server closes. Blocking; one socket per
// call.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

namespace imagegen::testing {

inline int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

inline void SendAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// Reads until the peer closes or `limit` passes; returns what came.
inline std::string ReadUntilClosed(int fd, std::chrono::seconds limit, bool* closed) {
  std::string out;
  using Clock = std::chrono::steady_clock;
  const auto end = Clock::now() + limit;
  *closed = false;
  char buf[4096];
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      *closed = true;
      break;
    }
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// One HTTP/1.0 request (the server closes after the response); the raw response, or "" if
// it did not complete within the generous limit.
inline std::string Fetch(int port, const std::string& request) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  SendAll(fd, request);
  bool closed = false;
  std::string r = ReadUntilClosed(fd, std::chrono::seconds(30), &closed);
  ::close(fd);
  return closed ? r : "";
}

}  // namespace imagegen::testing
