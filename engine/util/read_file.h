// ReadFile: a whole file into a string, with errors that name the path; WriteFileAtomically:
// a whole file written so that no reader sees part of it.
//
// Header-only and standard-library-only (besides status.h, itself header-only for what is
// used here): the engine, the daemon and the gRPC CLI (which links no engine library) read
// model configs, TLS material and token files through it.
#pragma once

#include <cctype>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>

#include <sys/stat.h>
#include <unistd.h>

#include "engine/util/status.h"

namespace imagegen {

// Why `path` could not be opened for reading (`err` is the errno of open): NOT_FOUND when it
// does not exist, PERMISSION_DENIED when this process may not read it (naming the file's owner
// and mode and this process's uid: a model written 0600 by another user is the usual cause),
// FAILED_PRECONDITION for anything else.
inline Status OpenError(const std::string& path, int err) {
  const std::string what = path + ": cannot open: " + std::strerror(err);
  if (err == ENOENT || err == ENOTDIR) return NotFound(what);
  if (err == EACCES || err == EPERM) {
    struct stat st {};
    std::string detail;
    if (::stat(path.c_str(), &st) == 0) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      detail = " (owner uid " + std::to_string(st.st_uid) + ", mode " + mode + "; this process";
      detail += " runs as uid " + std::to_string(::geteuid()) + ")";
    }
    return PermissionDenied(what + detail + ": give this user read access to it");
  }
  return FailedPrecondition(what);
}

// OpenError when the file cannot be opened, FAILED_PRECONDITION when it is larger than
// `max_bytes` (a bound on what a wrong path, say a device file, can make us allocate),
// DATA_LOSS when reading fails (a directory, an I/O error).
inline StatusOr<std::string> ReadFile(const std::string& path,
                                      size_t max_bytes = std::numeric_limits<size_t>::max()) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return OpenError(path, errno);
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

// A file-name-safe form of a model or device name: letters, digits and '-' kept, others '_'.
inline std::string FileSafe(const std::string& s) {
  std::string out;
  for (char ch : s) out += std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' ? ch : '_';
  return out;
}

// Writes `data` to `path + ".tmp<pid>"` and renames it over `path`: a concurrent reader sees
// the old file or the new one, never part of one. FAILED_PRECONDITION naming the path when
// either step fails (the temporary file is then removed).
inline Status WriteFileAtomically(const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  auto failed = [&](int err) {
    std::remove(tmp.c_str());
    return FailedPrecondition(path + ": cannot write: " + std::strerror(err));
  };
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out.write(data.data(), static_cast<std::streamsize>(data.size())).flush()) {
      return failed(errno);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return failed(errno);
  return OkStatus();
}

}  // namespace imagegen
