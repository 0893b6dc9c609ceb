// What the daemon's two libmicrohttpd servers (/metrics, the OpenAI Images API) share: the
// listening socket and a buffered reply. Thread-safe (pure functions).
#pragma once

#include <microhttpd.h>

#include <string>
#include <utility>
#include <vector>

#include "engine/util/status.h"

namespace imagegen::server {

// A listening TCP socket on host:port (getaddrinfo: names, IPv4, [IPv6]; port 0 picks a free
// one), for libmicrohttpd to own; the bound port in `*port`.
StatusOr<int> ListenTcp(const std::string& address, int* port);

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// Queues `body` as the response (`type` its Content-Type; a Retry-After header of
// ceil(retry_after) seconds when retry_after >= 0; `headers` besides). Call from
// libmicrohttpd's handler.
MHD_Result HttpReply(MHD_Connection* c, unsigned code, const std::string& body,
                     const char* type = "application/json", double retry_after = -1,
                     const HttpHeaders& headers = {});

// The client's address as gRPC writes a peer: "ipv4:127.0.0.1:41234", "ipv6:[::1]:41234"
// (empty when unknown).
std::string HttpPeer(MHD_Connection* c);

}  // namespace imagegen::server
