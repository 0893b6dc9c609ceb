// JSON for config.json and safetensors headers: nlohmann::json, parsed with the limits that
// untrusted files need, and typed field accessors whose errors name the file and the key.
//
// Only the forward declarations are included here: most translation units that see this
// header (through weights.h) never touch a JSON value, and nlohmann/json.hpp is large. Code
// that reads values includes <nlohmann/json.hpp> itself.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/util/status.h"

namespace imagegen {

using Json = nlohmann::json;

// Deeper documents are rejected as soon as the parser reaches the limit, so a hostile file
// cannot make the parser (or code that walks the result) go deep.
inline constexpr int kMaxJsonDepth = 64;

// Parses one RFC 8259 document. Errors (DATA_LOSS) give the byte offset of a syntax error,
// name a key that appears twice in one object (nlohmann would keep the last silently, and a
// header that names a tensor twice is ambiguous), or report nesting deeper than kMaxJsonDepth.
StatusOr<Json> ParseJson(std::string_view text);

// The value as an int64: a JSON integer in range, or an integral number a double holds
// exactly (|x| <= 2^53, e.g. 256.0 written by a tool); nullopt otherwise.
std::optional<int64_t> JsonInt(const Json& v);

// Typed accessors for config files; errors name the key ("config.json: 'dim' ..."). A null
// member counts as absent for the accessors that take a fallback.
class JsonFields {
 public:
  JsonFields(const Json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  // The member `key` (possibly null), or nullptr when absent or when this is no object.
  const Json* Find(const std::string& key) const;

  StatusOr<int64_t> Int(const std::string& key) const;
  StatusOr<int64_t> Int(const std::string& key, int64_t fallback) const;
  StatusOr<double> Number(const std::string& key) const;
  StatusOr<double> Number(const std::string& key, double fallback) const;
  StatusOr<bool> Bool(const std::string& key, bool fallback) const;
  StatusOr<std::string> String(const std::string& key) const;
  StatusOr<std::string> String(const std::string& key, const std::string& fallback) const;
  StatusOr<std::vector<int64_t>> IntList(const std::string& key) const;
  StatusOr<std::vector<std::string>> StringList(const std::string& key) const;

 private:
  Status Error(const std::string& key, const std::string& what) const;
  bool Absent(const std::string& key) const;
  const Json& obj_;
  std::string where_;
};

}  // namespace imagegen
