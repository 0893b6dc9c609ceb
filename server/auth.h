// Bearer-token authentication of the ImageGeneration calls and the HTTP API's requests:
// "authorization: Bearer <token>" metadata or header, compared in time independent of where the
// tokens differ. Health and reflection stay open (probes and generic tools). Immutable after
// Load; thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>
#include <string_view>

#include "engine/util/status.h"

namespace imagegen::server {

// Compares without an early exit: the time depends on the lengths only.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

class TokenAuth {
 public:
  TokenAuth() = default;  // disabled: every call is allowed
  // The token is the file's content without surrounding whitespace; it must not be empty.
  static StatusOr<TokenAuth> FromFile(const std::string& path);

  bool enabled() const { return !token_.empty(); }
  // True when disabled, or when the call carries the right bearer token.
  bool Allows(const grpc::ServerContextBase& ctx) const;
  // The same for an HTTP request's Authorization header value (empty: none sent).
  bool AllowsHeader(std::string_view authorization) const;

 private:
  std::string token_;
};

}  // namespace imagegen::server
