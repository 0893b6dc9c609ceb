#include "server/forwarded.h"

#include <absl/strings/ascii.h>
#include <absl/strings/numbers.h>
#include <absl/strings/str_split.h>
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <optional>

namespace imagegen::server {

namespace {

// A bare address: "10.1.2.3", "::1". An IPv4-mapped IPv6 address counts as IPv4.
std::optional<IpAddress> ParseBare(std::string_view s) {
  const std::string z(s);
  IpAddress a;
  in_addr v4{};
  in6_addr v6{};
  if (inet_pton(AF_INET, z.c_str(), &v4) == 1) {
    std::memcpy(a.bytes.data(), &v4, 4);
    return a;
  }
  if (inet_pton(AF_INET6, z.c_str(), &v6) == 1) {
    static constexpr uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (std::memcmp(&v6, kMapped, 12) == 0) {
      std::memcpy(a.bytes.data(), reinterpret_cast<const uint8_t*>(&v6) + 12, 4);
      return a;
    }
    a.v6 = true;
    std::memcpy(a.bytes.data(), &v6, 16);
    return a;
  }
  return std::nullopt;
}

// An address as X-Forwarded-For entries and peers write it: bare, "[v6]", "[v6]:port",
// "v4:port"; also gRPC's "ipv4:" / "ipv6:" prefixes.
std::optional<IpAddress> ParseAny(std::string_view s) {
  const absl::string_view stripped =
      absl::StripAsciiWhitespace(absl::string_view(s.data(), s.size()));
  s = std::string_view(stripped.data(), stripped.size());
  if (s.rfind("ipv4:", 0) == 0 || s.rfind("ipv6:", 0) == 0) s.remove_prefix(5);
  // gRPC's peer names escape an IPv6 address's brackets ("ipv6:%5B::1%5D:5678").
  if (s.rfind("%5B", 0) == 0 || s.rfind("%5b", 0) == 0) {
    const size_t close = std::min(s.find("%5D"), s.find("%5d"));
    if (close == s.npos) return std::nullopt;
    return ParseBare(s.substr(3, close - 3));
  }
  if (!s.empty() && s.front() == '[') {
    const size_t close = s.find(']');
    if (close == s.npos) return std::nullopt;
    return ParseBare(s.substr(1, close - 1));
  }
  if (auto a = ParseBare(s)) return a;
  const size_t colon = s.rfind(':');  // "v4:port"
  if (colon != s.npos && s.find(':') == colon) return ParseBare(s.substr(0, colon));
  return std::nullopt;
}

std::string PeerForm(const IpAddress& a) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a.v6) {
    inet_ntop(AF_INET6, a.bytes.data(), buf, sizeof buf);
    return std::string("ipv6:[") + buf + "]";
  }
  inet_ntop(AF_INET, a.bytes.data(), buf, sizeof buf);
  return std::string("ipv4:") + buf;
}

// gRPC's (and HttpPeer's) peer without the port: "ipv4:10.1.2.3", "ipv6:[::1]"; other peers
// (a unix socket) as they are.
std::string PeerHost(std::string_view peer) {
  const auto colon = peer.rfind(':');
  auto bracket = peer.rfind(']');
  for (const char* esc : {"%5D", "%5d"}) {  // gRPC's escaping
    if (const auto escaped = peer.rfind(esc); escaped != peer.npos) {
      bracket = bracket == peer.npos ? escaped : std::max(bracket, escaped);
    }
  }
  if (colon != peer.npos && colon > 5 && (bracket == peer.npos || colon > bracket)) {
    return std::string(peer.substr(0, colon));
  }
  return std::string(peer);
}

}  // namespace

StatusOr<TrustedProxies> TrustedProxies::Parse(std::string_view list) {
  TrustedProxies t;
  // Debian's Abseil has its own string_view.
  for (absl::string_view ae :
       absl::StrSplit(absl::string_view(list.data(), list.size()), ',', absl::SkipWhitespace())) {
    ae = absl::StripAsciiWhitespace(ae);
    const std::string_view e(ae.data(), ae.size());
    const size_t slash = e.find('/');
    const std::optional<IpAddress> a = ParseBare(e.substr(0, slash));
    if (!a.has_value()) {
      return InvalidArgument("'" + std::string(e) + "' is not an address or a CIDR range");
    }
    Range r;
    r.v6 = a->v6;
    r.addr = a->bytes;
    const int max_bits = a->v6 ? 128 : 32;
    r.bits = max_bits;
    if (slash != e.npos) {
      int bits = -1;
      // A mapped IPv6 range ("::ffff:10.0.0.0/104") counts its bits past the 96 of the prefix.
      const bool mapped = !a->v6 && e.substr(0, slash).find(':') != e.npos;
      const std::string_view len = e.substr(slash + 1);
      if (!absl::SimpleAtoi(absl::string_view(len.data(), len.size()), &bits) ||
          bits < (mapped ? 96 : 0) || bits > (mapped ? 128 : max_bits)) {
        return InvalidArgument("'" + std::string(e) + "': the prefix length must be in [" +
                               (mapped ? "96, 128" : "0, " + std::to_string(max_bits)) + "]");
      }
      r.bits = mapped ? bits - 96 : bits;
    }
    t.ranges_.push_back(r);
  }
  return t;
}

bool TrustedProxies::Contains(std::string_view address) const {
  const std::optional<IpAddress> a = ParseAny(address);
  return a.has_value() && Contains(*a);
}

bool TrustedProxies::Contains(const IpAddress& address) const {
  const IpAddress* a = &address;
  for (const Range& r : ranges_) {
    if (r.v6 != a->v6) continue;
    int bits = r.bits;
    bool in = true;
    for (size_t i = 0; bits > 0 && in; ++i, bits -= 8) {
      const uint8_t mask = bits >= 8 ? 0xff : static_cast<uint8_t>(0xff << (8 - bits));
      in = (r.addr[i] & mask) == (a->bytes[i] & mask);
    }
    if (in) return true;
  }
  return false;
}

std::string TrustedProxies::ClientAddress(std::string_view peer, std::string_view forwarded_for,
                                          bool* forwarded) const {
  if (forwarded != nullptr) *forwarded = false;
  const std::string host = PeerHost(peer);
  std::optional<IpAddress> current = ParseAny(host);
  if (!current.has_value()) return host;  // not an IP peer (a unix socket)
  if (empty() || forwarded_for.empty()) return PeerForm(*current);
  // Empty entries (a trailing comma) are skipped.
  const std::vector<absl::string_view> hops = absl::StrSplit(
      absl::string_view(forwarded_for.data(), forwarded_for.size()), ',', absl::SkipWhitespace());
  for (auto it = hops.rbegin(); it != hops.rend(); ++it) {
    if (!Contains(*current)) break;  // not a proxy we trust: the caller
    const std::optional<IpAddress> next = ParseAny(std::string_view(it->data(), it->size()));
    if (!next.has_value()) break;  // not an address: the last one read
    current = next;
    if (forwarded != nullptr) *forwarded = true;
  }
  return PeerForm(*current);
}

}  // namespace imagegen::server
