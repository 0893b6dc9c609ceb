#include "server/auth.h"

#include <absl/strings/numbers.h>
#include <absl/strings/str_split.h>

#include <openssl/evp.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "engine/util/read_file.h"

namespace imagegen::server {

namespace {

bool ValidName(absl::string_view n) {
  if (n.empty() || n.size() > 64) return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

std::string Sha256(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(data.data(), data.size(), md, &n, EVP_sha256(), nullptr) != 1) {
    std::abort();  // libcrypto's SHA-256 cannot fail on memory input
  }
  return std::string(reinterpret_cast<const char*>(md), n);
}

std::shared_ptr<const ApiKey> OpenKey() {
  static const auto* open = new std::shared_ptr<const ApiKey>(std::make_shared<ApiKey>());
  return *open;
}

}  // namespace

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

StatusOr<std::vector<ApiKey>> ParseKeys(std::string_view text) {
  std::vector<ApiKey> keys;
  std::set<std::string> tokens, names;
  int line_no = 0;
  // A UTF-8 byte-order mark (editors on Windows write one) is not the first token's.
  if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);
  // Debian's Abseil has its own string_view.
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++line_no;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty() || fields[0][0] == '#') continue;
    const size_t n_fields =
        std::find_if(fields.begin(), fields.end(),
                     [](absl::string_view f) { return f[0] == '#'; }) -  // a comment
        fields.begin();
    const std::string where = "line " + std::to_string(line_no) + ": ";
    ApiKey k;
    k.token = std::string(fields[0]);
    if (k.token.rfind("name=", 0) == 0 || k.token.rfind("priority=", 0) == 0 ||
        k.token.rfind("max_in_flight=", 0) == 0) {
      return InvalidArgument(where + "the token comes first, then its attributes");
    }
    if (k.token.size() > kMaxTokenBytes) {
      return InvalidArgument(where + "the token is longer than " + std::to_string(kMaxTokenBytes) +
                             " bytes");
    }
    // A client sends the token in an HTTP or gRPC header, which carries printable ASCII: a
    // token with another byte (a pasted non-breaking space, a smart quote) could never match.
    for (size_t i = 0; i < k.token.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(k.token[i]);
      if (c < 0x21 || c > 0x7e) {
        return InvalidArgument(where + "the token's byte " + std::to_string(i + 1) +
                               " is not printable ASCII (a header cannot carry it)");
      }
    }
    for (size_t i = 1; i < n_fields; ++i) {
      const absl::string_view f = fields[i];
      const size_t eq = f.find('=');
      const absl::string_view attr = f.substr(0, eq), value = eq == f.npos ? "" : f.substr(eq + 1);
      // Errors name the field by position, never by its text: a token with a space in it
      // would otherwise put its second half in the log.
      const std::string field = "field " + std::to_string(i + 1);
      if (eq == f.npos) {
        return InvalidArgument(where + field +
                               " is not an attribute (name=, priority= or max_in_flight=); a "
                               "token has no spaces");
      }
      if (attr == "name") {
        if (!ValidName(value)) {
          return InvalidArgument(where + "name: 1 to 64 of [A-Za-z0-9._-]");
        }
        if (!k.name.empty()) return InvalidArgument(where + "name: given twice");
        k.name = std::string(value);
      } else if (attr == "priority") {
        int32_t p = 0;
        if (!absl::SimpleAtoi(value, &p)) {
          return InvalidArgument(where + "priority: must be an integer");
        }
        if (k.priority.has_value()) return InvalidArgument(where + "priority: given twice");
        k.priority = p;
      } else if (attr == "max_in_flight") {
        int64_t m = 0;
        if (!absl::SimpleAtoi(value, &m) || m < 1 || m > 1000000) {
          return InvalidArgument(where + "max_in_flight: must be an integer in [1, 1000000]");
        }
        if (k.max_in_flight.has_value()) {
          return InvalidArgument(where + "max_in_flight: given twice");
        }
        k.max_in_flight = m;
      } else {
        return InvalidArgument(where + field +
                               ": an unknown attribute (name=, priority= or max_in_flight=)");
      }
    }
    if (k.max_in_flight.has_value() && k.name.empty()) {
      return InvalidArgument(where + "max_in_flight: needs a name (the limit is the name's)");
    }
    if (!tokens.insert(k.token).second) {
      return InvalidArgument(where + "the same token as an earlier line");
    }
    if (!k.name.empty() && !names.insert(k.name).second) {
      return InvalidArgument(where + "name: '" + k.name + "' is an earlier key's");
    }
    keys.push_back(std::move(k));
  }
  if (keys.empty()) return InvalidArgument("no key (a line holding a token)");
  return keys;
}

