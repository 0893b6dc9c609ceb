// Temporary directories for tests. No LibTorch here: the end-to-end tests, which include
// protobuf headers, use it too.
#pragma once

#include <ftw.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace imagegen::testing {

// Removes a directory tree with POSIX nftw. (std::filesystem::remove_all is avoided: the
// PyTorch wheel's libtorch.so exports its own copy of it, which crashes when interposed.)
inline void RemoveTree(const std::string& dir) {
  ::nftw(
      dir.c_str(),
      [](const char* path, const struct stat*, int, struct FTW*) { return std::remove(path); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

// The directories TempDir made, removed when the process exits, unless a test in it failed:
// then they stay, with the daemons' logs in them, and stderr names them. (Before, every run of
// the suite left several hundred in /tmp.) A forked child that ends with _exit removes nothing.
class TempDirs {
 public:
  static TempDirs& Get() {
    static TempDirs dirs;
    return dirs;
  }
  void Add(const std::string& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(dir);
  }
  ~TempDirs() {
    if (::testing::UnitTest::GetInstance()->Failed()) {
      for (const std::string& d : dirs_) std::fprintf(stderr, "kept for a look: %s\n", d.c_str());
      return;
    }
    for (const std::string& d : dirs_) RemoveTree(d);
  }

 private:
  // gtest's UnitTest is made first, so that it outlives this (statics end in reverse order).
  TempDirs() { ::testing::UnitTest::GetInstance(); }
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

// A fresh, empty directory under the system's temporary directory, unique to this process;
// removed at exit (TempDirs).
inline std::string TempDir(const std::string& name) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("imagegen_test_" + std::to_string(::getpid()) + "_" + name))
                              .string();
  RemoveTree(dir);
  std::filesystem::create_directories(dir);
  TempDirs::Get().Add(dir);
  return dir;
}

// The step-cost calibration cache that the tests' engines and daemons share (goodput window
// control), so that one calibration serves them all. Not removed: it is only a cache.
inline std::string SharedStepCostCache() {
  return (std::filesystem::temp_directory_path() / "imagegen-test-step-cost").string();
}

// The files directly in `dir` whose names start with `prefix`: full paths, sorted.
inline std::vector<std::string> FilesStartingWith(const std::string& dir,
                                                  const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace imagegen::testing
