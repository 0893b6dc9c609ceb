// Status and StatusOr: errors as values at the engine's boundaries.
//
// The engine depends on LibTorch only (it must build on GPU hosts without Abseil), so it has
// its own small Status type; the server maps Code one-to-one onto gRPC status codes.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace imagegen {

// The values are the canonical status codes (google.rpc.Code), which gRPC uses too, so one
// name table serves the engine's codes and gRPC's (server/convert.cc checks the values).
enum class Code {
  kOk = 0,
  kCancelled = 1,
  kInvalidArgument = 3,  // bad request parameter; message names the field
  kDeadlineExceeded = 4,
  kNotFound = 5,            // unknown model or file
  kPermissionDenied = 7,    // a model file this process may not read
  kResourceExhausted = 8,   // queue full / no KV slot
  kFailedPrecondition = 9,  // model files present but inconsistent with the config
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,  // corrupt or truncated model file
};

// The canonical name of a status code number, "OK" .. "UNAUTHENTICATED" (0 .. 16), "UNKNOWN"
// for any other number. Inline: the CLI, which links no engine library, names gRPC codes too.
inline const char* StatusCodeName(int code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  constexpr int kCount = static_cast<int>(sizeof(kNames) / sizeof(kNames[0]));
  return code >= 0 && code < kCount ? kNames[code] : "UNKNOWN";
}
inline const char* StatusCodeName(Code code) { return StatusCodeName(static_cast<int>(code)); }

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  // An INVALID_ARGUMENT about one request field: message "field: text", field() == field.
  static Status Field(std::string field, const std::string& text) {
    Status s(Code::kInvalidArgument, field + ": " + text);
    s.field_ = std::move(field);
    return s;
  }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // The request field an INVALID_ARGUMENT is about (engine names: "cfg_scale", "window",
  // "class_id", ...); empty when the error is not about one field.
  const std::string& field() const { return field_; }
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
  std::string field_;
};

// A value from a request or a file, quoted for an error message: at most `max` bytes of it
// (then "..." and its length), control bytes and non-ASCII as '?', so that a message never
// grows with what a client sent.
inline std::string Quoted(const std::string& s, size_t max = 64) {
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    out += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
  }
  out += "'";
  if (s.size() > max) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

inline Status OkStatus() { return Status(); }
inline Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status FieldError(std::string field, const std::string& text) {
  return Status::Field(std::move(field), text);
}
inline Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
inline Status PermissionDenied(std::string m) { return {Code::kPermissionDenied, std::move(m)}; }
inline Status DataLoss(std::string m) { return {Code::kDataLoss, std::move(m)}; }
inline Status FailedPrecondition(std::string m) {
  return {Code::kFailedPrecondition, std::move(m)};
}
inline Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }
inline Status ResourceExhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }
inline Status Cancelled(std::string m) { return {Code::kCancelled, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) { return {Code::kDeadlineExceeded, std::move(m)}; }
inline Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : v_(std::move(status)) {}  // NOLINT: implicit by design
  StatusOr(T value) : v_(std::move(value)) {}         // NOLINT

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<Status, T> v_;
};

#define IMAGEGEN_CONCAT_INNER(a, b) a##b
#define IMAGEGEN_CONCAT(a, b) IMAGEGEN_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)        \
  do {                               \
    ::imagegen::Status _st = (expr); \
    if (!_st.ok()) return _st;       \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(IMAGEGEN_CONCAT(_status_or_, __LINE__), lhs, expr)

}  // namespace imagegen
