// Temporary directories for tests. No LibTorch here: the end-to-end tests, which include
// protobuf headers, use it too.
#pragma once

#include <ftw.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace imagegen::testing {

// Removes a directory tree with POSIX nftw. (std::filesystem::remove_all is avoided: the
// PyTorch wheel's libtorch.so exports its own copy of it, which crashes when interposed.)
inline void RemoveTree(const std::string& dir) {
  ::nftw(
      dir.c_str(),
      [](const char* path, const struct stat*, int, struct FTW*) { return std::remove(path); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

// A fresh, empty directory under the system's temporary directory, unique to this process.
inline std::string TempDir(const std::string& name) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("imagegen_test_" + std::to_string(::getpid()) + "_" + name))
                              .string();
  RemoveTree(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// The step-cost calibration cache that the tests' engines and daemons share (goodput window
// control), so that one calibration serves them all. Not removed: it is only a cache.
inline std::string SharedStepCostCache() {
  return (std::filesystem::temp_directory_path() / "imagegen-test-step-cost").string();
}

}  // namespace imagegen::testing
