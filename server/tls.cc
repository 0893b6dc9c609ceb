#include "server/tls.h"

#include <dirent.h>
#include <fcntl.h>
#include <gnutls/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "engine/util/read_file.h"

namespace imagegen::server {
namespace {

gnutls_datum_t Datum(const std::string& s) {
  return {reinterpret_cast<unsigned char*>(const_cast<char*>(s.data())),
          static_cast<unsigned>(s.size())};
}

// A file that holds no PEM block of its kind (gRPC and GnuTLS would say less).
Status HasPem(const char* flag, const std::string& data, const char* kind) {
  return data.find("-----BEGIN ") != std::string::npos &&
                 data.find(std::string(kind) + "-----") != std::string::npos
             ? OkStatus()
             : InvalidArgument(std::string(flag) + ": holds no PEM " + kind);
}

Status GnutlsError(const char* flag, const std::string& what, int rc) {
  return InvalidArgument(std::string(flag) + ": " + what + " (" + gnutls_strerror(rc) + ")");
}

// The SHA-256 key id of a public key; empty on failure.
std::string KeyId(gnutls_pubkey_t pub) {
  unsigned char id[64];
  size_t size = sizeof(id);
  if (gnutls_pubkey_get_key_id(pub, GNUTLS_KEYID_USE_SHA256, id, &size) < 0) return "";
  return std::string(reinterpret_cast<char*>(id), size);
}

}  // namespace

ServerCertificate::~ServerCertificate() {
  for (gnutls_pcert_st& p : chain_) gnutls_pcert_deinit(&p);
  if (key_ != nullptr) gnutls_privkey_deinit(key_);
}

StatusOr<std::shared_ptr<const ServerCertificate>> ServerCertificate::Parse(std::string cert_pem,
                                                                            std::string key_pem) {
  RETURN_IF_ERROR(HasPem("--tls-cert", cert_pem, "CERTIFICATE"));
  RETURN_IF_ERROR(HasPem("--tls-key", key_pem, "PRIVATE KEY"));
  std::shared_ptr<ServerCertificate> c(new ServerCertificate());
  c->cert_pem_ = std::move(cert_pem);
  c->key_pem_ = std::move(key_pem);

  gnutls_x509_crt_t* crts = nullptr;
  unsigned n = 0;
  const gnutls_datum_t cert_data = Datum(c->cert_pem_);
  int rc = gnutls_x509_crt_list_import2(&crts, &n, &cert_data, GNUTLS_X509_FMT_PEM, 0);
  if (rc < 0) return GnutlsError("--tls-cert", "not a PEM certificate chain", rc);
  // The pcerts keep what they need: the parsed certificates go whatever happens below.
  struct Crts {
    gnutls_x509_crt_t* list;
    unsigned n;
    ~Crts() {
      for (unsigned i = 0; i < n; ++i) gnutls_x509_crt_deinit(list[i]);
      gnutls_free(list);
    }
  } owned{crts, n};
  if (n == 0) return InvalidArgument("--tls-cert: holds no certificate");
  const time_t not_after = gnutls_x509_crt_get_expiration_time(crts[0]);
  if (not_after == static_cast<time_t>(-1)) {
    return InvalidArgument("--tls-cert: the first certificate has no readable expiry");
  }
  c->not_after_ = static_cast<int64_t>(not_after);
  gnutls_datum_t dn{nullptr, 0};
  if (gnutls_x509_crt_get_dn3(crts[0], &dn, 0) >= 0) {
    c->subject_.assign(reinterpret_cast<const char*>(dn.data), dn.size);
    gnutls_free(dn.data);
  }
  std::vector<gnutls_pcert_st> chain(n);
  unsigned imported = n;
  rc = gnutls_pcert_import_x509_list(chain.data(), crts, &imported, 0);
  if (rc < 0) return GnutlsError("--tls-cert", "cannot use the certificate chain", rc);
  chain.resize(imported);
  c->chain_ = std::move(chain);  // deinitialised by the destructor from here on

  rc = gnutls_privkey_init(&c->key_);
  if (rc < 0) return GnutlsError("--tls-key", "cannot allocate a key", rc);
  const gnutls_datum_t key_data = Datum(c->key_pem_);
  rc = gnutls_privkey_import_x509_raw(c->key_, &key_data, GNUTLS_X509_FMT_PEM, nullptr, 0);
  if (rc < 0) return GnutlsError("--tls-key", "not an unencrypted PEM private key", rc);

  gnutls_pubkey_t pub = nullptr;
  std::string key_id;
  if (gnutls_pubkey_init(&pub) >= 0) {
    if (gnutls_pubkey_import_privkey(pub, c->key_, 0, 0) >= 0) key_id = KeyId(pub);
    gnutls_pubkey_deinit(pub);
  }
  if (key_id.empty() || key_id != KeyId(c->chain_[0].pubkey)) {
    return InvalidArgument("--tls-key: not the private key of --tls-cert's first certificate (" +
                           c->subject_ + ")");
  }
  return std::shared_ptr<const ServerCertificate>(std::move(c));
}

std::string ServerCertificate::not_after_text() const {
  const time_t t = static_cast<time_t>(not_after_);
  tm utc{};
  char buf[32];
  if (gmtime_r(&t, &utc) == nullptr || strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &utc) == 0) {
    return std::to_string(not_after_);
  }
  return buf;
}

