#include "engine/util/status.h"

namespace imagegen {

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

}  // namespace imagegen
