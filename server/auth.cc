#include "server/auth.h"

#include <algorithm>

#include "engine/util/read_file.h"

namespace imagegen::server {

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

StatusOr<TokenAuth> TokenAuth::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string t, ReadFile(path));
  const auto b = t.find_first_not_of(" \t\r\n"), e = t.find_last_not_of(" \t\r\n");
  if (b == std::string::npos) return InvalidArgument("token file '" + path + "' is empty");
  TokenAuth a;
  a.token_ = t.substr(b, e - b + 1);
  return a;
}

bool TokenAuth::Allows(const grpc::ServerContextBase& ctx) const {
  if (!enabled()) return true;
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return false;
  return AllowsHeader(std::string_view(it->second.data(), it->second.size()));
}

bool TokenAuth::AllowsHeader(std::string_view v) const {
  if (!enabled()) return true;
  constexpr std::string_view kPrefix = "Bearer ";
  if (v.size() < kPrefix.size() || v.substr(0, kPrefix.size()) != kPrefix) return false;
  return ConstantTimeEquals(v.substr(kPrefix.size()), token_);
}

}  // namespace imagegen::server
