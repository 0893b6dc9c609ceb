#include "engine/util/json.h"

#include <cmath>
#include <cstdlib>
#include <limits>

namespace imagegen {

class JsonParser {
 public:
  explicit JsonParser(std::string_view s) : s_(s) {}

  StatusOr<Json> ParseDocument() {
    Json root;
    RETURN_IF_ERROR(ParseValue(root, 0));
    SkipSpace();
    if (pos_ != s_.size()) return Error("trailing characters after the JSON value");
    return root;
  }

 private:
  Status Error(const std::string& what) const {
    return DataLoss("invalid JSON at byte " + std::to_string(pos_) + ": " + what);
  }

  void SkipSpace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(std::string_view word) {
    if (s_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return true;
    }
    return false;
  }

  Status ParseValue(Json& out, int depth) {
    if (depth > 64) return Error("nesting deeper than 64");
    SkipSpace();
    if (pos_ >= s_.size()) return Error("unexpected end of input");
    char c = s_[pos_];
    if (c == '{') return ParseObject(out, depth);
    if (c == '[') return ParseArray(out, depth);
    if (c == '"') {
      out.type_ = Json::Type::kString;
      return ParseString(out.string_);
    }
    if (Consume("true")) {
      out.type_ = Json::Type::kBool;
      out.bool_ = true;
      return OkStatus();
    }
    if (Consume("false")) {
      out.type_ = Json::Type::kBool;
      out.bool_ = false;
      return OkStatus();
    }
    if (Consume("null")) {
      out.type_ = Json::Type::kNull;
      return OkStatus();
    }
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber(out);
    return Error(std::string("unexpected character '") + c + "'");
  }

  Status ParseObject(Json& out, int depth) {
    out.type_ = Json::Type::kObject;
    ++pos_;  // '{'
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return OkStatus();
    }
    while (true) {
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Error("expected a string key");
      std::string key;
      RETURN_IF_ERROR(ParseString(key));
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      Json value;
      RETURN_IF_ERROR(ParseValue(value, depth + 1));
      if (out.object_.count(key)) return Error("duplicate key \"" + key + "\"");
      out.object_.emplace(std::move(key), std::move(value));
      SkipSpace();
      if (pos_ >= s_.size()) return Error("unterminated object");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == '}') {
        ++pos_;
        return OkStatus();
      }
      return Error("expected ',' or '}'");
    }
  }

  Status ParseArray(Json& out, int depth) {
    out.type_ = Json::Type::kArray;
    ++pos_;  // '['
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return OkStatus();
    }
    while (true) {
      Json value;
      RETURN_IF_ERROR(ParseValue(value, depth + 1));
      out.array_.push_back(std::move(value));
      SkipSpace();
      if (pos_ >= s_.size()) return Error("unterminated array");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == ']') {
        ++pos_;
        return OkStatus();
      }
      return Error("expected ',' or ']'");
    }
  }

  static void AppendUtf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  Status ParseHex4(uint32_t& cp) {
    if (pos_ + 4 > s_.size()) return Error("truncated \\u escape");
    cp = 0;
    for (int i = 0; i < 4; ++i) {
      char h = s_[pos_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= h - '0';
      else if (h >= 'a' && h <= 'f') cp |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') cp |= h - 'A' + 10;
      else return Error("bad hex digit in \\u escape");
    }
    return OkStatus();
  }

  Status ParseString(std::string& out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= s_.size()) return Error("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return OkStatus();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) return Error("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = 0;
          RETURN_IF_ERROR(ParseHex4(cp));
          if (cp >= 0xD800 && cp < 0xDC00) {
            uint32_t lo = 0;
            if (!Consume("\\u")) return Error("unpaired surrogate");
            RETURN_IF_ERROR(ParseHex4(lo));
            if (lo < 0xDC00 || lo >= 0xE000) return Error("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            return Error("unpaired surrogate");
          }
          AppendUtf8(out, cp);
          break;
        }
        default: return Error(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  Status ParseNumber(Json& out) {
    size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    auto digits = [&] {
      size_t d = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - d;
    };
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (digits() == 0) {
      return Error("bad number");
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (digits() == 0) return Error("bad fraction");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) return Error("bad exponent");
    }
    std::string text(s_.substr(start, pos_ - start));
    out.type_ = Json::Type::kNumber;
    out.number_ = std::strtod(text.c_str(), nullptr);
    if (!std::isfinite(out.number_)) return Error("number out of range");
    return OkStatus();
  }

  std::string_view s_;
  size_t pos_ = 0;
};

StatusOr<Json> Json::Parse(std::string_view text) { return JsonParser(text).ParseDocument(); }

const Json* Json::Find(const std::string& key) const {
  if (type_ != Type::kObject) return nullptr;
  auto it = object_.find(key);
  return it == object_.end() ? nullptr : &it->second;
}

bool Json::is_integer() const {
  return type_ == Type::kNumber && std::floor(number_) == number_ &&
         std::fabs(number_) <= 9007199254740992.0;  // 2^53: exact in a double
}

Status JsonFields::Error(const std::string& key, const std::string& what) const {
  return FailedPrecondition(where_ + ": '" + key + "' " + what);
}

StatusOr<int64_t> JsonFields::Int(const std::string& key) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_integer()) return Error(key, "must be an integer");
  return static_cast<int64_t>(v->as_number());
}

StatusOr<int64_t> JsonFields::Int(const std::string& key, int64_t fallback) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr || v->is_null()) return fallback;
  return Int(key);
}

StatusOr<double> JsonFields::Number(const std::string& key) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_number()) return Error(key, "must be a number");
  return v->as_number();
}

StatusOr<double> JsonFields::Number(const std::string& key, double fallback) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr || v->is_null()) return fallback;
  return Number(key);
}

StatusOr<bool> JsonFields::Bool(const std::string& key, bool fallback) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr || v->is_null()) return fallback;
  if (!v->is_bool()) return Error(key, "must be true or false");
  return v->as_bool();
}

StatusOr<std::string> JsonFields::String(const std::string& key) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_string()) return Error(key, "must be a string");
  return v->as_string();
}

StatusOr<std::string> JsonFields::String(const std::string& key,
                                         const std::string& fallback) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr || v->is_null()) return fallback;
  return String(key);
}

StatusOr<std::vector<int64_t>> JsonFields::IntList(const std::string& key) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_array()) return Error(key, "must be a list of integers");
  std::vector<int64_t> out;
  for (const Json& e : v->as_array()) {
    if (!e.is_integer()) return Error(key, "must be a list of integers");
    out.push_back(static_cast<int64_t>(e.as_number()));
  }
  return out;
}

StatusOr<std::vector<std::string>> JsonFields::StringList(const std::string& key) const {
  const Json* v = obj_.Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_array()) return Error(key, "must be a list of strings");
  std::vector<std::string> out;
  for (const Json& e : v->as_array()) {
    if (!e.is_string()) return Error(key, "must be a list of strings");
    out.push_back(e.as_string());
  }
  return out;
}

}  // namespace imagegen
