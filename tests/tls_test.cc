// The daemon's TLS files (server/tls.h): the checks of a certificate and its key, and the
// mirror that gRPC's file watcher reads (one generation per certificate, swapped atomically,
// each with a modification time of its own).
#include "server/tls.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "server/http_api.h"
#include "server/metrics.h"
#include "server/service.h"
#include "tests/build_paths.h"
#include "tests/e2e/process.h"
#include "tests/temp_dir.h"

namespace imagegen {
namespace {

using server::CertificateMirror;
using server::ServerCertificate;
using testing::RunCommand;
using testing::Slurp;
using testing::TempDir;

// Two CAs, each with a server certificate for 127.0.0.1 (tests/make_test_pki.sh): a/ca.pem and
// a/server-a.pem, b/...; chain_a.pem is a/server-a.pem + a/ca.pem. Returns the directory;
// `a_end` gets server-a's notAfter in Unix seconds.
std::string MakeCertificates(const std::string& name, int64_t* a_end) {
  const std::string d = TempDir(name);
  const std::string pki = std::string(testing::SourceDir()) + "/tests/make_test_pki.sh";
  const std::string script = "set -e; cd '" + d + "'; for x in a b; do '" + pki +
                             "' $x server-$x; done; cat a/server-a.pem a/ca.pem > chain_a.pem; "
                             "date -d \"$(openssl x509 -enddate -noout -in a/server-a.pem | "
                             "cut -d= -f2)\" +%s > a.end";
  std::string out;
  if (RunCommand({"/bin/bash", "-c", script}, &out, d + "/openssl.log") != 0) {
    throw std::runtime_error("openssl failed: " + out + Slurp(d + "/openssl.log"));
  }
  *a_end = std::stoll(Slurp(d + "/a.end"));
  return d;
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = MakeCertificates("tls_unit", &a_end_); }
  // The server certificate of CA `x` ('a' or 'b') and its key.
  static std::shared_ptr<const ServerCertificate> Cert(char x) {
    const std::string base = dir_ + "/" + x + "/server-" + x;
    auto c = ServerCertificate::Read(base + ".pem", base + ".key");
    if (!c.ok()) throw std::runtime_error(c.status().ToString());
    return *c;
  }
  // Whether a new TLS handshake with the HTTPS server on `port` succeeds trusting only `ca` (a
  // file under dir_; curl prints 000 for a connection that got no HTTP answer, and while the
  // models load the answer is 503).
  static bool HttpsTrusts(int port, const std::string& ca) {
    std::string out;
    RunCommand(
        {"/usr/bin/curl", "-sS", "--noproxy", "*", "--cacert", dir_ + "/" + ca, "-o", "/dev/null",
         "-w", "%{http_code}", "https://127.0.0.1:" + std::to_string(port) + "/health/live"},
        &out, dir_ + "/curl.log");
    return out.size() == 3 && out != "000";
  }
  static std::string dir_;
  static int64_t a_end_;
  // For the HTTPS servers of the tests that start one.
  server::Metrics metrics_;
  server::ImageGenerationService service_{&metrics_, server::TokenAuth(), server::ServiceOptions()};
};
std::string TlsTest::dir_;
int64_t TlsTest::a_end_ = 0;

TEST_F(TlsTest, AGoodPairIsReadWithItsSubjectExpiryAndChain) {
  auto c = ServerCertificate::Read(dir_ + "/chain_a.pem", dir_ + "/a/server-a.key");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->subject(), "CN=server-a");
  EXPECT_EQ((*c)->not_after(), a_end_);
  EXPECT_EQ((*c)->chain_length(), 2u);  // the server's certificate, then its CA's
  EXPECT_EQ((*c)->cert_pem(), Slurp(dir_ + "/chain_a.pem"));
  EXPECT_EQ((*c)->key_pem(), Slurp(dir_ + "/a/server-a.key"));
  EXPECT_EQ((*c)->not_after_text().size(), 20u) << (*c)->not_after_text();
  EXPECT_NE((*c)->key(), nullptr);
}