StatusOr<TokenAuth> TokenAuth::FromFile(const std::string& path) {
  TokenAuth a;
  a.state_ = std::make_shared<State>();
  a.state_->path = path;
  RETURN_IF_ERROR(a.Reload().status());
  return a;
}

namespace {

// The file's identity and version as stat (through symbolic links) sees it; empty if missing.
std::string Signature(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" +
         std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
         std::to_string(st.st_mtim.tv_nsec) + ":" + std::to_string(st.st_ctim.tv_sec) + "." +
         std::to_string(st.st_ctim.tv_nsec) + ":" + std::to_string(st.st_mode) + ":" +
         std::to_string(st.st_uid) + ":" + std::to_string(st.st_gid);
}

}  // namespace

bool TokenAuth::Changed() const {
  if (!enabled()) return false;
  const std::string now = Signature(state_->path);
  std::lock_guard<std::mutex> l(state_->mu);
  return now != state_->read_as;
}

StatusOr<size_t> TokenAuth::Reload() const {
  if (!enabled()) return FailedPrecondition("no key file");
  // One at a time: otherwise a slower read of the old file could install its keys after a
  // faster read of the new one had marked the new file read.
  std::lock_guard<std::mutex> one(state_->reload_mu);
  // The signature before and after the read: a file written in place while it was read (an
  // editor, `cat > keys`) may be half of one, and is not taken; it stays changed, so the next
  // check reads it again. A file that cannot be read stays changed too (a chmod, a mount).
  const std::string before = Signature(state_->path);
  auto text = ReadFile(state_->path, size_t{16} << 20);
  if (!text.ok()) return text.status();
  if (Signature(state_->path) != before) {
    return Unavailable("'" + state_->path +
                       "' changed while it was read: it is read again at the next check (or "
                       "SIGHUP); replace it with a rename to change it at once");
  }
  auto parsed = ParseKeys(*text);
  if (!parsed.ok()) {
    std::lock_guard<std::mutex> l(state_->mu);
    state_->read_as = before;  // a broken file is not read again until it changes
    return InvalidArgument("'" + state_->path + "': " + parsed.status().message());
  }
  auto keys = std::make_shared<Keys>();
  for (ApiKey& k : *parsed) {
    Entry e;
    e.digest = Sha256(k.token);
    e.key = std::make_shared<const ApiKey>(std::move(k));
    keys->push_back(std::move(e));
  }
  std::lock_guard<std::mutex> l(state_->mu);
  state_->read_as = before;
  state_->keys = std::move(keys);
  return state_->keys->size();
}

std::shared_ptr<const ApiKey> TokenAuth::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (!enabled()) return OpenKey();
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return nullptr;
  return AuthenticateHeader(std::string_view(it->second.data(), it->second.size()));
}

std::shared_ptr<const ApiKey> TokenAuth::AuthenticateHeader(std::string_view v) const {
  if (!enabled()) return OpenKey();
  constexpr std::string_view kPrefix = "Bearer ";
  if (v.size() < kPrefix.size() || v.substr(0, kPrefix.size()) != kPrefix) return nullptr;
  const std::string_view sent = v.substr(kPrefix.size());
  if (sent.size() > kMaxTokenBytes) return nullptr;  // no key is that long
  std::shared_ptr<const Keys> keys;
  {
    std::lock_guard<std::mutex> l(state_->mu);
    keys = state_->keys;
  }
  std::shared_ptr<const ApiKey> match;
  // Digests of equal length: the same work for every key whatever the token sent.
  const std::string digest = Sha256(sent);
  for (const Entry& e : *keys) {  // no early exit
    if (ConstantTimeEquals(digest, e.digest)) match = e.key;
  }
  return match;
}

}  // namespace imagegen::server