StatusOr<std::shared_ptr<const ServerCertificate>> ServerCertificate::Read(
    const std::string& cert_path, const std::string& key_path) {
  StatusOr<std::string> cert = ReadTlsFile("--tls-cert", cert_path);
  if (!cert.ok()) return cert.status();
  StatusOr<std::string> key = ReadTlsFile("--tls-key", key_path);
  if (!key.ok()) return key.status();
  return Parse(std::move(cert).value(), std::move(key).value());
}

}  // namespace imagegen::server

namespace imagegen::server {

StatusOr<std::string> ReadTlsFile(const std::string& flag, const std::string& path) {
  StatusOr<std::string> data = ReadFile(path, kMaxTlsFileBytes);
  if (!data.ok()) return InvalidArgument(flag + ": " + data.status().message());
  return data;
}

Status CheckCaBundle(const std::string& pem) {
  RETURN_IF_ERROR(HasPem("--tls-client-ca", pem, "CERTIFICATE"));
  gnutls_x509_crt_t* crts = nullptr;
  unsigned n = 0;
  const gnutls_datum_t data = Datum(pem);
  const int rc = gnutls_x509_crt_list_import2(&crts, &n, &data, GNUTLS_X509_FMT_PEM, 0);
  if (rc < 0) return GnutlsError("--tls-client-ca", "not a PEM certificate bundle", rc);
  for (unsigned i = 0; i < n; ++i) gnutls_x509_crt_deinit(crts[i]);
  gnutls_free(crts);
  return n > 0 ? OkStatus() : InvalidArgument("--tls-client-ca: holds no certificate");
}

namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// `data` into a new file of mode 0600 whose modification time is `mtime` seconds.
Status WritePrivate(const std::string& path, const std::string& data, int64_t mtime) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return Unavailable(Errno("cannot create " + path));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const Status st = Unavailable(Errno("cannot write " + path));
      ::close(fd);
      return st;
    }
    done += static_cast<size_t>(n);
  }
  const timespec times[2] = {{static_cast<time_t>(mtime), 0}, {static_cast<time_t>(mtime), 0}};
  const bool timed = ::futimens(fd, times) == 0;
  const Status st = timed ? OkStatus() : Unavailable(Errno("cannot set the time of " + path));
  ::close(fd);
  return st;
}

constexpr char kMirrorPrefix[] = "imagegen-tls-";
constexpr char kOwnerFile[] = "owner";

std::string FirstLine(const std::string& path) {
  StatusOr<std::string> text = ReadFile(path, 4096);
  if (!text.ok()) return "";
  return text->substr(0, text->find('\n'));
}

// What names a live process across pid reuse: its pid namespace and boot (a mirror made in
// another namespace or before a reboot cannot be judged from here), and the process's start
// time (field 22 of /proc/<pid>/stat, in clock ticks since boot). "" when there is none.
std::string ProcessStart(long pid) {
  const std::string stat = FirstLine("/proc/" + std::to_string(pid) + "/stat");
  const size_t comm_end = stat.rfind(')');  // the command name may hold spaces and ')'
  if (comm_end == std::string::npos) return "";
  size_t at = comm_end + 1;
  for (int field = 3; field <= 22; ++field) {
    at = stat.find_first_not_of(' ', at);
    if (at == std::string::npos) return "";
    const size_t end = std::min(stat.find(' ', at), stat.size());
    if (field == 22) return stat.substr(at, end - at);
    at = end;
  }
  return "";
}