TEST_F(TlsTest, WhatIsNotACertificateAndItsKeyIsRefusedNamingTheFlag) {
  const std::string cert = Slurp(dir_ + "/a/server-a.pem"), key = Slurp(dir_ + "/a/server-a.key");
  auto refused = [](const std::string& c, const std::string& k) {
    auto r = ServerCertificate::Parse(c, k);
    return r.ok() ? std::string("accepted") : r.status().message();
  };
  EXPECT_EQ(refused("junk\n", key), "--tls-cert: holds no PEM CERTIFICATE");
  EXPECT_EQ(refused(cert, "junk\n"), "--tls-key: holds no PEM PRIVATE KEY");
  // A PEM block whose body is not a certificate.
  std::string bent = cert;
  bent.replace(bent.find('\n') + 1, 16, "AAAAAAAAAAAAAAAA");
  EXPECT_EQ(refused(bent, key).rfind("--tls-cert: not a PEM certificate chain", 0), 0u)
      << refused(bent, key);
  // The other server's key: a pair that TLS could not serve.
  EXPECT_EQ(refused(cert, Slurp(dir_ + "/b/server-b.key")),
            "--tls-key: not the private key of --tls-cert's first certificate (CN=server-a)");
  // The CA first: its certificate is not the key's.
  EXPECT_EQ(refused(Slurp(dir_ + "/a/ca.pem") + cert, key).rfind("--tls-key: not the", 0), 0u);
  // A file that cannot be read names its flag too.
  auto missing = ServerCertificate::Read(dir_ + "/none.pem", dir_ + "/a/server-a.key");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message().rfind("--tls-cert: ", 0), 0u) << missing.status().message();
  missing = ServerCertificate::Read(dir_ + "/a/server-a.pem", dir_ + "/none.key");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message().rfind("--tls-key: ", 0), 0u) << missing.status().message();
  // The good pair passes the same checks (the refusals above are not everything refused).
  EXPECT_EQ(refused(cert, key), "accepted");
}

TEST_F(TlsTest, ACaBundleMustParse) {
  EXPECT_TRUE(server::CheckCaBundle(Slurp(dir_ + "/a/ca.pem")).ok());
  EXPECT_TRUE(server::CheckCaBundle(Slurp(dir_ + "/a/ca.pem") + Slurp(dir_ + "/b/ca.pem")).ok());
  EXPECT_EQ(server::CheckCaBundle("junk").message(), "--tls-client-ca: holds no PEM CERTIFICATE");
  std::string bent = Slurp(dir_ + "/a/ca.pem");
  bent.replace(bent.find('\n') + 1, 16, "AAAAAAAAAAAAAAAA");
  EXPECT_FALSE(server::CheckCaBundle(bent).ok());
}

mode_t Mode(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? (st.st_mode & 07777) : 0;
}
time_t Mtime(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_mtime : -1;
}

