// ReadFile: a whole file into a string, with errors that name the path.
//
// Header-only and standard-library-only (besides status.h, itself header-only for what is
// used here): the engine, the daemon and the gRPC CLI (which links no engine library) read
// model configs, TLS material and token files through it.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>

#include "engine/util/status.h"

namespace imagegen {

// NOT_FOUND when the file cannot be opened, FAILED_PRECONDITION when it is larger than
// `max_bytes` (a bound on what a wrong path, say a device file, can make us allocate),
// DATA_LOSS when reading fails (a directory, an I/O error).
inline StatusOr<std::string> ReadFile(const std::string& path,
                                      size_t max_bytes = std::numeric_limits<size_t>::max()) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot open: " + std::strerror(errno));
  std::string data;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    data.append(buf, static_cast<size_t>(in.gcount()));
    if (data.size() > max_bytes) {
      return FailedPrecondition(path + ": larger than " + std::to_string(max_bytes) + " bytes");
    }
  }
  if (in.bad()) return DataLoss(path + ": cannot read: " + std::strerror(errno));
  return data;
}

}  // namespace imagegen
