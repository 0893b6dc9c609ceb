#include "engine/model/safetensors.h"

#include <gtest/gtest.h>

#include <fstream>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/test_util.h"

namespace imagegen {
namespace {

using testing::Contains;

std::string ReadAll(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteRaw(const std::string& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// A file from a raw header and data section.
std::string Raw(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  std::string dir_ = testing::TempDir("safetensors");
  std::string Path(const std::string& n) { return dir_ + "/" + n; }
  Status OpenRaw(const std::string& header, const std::string& data) {
    WriteRaw(Path("x.safetensors"), Raw(header, data));
    return SafetensorsFile::Open(Path("x.safetensors")).status();
  }
};

TEST_F(SafetensorsTest, RoundTripsEveryDtype) {
  std::map<std::string, at::Tensor> in = {
      {"f32", at::randn({3, 4})},
      {"bf16", at::randn({5}).to(at::kBFloat16)},
      {"f16", at::randn({2, 2}).to(at::kHalf)},
      {"i64", at::arange(7)},
      {"u8", at::arange(9).to(at::kByte).reshape({3, 3})},
      {"scalar", at::tensor(2.5)},
      {"empty", at::zeros({0, 3})},
  };
  ASSERT_TRUE(WriteSafetensors(Path("a.safetensors"), in).ok());
  auto f = SafetensorsFile::Open(Path("a.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->tensors().size(), in.size());
  for (const auto& [name, t] : in) {
    auto r = (*f)->Read(name);
    ASSERT_TRUE(r.ok()) << name;
    EXPECT_EQ(r->scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(*r, t)) << name;
  }
  EXPECT_FALSE((*f)->Read("nope").ok());
}

TEST_F(SafetensorsTest, ReadsMetadataAndIgnoresIt) {
  ASSERT_TRUE(
      OpenRaw(
          R"({"__metadata__":{"format":"pt"},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
          "xy")
          .ok());
}

TEST_F(SafetensorsTest, TruncatedFilesAreDataLoss) {
  std::map<std::string, at::Tensor> in = {{"w", at::randn({64, 64})}};
  ASSERT_TRUE(WriteSafetensors(Path("a.safetensors"), in).ok());
  const std::string full = ReadAll(Path("a.safetensors"));
  for (size_t keep : {size_t{0}, size_t{5}, size_t{8}, size_t{40}, full.size() - 1}) {
    WriteRaw(Path("t.safetensors"), full.substr(0, keep));
    auto f = SafetensorsFile::Open(Path("t.safetensors"));
    ASSERT_FALSE(f.ok()) << keep;
    EXPECT_EQ(f.status().code(), Code::kDataLoss) << keep;
    EXPECT_TRUE(Contains(f.status().message(), "t.safetensors")) << f.status().message();
  }
}

TEST_F(SafetensorsTest, BadHeadersAreDataLossNamingTheProblem) {
  struct Case {
    std::string header, data, expect;
  };
  const std::vector<Case> cases = {
      {"not json", "", "bad header"},
      {"[1,2]", "", "not a JSON object"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "12345678", "needs 8"},
      {R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}})", "xx", "unsupported dtype Q4"},
      {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "xy", "truncated"},
      {R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
       "xyz", "overlap"},
      {R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,2]}})", "xy", "bad shape"},
      {R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,0]}})", "xy", "end before begin"},
      {R"({"a":{"dtype":"U8","shape":[2]}})", "xy", "data_offsets"},
      {R"({"a":{"shape":[2],"data_offsets":[0,2]}})", "xy", "missing dtype"},
  };
  for (const auto& c : cases) {
    Status s = OpenRaw(c.header, c.data);
    EXPECT_EQ(s.code(), Code::kDataLoss) << c.header;
    EXPECT_TRUE(Contains(s.message(), c.expect)) << c.header << " -> " << s.message();
  }
}

TEST_F(SafetensorsTest, HugeHeaderLengthIsDataLoss) {
  std::string bytes(16, '\xff');
  WriteRaw(Path("h.safetensors"), bytes);
  auto f = SafetensorsFile::Open(Path("h.safetensors"));
  EXPECT_EQ(f.status().code(), Code::kDataLoss);
  EXPECT_TRUE(Contains(f.status().message(), "exceeds the file size"));
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  EXPECT_EQ(SafetensorsFile::Open(Path("none.safetensors")).status().code(), Code::kNotFound);
}

// A model file written 0600 by another user (safetensors' save_file writes 0600) is reported as
// PERMISSION_DENIED naming the mode, not as NOT_FOUND. As root (CI, containers) the open runs in
// a child that drops to uid 65534 first, since root may read any file.
TEST_F(SafetensorsTest, UnreadableFileIsPermissionDeniedWithItsMode) {
  WriteRaw(Path("private.safetensors"),
           Raw(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "xy"));
  ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(Path("private.safetensors").c_str(), 0600), 0);
  ASSERT_TRUE(SafetensorsFile::Open(Path("private.safetensors")).ok());  // the owner reads it
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // the child: only async-signal-safe work until open, then write and _exit
    ::close(fds[0]);
    if (::geteuid() == 0 && ::setuid(65534) != 0) ::_exit(3);
    if (::geteuid() == 0) ::_exit(4);  // cannot drop privileges: nothing to test
    Status st = SafetensorsFile::Open(Path("private.safetensors")).status();
    const std::string out = std::to_string(static_cast<int>(st.code())) + "\n" + st.message();
    const ssize_t w = ::write(fds[1], out.data(), out.size());
    ::_exit(w == static_cast<ssize_t>(out.size()) ? 0 : 5);
  }
  ::close(fds[1]);
  std::string got;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;)
    got.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << "child status " << wstatus;
  const size_t nl = got.find('\n');
  ASSERT_NE(nl, std::string::npos) << got;
  EXPECT_EQ(std::stoi(got.substr(0, nl)), static_cast<int>(Code::kPermissionDenied)) << got;
  EXPECT_TRUE(Contains(got, "private.safetensors")) << got;
  EXPECT_TRUE(Contains(got, "mode 0600")) << got;
}

}  // namespace
}  // namespace imagegen