TEST_F(TlsTest, TheMirrorPublishesGenerationsBehindOneLinkAndRemovesItself) {
  const std::string tmp = TempDir("tls_mirror");
  ASSERT_EQ(::setenv("TMPDIR", tmp.c_str(), 1), 0);
  auto a = ServerCertificate::Read(dir_ + "/a/server-a.pem", dir_ + "/a/server-a.key");
  auto b = ServerCertificate::Read(dir_ + "/b/server-b.pem", dir_ + "/b/server-b.key");
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string ca = Slurp(dir_ + "/a/ca.pem");
  std::string root;
  {
    auto made = CertificateMirror::Create(**a, ca);
    ::unsetenv("TMPDIR");
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    CertificateMirror& m = **made;
    root = m.dir();
    EXPECT_EQ(root.rfind(tmp + "/imagegen-tls-", 0), 0u) << root;
    EXPECT_EQ(Mode(root), 0700u);
    EXPECT_EQ(Slurp(m.key_path()), (*a)->key_pem());
    EXPECT_EQ(Slurp(m.cert_path()), (*a)->cert_pem());
    EXPECT_EQ(Slurp(m.ca_path()), ca);
    EXPECT_EQ(Mode(m.key_path()), 0600u);
    EXPECT_EQ(Mode(m.cert_path()), 0600u);
    // gRPC pairs a key with a certificate only when neither's time changed while it read
    // them: every generation has times of its own (and never 0, which gRPC takes for an
    // error), near the present (a /tmp cleaner would take a file of 1970 for an old one).
    const time_t first = Mtime(m.key_path());
    EXPECT_GT(first, ::time(nullptr) - 3600);
    EXPECT_EQ(Mtime(m.cert_path()), first);
    for (int i = 0; i < 3; ++i) {
      const ServerCertificate& next = i % 2 == 0 ? **b : **a;
      ASSERT_TRUE(m.Publish(next, i == 2 ? "" : ca).ok());
      EXPECT_EQ(Slurp(m.key_path()), next.key_pem());
      EXPECT_EQ(Slurp(m.cert_path()), next.cert_pem());
      EXPECT_EQ(Mtime(m.key_path()), first + i + 1);
      EXPECT_EQ(Mtime(m.cert_path()), first + i + 1);
    }
    EXPECT_EQ(Mtime(m.ca_path()), -1);  // published without a CA the last time
    // The two latest generations stay (gRPC may still be reading the one before), no more.
    char target[64] = {};
    ASSERT_GT(::readlink((root + "/current").c_str(), target, sizeof target - 1), 0);
    EXPECT_STREQ(target, "g4");
    EXPECT_EQ(Mode(root + "/g3"), 0700u);
    EXPECT_EQ(Mode(root + "/g2"), 0u);
    EXPECT_EQ(Mode(root + "/g1"), 0u);
  }
  EXPECT_EQ(Mode(root), 0u) << "the mirror's directory outlived it";
  // An exit that skips the destructors (std::_Exit) removes the mirrors first; a mirror
  // removed so refuses to publish again.
  {
    ASSERT_EQ(::setenv("TMPDIR", tmp.c_str(), 1), 0);
    auto made = CertificateMirror::Create(**a, ca);
    ::unsetenv("TMPDIR");
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    root = (*made)->dir();
    ASSERT_EQ(Mode(root), 0700u);
    CertificateMirror::RemoveAllBeforeQuickExit();
    EXPECT_EQ(Mode(root), 0u);
    EXPECT_FALSE((*made)->Publish(**b, ca).ok());
    EXPECT_EQ(Mode(root), 0u);
  }

  // Nowhere to write: refused, saying what to do.
  ASSERT_EQ(::setenv("TMPDIR", "/nonexistent/dir", 1), 0);
  auto nowhere = CertificateMirror::Create(**a, "");
  ::unsetenv("TMPDIR");
  ASSERT_FALSE(nowhere.ok());
  EXPECT_NE(nowhere.status().message().find("set TMPDIR to a writable directory"),
            std::string::npos)
      << nowhere.status().message();
  EXPECT_NE(nowhere.status().message().find("/nonexistent/dir/imagegen-tls-"), std::string::npos)
      << nowhere.status().message();
  // Without TMPDIR the daemon tries /tmp, then /dev/shm (a read-only root without a writable
  // /tmp): the first place that takes a directory has the mirror.
  auto second = CertificateMirror::CreateIn({"/nonexistent/dir", tmp}, **a, "");
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ((*second)->dir().rfind(tmp + "/imagegen-tls-", 0), 0u) << (*second)->dir();
  EXPECT_EQ(Slurp((*second)->key_path()), (*a)->key_pem());
  second->reset();
  testing::RemoveTree(tmp);
}

