#include "engine/util/json.h"

#include <cmath>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

namespace imagegen {
namespace {

// Thrown from the parser callback to stop at once: returning false there would only drop the
// value and parse on through the rest of a possibly 100 MiB header.
struct Rejected {
  std::string what;
};

// nlohmann's messages start with "[json.exception.parse_error.101] "; the id helps no one.
std::string WithoutId(const char* what) {
  std::string_view s(what);
  if (const size_t end = s.find("] "); !s.empty() && s[0] == '[' && end != s.npos) {
    s.remove_prefix(end + 2);
  }
  return std::string(s);
}

}  // namespace

StatusOr<Json> ParseJson(std::string_view text) {
  std::vector<std::set<std::string>> keys;  // per open object, the keys seen so far
  auto check = [&keys](int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        // `depth` counts the containers around this one.
        if (depth >= kMaxJsonDepth) {
          throw Rejected{"nesting deeper than " + std::to_string(kMaxJsonDepth)};
        }
        if (event == Json::parse_event_t::object_start) keys.emplace_back();
        break;
      case Json::parse_event_t::key:
        if (!keys.back().insert(parsed.get<std::string>()).second) {
          throw Rejected{"duplicate key \"" + parsed.get<std::string>() + "\""};
        }
        break;
      case Json::parse_event_t::object_end:
        keys.pop_back();
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text, check);
  } catch (const Rejected& r) {
    return DataLoss("invalid JSON: " + r.what);
  } catch (const Json::parse_error& e) {
    return DataLoss("invalid JSON at byte " + std::to_string(e.byte) + ": " + WithoutId(e.what()));
  } catch (const Json::exception& e) {  // out_of_range: a number too large for a double
    return DataLoss("invalid JSON: " + WithoutId(e.what()));
  }
}

std::optional<int64_t> JsonInt(const Json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::floor(d) == d && std::fabs(d) <= 9007199254740992.0) return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

const Json* JsonFields::Find(const std::string& key) const {
  if (!obj_.is_object()) return nullptr;
  auto it = obj_.find(key);
  return it == obj_.end() ? nullptr : &*it;
}

bool JsonFields::Absent(const std::string& key) const {
  const Json* v = Find(key);
  return v == nullptr || v->is_null();
}

Status JsonFields::Error(const std::string& key, const std::string& what) const {
  return FailedPrecondition(where_ + ": '" + key + "' " + what);
}

StatusOr<int64_t> JsonFields::Int(const std::string& key) const {
  const Json* v = Find(key);
  if (v == nullptr) return Error(key, "is missing");
  std::optional<int64_t> i = JsonInt(*v);
  if (!i) return Error(key, "must be an integer");
  return *i;
}

StatusOr<int64_t> JsonFields::Int(const std::string& key, int64_t fallback) const {
  return Absent(key) ? StatusOr<int64_t>(fallback) : Int(key);
}

StatusOr<double> JsonFields::Number(const std::string& key) const {
  const Json* v = Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_number()) return Error(key, "must be a number");
  return v->get<double>();
}

StatusOr<double> JsonFields::Number(const std::string& key, double fallback) const {
  return Absent(key) ? StatusOr<double>(fallback) : Number(key);
}

StatusOr<bool> JsonFields::Bool(const std::string& key, bool fallback) const {
  if (Absent(key)) return fallback;
  const Json* v = Find(key);
  if (!v->is_boolean()) return Error(key, "must be true or false");
  return v->get<bool>();
}

StatusOr<std::string> JsonFields::String(const std::string& key) const {
  const Json* v = Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_string()) return Error(key, "must be a string");
  return v->get<std::string>();
}

StatusOr<std::string> JsonFields::String(const std::string& key,
                                         const std::string& fallback) const {
  return Absent(key) ? StatusOr<std::string>(fallback) : String(key);
}

StatusOr<std::vector<int64_t>> JsonFields::IntList(const std::string& key) const {
  const Json* v = Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_array()) return Error(key, "must be a list of integers");
  std::vector<int64_t> out;
  for (const Json& e : *v) {
    std::optional<int64_t> i = JsonInt(e);
    if (!i) return Error(key, "must be a list of integers");
    out.push_back(*i);
  }
  return out;
}

StatusOr<std::vector<std::string>> JsonFields::StringList(const std::string& key) const {
  const Json* v = Find(key);
  if (v == nullptr) return Error(key, "is missing");
  if (!v->is_array()) return Error(key, "must be a list of strings");
  std::vector<std::string> out;
  for (const Json& e : *v) {
    if (!e.is_string()) return Error(key, "must be a list of strings");
    out.push_back(e.get<std::string>());
  }
  return out;
}

}  // namespace imagegen
