#include "engine/util/status.h"

namespace imagegen {

const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kDataLoss: return "DATA_LOSS";
    case Code::kFailedPrecondition: return "FAILED_PRECONDITION";
    case Code::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case Code::kCancelled: return "CANCELLED";
    case Code::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case Code::kUnavailable: return "UNAVAILABLE";
    case Code::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(code_)) + ": " + message_;
}

}  // namespace imagegen
