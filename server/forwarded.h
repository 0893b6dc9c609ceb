// Who is calling when the daemon sits behind a proxy (--trusted-proxies): a call whose peer is a
// trusted proxy is from the address that proxy put in X-Forwarded-For (the HTTP header, or the
// gRPC metadata key x-forwarded-for that Envoy and nginx's grpc_set_header send). The list is
// read right to left, as each proxy appends the address it received from: the first entry that
// is not itself a trusted proxy is the caller (all trusted: the leftmost; an entry that is not
// an address ends the walk at the last address read). A peer that is not a trusted proxy is the
// caller, whatever X-Forwarded-For it sends: nobody else can set the address a request counts
// as. The address is the fair-share client of a request without `user` (docs/serving.md,
// "Admission") and is in the request log.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/util/status.h"

namespace imagegen::server {

struct IpAddress {
  bool v6 = false;
  std::array<uint8_t, 16> bytes{};  // IPv4 (and IPv4-mapped IPv6): the first four
};

class TrustedProxies {
 public:
  TrustedProxies() = default;  // none: every peer is the caller
  // A comma-separated list of addresses and CIDR ranges ("10.0.0.0/8,127.0.0.1,fd00::/8");
  // empty: none. The error names the entry.
  static StatusOr<TrustedProxies> Parse(std::string_view list);

  bool empty() const { return ranges_.empty(); }
  // Whether a textual address ("10.1.2.3", "::1", "[::1]", "10.1.2.3:8080") is in a range.
  bool Contains(std::string_view address) const;
  bool Contains(const IpAddress& address) const;
  // The caller's address, in gRPC's peer form without the port and one spelling per address
  // ("ipv4:10.1.2.3", "ipv6:[fd00::1]"; an IPv4-mapped IPv6 address as IPv4), of a call from
  // `peer` ("ipv4:10.1.2.3:5678", "ipv6:[::1]:5678" or gRPC's "ipv6:%5B::1%5D:5678", as gRPC
  // and HttpPeer write it) carrying `forwarded_for` (the X-Forwarded-For values joined by
  // commas; empty: none). A peer that is not an IP address (a unix socket) is returned
  // without its port as it is. `*forwarded` (if given): whether X-Forwarded-For named it.
  std::string ClientAddress(std::string_view peer, std::string_view forwarded_for,
                            bool* forwarded = nullptr) const;

 private:
  struct Range {
    bool v6 = false;
    std::array<uint8_t, 16> addr{};
    int bits = 0;
  };
  std::vector<Range> ranges_;
};

}  // namespace imagegen::server
