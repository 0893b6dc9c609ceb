// A small JSON reader for config.json and safetensors headers.
//
// The engine must build with LibTorch alone, so it carries its own parser. It accepts RFC 8259
// JSON (objects, arrays, strings with escapes, numbers, true/false/null), rejects trailing
// garbage and nesting deeper than 64, and reports the byte offset of the first error.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/util/status.h"

namespace imagegen {

class Json {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  static StatusOr<Json> Parse(std::string_view text);

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }

  bool as_bool() const { return bool_; }
  double as_number() const { return number_; }
  const std::string& as_string() const { return string_; }
  const std::vector<Json>& as_array() const { return array_; }
  // Keys in document order are not needed; std::map keeps lookups simple.
  const std::map<std::string, Json>& as_object() const { return object_; }

  // Object member or nullptr.
  const Json* Find(const std::string& key) const;

  // True if the number is an integer that fits int64.
  bool is_integer() const;

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Json> array_;
  std::map<std::string, Json> object_;
};

// Typed accessors for config files; errors name the key ("config.json: 'dim' ...").
class JsonFields {
 public:
  JsonFields(const Json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

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
  const Json& obj_;
  std::string where_;
};

}  // namespace imagegen
