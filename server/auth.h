// API keys: bearer-token authentication of the ImageGeneration calls and the HTTP API's
// requests ("authorization: Bearer <token>" metadata or header), compared in time independent
// of where the tokens differ. Health and reflection stay open (probes and generic tools).
//
// The key file (--token-file) holds one key per line: the token, then optional attributes
//   <token> [name=<name>] [priority=<n>] [max_in_flight=<n>] [# comment]
// with blank lines ignored, and a comment from a word that begins with '#' to the end of the
// line (so a token may not begin with '#'). Tokens are at most 4096 bytes. A key's name makes its
// callers one tenant of the fair-share admission (docs/serving.md, "Admission"; the callers of
// every unnamed key together are one more) and labels its request lines and usage metrics; its
// priority is the one its requests get when they ask for none, and the most urgent they may ask for
// (a key without one may ask for any); its max_in_flight caps the images its calls have queued or
// running at once. A file holding only a token (the format before names) is one unnamed key.
// Reload() reads the file again (the daemon does on SIGHUP, and when the file changes): the
// new keys apply to calls that begin afterwards; a file that no longer parses leaves the keys
// as they were, and so does one that changed while it was read (written in place: the next
// check reads it again). Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/util/status.h"

namespace imagegen::server {

// Compares without an early exit: the time depends on the lengths only.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

constexpr size_t kMaxTokenBytes = 4096;

struct ApiKey {
  std::string token;
  std::string name;                 // empty: unnamed (its callers are not a tenant of their own)
  std::optional<int32_t> priority;  // the default and most urgent priority of its requests
  // At most this many images of its calls queued or running at once (per name, across reloads);
  // a call beyond it is RESOURCE_EXHAUSTED. Only with a name.
  std::optional<int64_t> max_in_flight;
};

// The keys of a key file's text; the error names the line and what is wrong with it.
StatusOr<std::vector<ApiKey>> ParseKeys(std::string_view text);

class TokenAuth {
 public:
  TokenAuth() = default;  // disabled: every call is allowed, as the open key
  static StatusOr<TokenAuth> FromFile(const std::string& path);

  bool enabled() const { return state_ != nullptr; }
  // The key the call's bearer token matches: the open key (no name, no priority) when
  // disabled, null when refused. The token sent is hashed (SHA-256) and its digest compared
  // with every key's in constant time and without an early exit, so the time tells neither
  // which key matched nor anything of the keys (only how many there are). The key stays
  // valid while the caller holds it, whatever Reload does.
  std::shared_ptr<const ApiKey> Authenticate(const grpc::ServerContextBase& ctx) const;
  // The same for an HTTP request's Authorization header value (empty: none sent).
  std::shared_ptr<const ApiKey> AuthenticateHeader(std::string_view authorization) const;
  bool Allows(const grpc::ServerContextBase& ctx) const { return Authenticate(ctx) != nullptr; }
  bool AllowsHeader(std::string_view authorization) const {
    return AuthenticateHeader(authorization) != nullptr;
  }

  // Reads the file again; on an error the keys stay as they were. Returns how many keys there
  // are now. Disabled auth has nothing to reload (an error). A file that cannot be read, or
  // that changed while it was read, is not marked as read: Changed() stays true.
  StatusOr<size_t> Reload() const;
  // Whether the file differs (device, inode, size, modification or status-change time; through
  // symbolic links, so a Kubernetes Secret volume's swap counts, and so does a chmod that makes
  // it readable) from when it was last read.
  bool Changed() const;

 private:
  struct Entry {
    std::shared_ptr<const ApiKey> key;
    std::string digest;  // SHA-256 of the token
  };
  using Keys = std::vector<Entry>;
  struct State {
    std::string path;
    std::mutex reload_mu;  // one Reload at a time (SIGHUP's and the poll's)
    mutable std::mutex mu;
    std::shared_ptr<const Keys> keys;  // under mu
    std::string read_as;               // under mu: the file's signature when last read
  };
  std::shared_ptr<State> state_;  // shared by copies (the service's and the HTTP front's)
};

}  // namespace imagegen::server