// A daemon killed with SIGKILL leaves its mirror (a copy of the key); the next one to make a
// mirror in the same place removes it, and nothing that is not plainly such a leftover: a
// live daemon's (here, this process's, the Kubernetes case of a restarted container that has
// its predecessor's pid is the start-time check), one that names no owner yet, one made in
// another pid namespace, one holding a file of someone else's, a link.
TEST_F(TlsTest, AMirrorLeftByADaemonThatIsGoneIsRemovedByTheNextOne) {
  const std::string tmp = TempDir("tls_abandoned");
  auto a = ServerCertificate::Read(dir_ + "/a/server-a.pem", dir_ + "/a/server-a.key");
  ASSERT_TRUE(a.ok());
  char ns[128] = {};
  ASSERT_GT(::readlink("/proc/self/ns/pid", ns, sizeof ns - 1), 0);
  std::string boot = Slurp("/proc/sys/kernel/random/boot_id");
  boot = boot.substr(0, boot.find('\n'));
  // A child that has exited and been waited for: its pid names no process.
  std::string out;
  ASSERT_EQ(RunCommand({"/bin/bash", "-c", "echo $$"}, &out, tmp + "/child.log"), 0);
  const std::string dead_pid = out.substr(0, out.find('\n'));
  const std::string self = std::to_string(::getpid());
  // A mirror as a daemon leaves it: two generations, the link, the owner line.
  auto leftover = [&](const std::string& name, const std::string& owner) {
    const std::string d = tmp + "/" + name;
    for (const std::string& sub : {d, d + "/g3", d + "/g4"})
      ASSERT_EQ(::mkdir(sub.c_str(), 0700), 0);
    for (const char* f :
         {"/g3/key.pem", "/g3/cert.pem", "/g4/key.pem", "/g4/cert.pem", "/g4/ca.pem"}) {
      std::ofstream(d + f) << "secret";
    }
    ASSERT_EQ(::symlink("g4", (d + "/current").c_str()), 0);
    if (!owner.empty()) std::ofstream(d + "/owner") << owner << "\n";
  };
  const std::string here = std::string(ns) + " " + boot + " ";
  leftover("imagegen-tls-dead", here + dead_pid + " 12345");
  leftover("imagegen-tls-pidreused", here + self + " 1");  // this pid, another start time
  leftover("imagegen-tls-noowner", "");
  leftover("imagegen-tls-otherns", "pid:[1] " + boot + " " + dead_pid + " 12345");
  leftover("imagegen-tls-otherboot", std::string(ns) + " 0-0 " + dead_pid + " 12345");
  leftover("imagegen-tls-extra", here + dead_pid + " 12345");
  std::ofstream(tmp + "/imagegen-tls-extra/g3/notes.txt") << "not the daemon's";
  leftover("other-dead", here + dead_pid + " 12345");
  leftover("target", here + dead_pid + " 12345");
  ASSERT_EQ(::symlink("target", (tmp + "/imagegen-tls-link").c_str()), 0);

  ASSERT_EQ(::setenv("TMPDIR", tmp.c_str(), 1), 0);
  auto live = CertificateMirror::Create(**a, "");
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  auto next = CertificateMirror::Create(**a, "");
  ::unsetenv("TMPDIR");
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  std::vector<std::string> removed = (*live)->abandoned_removed();
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<std::string>{tmp + "/imagegen-tls-dead",
                                               tmp + "/imagegen-tls-pidreused"}));
  EXPECT_TRUE((*next)->abandoned_removed().empty()) << "a live mirror was taken for a leftover";
  EXPECT_EQ(Mode(tmp + "/imagegen-tls-dead"), 0u);
  EXPECT_EQ(Mode(tmp + "/imagegen-tls-pidreused"), 0u);
  for (const char* kept : {"imagegen-tls-noowner", "imagegen-tls-otherns", "imagegen-tls-otherboot",
                           "other-dead", "target"}) {
    EXPECT_EQ(Slurp(tmp + "/" + kept + "/g4/key.pem"), "secret") << kept;
  }
  EXPECT_EQ(Slurp(tmp + "/imagegen-tls-extra/g3/notes.txt"), "not the daemon's");
  EXPECT_EQ(Slurp(tmp + "/imagegen-tls-extra/g4/key.pem"), "secret");
  EXPECT_EQ(Slurp((*live)->key_path()), (*a)->key_pem());
  const std::string live_dir = (*live)->dir();
  live->reset();
  EXPECT_EQ(Mode(live_dir), 0u) << "the owner line kept the mirror's directory";
  next->reset();
  testing::RemoveTree(tmp);
}