std::string Namespace() {
  char target[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", target, sizeof target - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : "";
}

std::string BootId() { return FirstLine("/proc/sys/kernel/random/boot_id"); }

// The owner line of this process's mirrors: "<pid namespace> <boot id> <pid> <start time>".
std::string OwnerLine() {
  const long pid = static_cast<long>(::getpid());
  return Namespace() + " " + BootId() + " " + std::to_string(pid) + " " + ProcessStart(pid);
}

// Whether an owner line names a process of this namespace and boot that is gone.
bool OwnerIsGone(const std::string& line) {
  char ns[128] = {}, boot[64] = {}, start[32] = {};
  long pid = 0;
  if (std::sscanf(line.c_str(), "%127s %63s %ld %31s", ns, boot, &pid, start) != 4) return false;
  const std::string boot_here = BootId();
  if (pid <= 0 || ns != Namespace() || boot_here.empty() || boot != boot_here) return false;
  return ProcessStart(pid) != start;
}

// The entries of the directory open at `fd` (closed by the call), or nullopt on error.
std::optional<std::vector<std::string>> Entries(int fd) {
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    ::close(fd);
    return std::nullopt;
  }
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

bool IsGenerationName(const std::string& name) {
  return name.size() > 1 && name[0] == 'g' &&
         name.find_first_not_of("0123456789", 1) == std::string::npos;
}

// Removes the mirror `name` under the directory open at `parent` when it is this user's, holds
// only what a mirror holds, and its owner is gone. Relative to open directories, never
// following a link.
bool RemoveIfAbandoned(int parent, const std::string& name) {
  const int fd = ::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_uid != ::geteuid()) {
    ::close(fd);
    return false;
  }
  const int owner = ::openat(fd, kOwnerFile, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  char line[256] = {};
  const ssize_t n = owner < 0 ? -1 : ::read(owner, line, sizeof line - 1);
  if (owner >= 0) ::close(owner);
  const int dup = ::dup(fd);
  auto names = dup < 0 ? std::nullopt : Entries(dup);
  bool remove = n > 0 && names.has_value() && OwnerIsGone(std::string(line, line + n));
  // What it holds: its generations (a key, a certificate, a CA), the links, the owner.
  std::vector<std::pair<std::string, std::vector<std::string>>> generations;
  for (size_t i = 0; remove && i < names->size(); ++i) {
    const std::string& entry = (*names)[i];
    if (entry == kOwnerFile || entry == "current" || entry == "current.new") continue;
    const int g = IsGenerationName(entry)
                      ? ::openat(fd, entry.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                      : -1;
    auto files = g < 0 ? std::nullopt : Entries(g);
    remove = files.has_value();
    for (const std::string& f : files.value_or(std::vector<std::string>())) {
      remove = remove && (f == "key.pem" || f == "cert.pem" || f == "ca.pem");
    }
    if (remove) generations.emplace_back(entry, *std::move(files));
  }
  if (remove) {
    for (const auto& [g, files] : generations) {
      const int gfd = ::openat(fd, g.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (gfd < 0) continue;
      for (const std::string& f : files) ::unlinkat(gfd, f.c_str(), 0);
      ::close(gfd);
      ::unlinkat(fd, g.c_str(), AT_REMOVEDIR);
    }
    for (const char* f : {"current", "current.new", kOwnerFile}) ::unlinkat(fd, f, 0);
  }
  ::close(fd);
  return remove && ::unlinkat(parent, name.c_str(), AT_REMOVEDIR) == 0;
}

}  // namespace

std::vector<std::string> CertificateMirror::RemoveAbandoned(const std::string& parent) {
  std::vector<std::string> removed;
  const int fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return removed;
  const int dup = ::dup(fd);
  for (const std::string& name : Entries(dup).value_or(std::vector<std::string>())) {
    if (name.rfind(kMirrorPrefix, 0) == 0 && RemoveIfAbandoned(fd, name)) {
      removed.push_back(parent + "/" + name);
    }
  }
  ::close(fd);
  return removed;
}

StatusOr<std::unique_ptr<CertificateMirror>> CertificateMirror::Create(
    const ServerCertificate& certificate, const std::string& client_ca) {
  const char* tmp = std::getenv("TMPDIR");
  if (tmp != nullptr && *tmp != '\0') return CreateIn({tmp}, certificate, client_ca);
  // /dev/shm: a read-only root without a writable /tmp usually still has it (its own mount).
  return CreateIn({"/tmp", "/dev/shm"}, certificate, client_ca);
}

StatusOr<std::unique_ptr<CertificateMirror>> CertificateMirror::CreateIn(
    const std::vector<std::string>& parents, const ServerCertificate& certificate,
    const std::string& client_ca) {
  std::string tried;
  for (const std::string& parent : parents) {
    std::string pattern = parent + "/" + kMirrorPrefix + "XXXXXX";
    std::vector<std::string> abandoned = RemoveAbandoned(parent);
    if (::mkdtemp(pattern.data()) == nullptr) {
      tried += (tried.empty() ? "" : ", ") + Errno(pattern);
      continue;
    }
    std::unique_ptr<CertificateMirror> m(new CertificateMirror(pattern));
    m->Register();
    m->abandoned_removed_ = std::move(abandoned);
    // The owner first: a mirror that holds a key always names its owner.
    RETURN_IF_ERROR(WritePrivate(pattern + "/" + kOwnerFile, OwnerLine() + "\n",
                                 static_cast<int64_t>(::time(nullptr))));
    RETURN_IF_ERROR(m->Publish(certificate, client_ca));
    return m;
  }
  return FailedPrecondition(
      "--tls-cert: cannot make a private directory for the certificate gRPC reads (" + tried +
      "); set TMPDIR to a writable directory (on Kubernetes, an emptyDir on /tmp)");
}

namespace {
// The process's mirrors, for RemoveAllBeforeQuickExit; the mutex also orders every mirror's
// publications and removal (both rare).
std::mutex mirrors_mu;
std::set<CertificateMirror*>& Mirrors() {
  static auto* mirrors = new std::set<CertificateMirror*>();
  return *mirrors;
}
}  // namespace

void CertificateMirror::Register() {
  std::lock_guard<std::mutex> l(mirrors_mu);
  Mirrors().insert(this);
}

void CertificateMirror::RemoveAllBeforeQuickExit() {
  std::lock_guard<std::mutex> l(mirrors_mu);
  for (CertificateMirror* m : Mirrors()) m->RemoveFiles();
}

Status CertificateMirror::Publish(const ServerCertificate& certificate,
                                  const std::string& client_ca) {
  std::lock_guard<std::mutex> l(mirrors_mu);
  if (removed_) return FailedPrecondition("the TLS mirror was removed (the process is exiting)");
  const int64_t g = generation_ + 1;
  const std::string name = "g" + std::to_string(g);
  const std::string gen = dir_ + "/" + name;
  RemoveGeneration(g);  // a leftover of a publication that failed half-way
  if (::mkdir(gen.c_str(), 0700) != 0) return Unavailable(Errno("cannot create " + gen));
  const int64_t mtime = epoch_ + g;  // distinct per generation, never 0, near the present
  Status st = WritePrivate(gen + "/key.pem", certificate.key_pem(), mtime);
  if (st.ok()) st = WritePrivate(gen + "/cert.pem", certificate.cert_pem(), mtime);
  if (st.ok() && !client_ca.empty()) st = WritePrivate(gen + "/ca.pem", client_ca, mtime);
  const std::string link = dir_ + "/current.new";
  ::unlink(link.c_str());
  if (st.ok() && ::symlink(name.c_str(), link.c_str()) != 0) {
    st = Unavailable(Errno("cannot link " + link));
  }
  if (st.ok() && ::rename(link.c_str(), (dir_ + "/current").c_str()) != 0) {
    st = Unavailable(Errno("cannot replace " + dir_ + "/current"));
  }
  if (!st.ok()) {
    RemoveGeneration(g);
    return st;
  }
  generation_ = g;
  RemoveGeneration(g - 2);
  return OkStatus();
}

void CertificateMirror::RemoveGeneration(int64_t generation) const {
  if (generation < 1) return;
  const std::string gen = dir_ + "/g" + std::to_string(generation);
  for (const char* f : {"/key.pem", "/cert.pem", "/ca.pem"}) ::unlink((gen + f).c_str());
  ::rmdir(gen.c_str());
}

void CertificateMirror::RemoveFiles() {
  if (removed_) return;
  removed_ = true;
  for (int64_t g = generation_; g >= generation_ - 1; --g) RemoveGeneration(g);
  ::unlink((dir_ + "/current").c_str());
  ::unlink((dir_ + "/current.new").c_str());
  ::unlink((dir_ + "/" + kOwnerFile).c_str());
  ::rmdir(dir_.c_str());
}

CertificateMirror::~CertificateMirror() {
  std::lock_guard<std::mutex> l(mirrors_mu);
  Mirrors().erase(this);
  RemoveFiles();
}

}  // namespace imagegen::server