// The HTTP API's handshakes ask a callback for the current certificate. With two HTTPS servers
// in one process (the daemon has one; tests may have more) each serves its own, and
// SetCertificate changes the next handshakes' of that server only.
TEST_F(TlsTest, EachHttpsServerServesItsOwnCertificateAndSetCertificateReplacesIt) {
  const auto a = Cert('a'), b = Cert('b');
  auto one = server::HttpApi::Start("127.0.0.1:0", &service_, a);
  auto two = server::HttpApi::Start("127.0.0.1:0", &service_, b);
  ASSERT_TRUE(one.ok() && two.ok());
  auto trusts = [](int port, const std::string& ca) { return HttpsTrusts(port, ca); };
  const int p1 = (*one)->port(), p2 = (*two)->port();
  EXPECT_TRUE(trusts(p1, "a/ca.pem"));
  EXPECT_FALSE(trusts(p1, "b/ca.pem"));
  EXPECT_TRUE(trusts(p2, "b/ca.pem"));
  EXPECT_FALSE(trusts(p2, "a/ca.pem"));
  (*one)->SetCertificate(b);
  EXPECT_TRUE(trusts(p1, "b/ca.pem"));
  EXPECT_FALSE(trusts(p1, "a/ca.pem"));
  EXPECT_TRUE(trusts(p2, "b/ca.pem"));
  (*two)->Stop(std::chrono::system_clock::now());
  // Alone again, the first server still serves.
  EXPECT_TRUE(trusts(p1, "b/ca.pem"));
}

// GnuTLS does not copy the certificate the handshake callback hands it, so the HTTPS API keeps
// a replaced certificate while a connection accepted before the change is open (its handshake,
// if it has not had it yet, may still take it), and frees it once no such connection is left:
// rotations do not pile up in memory.
TEST_F(TlsTest, AReplacedCertificateIsFreedOnceNoConnectionThatMayUseItIsOpen) {
  const auto a = Cert('a'), b = Cert('b');
  auto api = server::HttpApi::Start("127.0.0.1:0", &service_, a);
  ASSERT_TRUE(api.ok()) << api.status().ToString();
  server::HttpApi& https = **api;
  auto served = [&](const std::string& ca) { return HttpsTrusts(https.port(), ca); };
  // Polls (the library notes a closed connection on its own thread), generously.
  auto held_becomes = [&](int64_t n) {
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (https.certificates_held() != n && std::chrono::steady_clock::now() < limit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return https.certificates_held() == n;
  };
  EXPECT_EQ(https.certificates_held(), 1);
  // With no connection open, a replaced certificate goes at once.
  for (int i = 0; i < 4; ++i) https.SetCertificate(i % 2 == 0 ? b : a);
  EXPECT_EQ(https.certificates_held(), 1);
  EXPECT_TRUE(served("a/ca.pem"));
  EXPECT_TRUE(held_becomes(1));

  // A connection accepted now (no handshake yet) holds the current certificate and every later
  // one until it closes.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(https.port()));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to), 0);
  // The library accepts it on its own thread: once it has, a change keeps both.
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int64_t changes = 0;
  while (https.certificates_held() < 2 && std::chrono::steady_clock::now() < limit) {
    https.SetCertificate(changes++ % 2 == 0 ? b : a);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(https.certificates_held(), 2) << "the open connection's certificate was freed";
  https.SetCertificate(changes++ % 2 == 0 ? b : a);
  https.SetCertificate(changes++ % 2 == 0 ? b : a);
  EXPECT_EQ(https.certificates_held(), 4);
  // Connections that begin and end meanwhile free nothing the open one may use.
  EXPECT_TRUE(served(changes % 2 == 0 ? "a/ca.pem" : "b/ca.pem"));
  EXPECT_EQ(https.certificates_held(), 4);
  ::close(fd);
  EXPECT_TRUE(held_becomes(1)) << https.certificates_held() << " certificates held";
  EXPECT_TRUE(served(changes % 2 == 0 ? "a/ca.pem" : "b/ca.pem"));
}

}  // namespace
}  // namespace imagegen
