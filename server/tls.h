// The daemon's server certificate (--tls-cert, --tls-key): read from PEM files and checked with
// GnuTLS (each file holds its kind of PEM block, the chain parses, the key parses and is the
// key of the chain's first certificate), in the form GnuTLS's handshake callback hands out (the
// HTTP API's port), with the subject and expiry the log and /metrics report.
//
// Rotation (docs/serving.md, "Security"): the daemon checks the files every --tls-poll-seconds
// and on SIGHUP; when their bytes differ from what it serves it reads them again, and a pair
// (and client CA) that passes these checks is served on both ports from the next handshake: the
// HTTP API's callback hands out the new ServerCertificate, and gRPC's file watcher reads it from
// the CertificateMirror. A pair that fails them is refused, and both ports keep the last good
// one (gRPC's watcher, pointed at the operator's files, would take a broken or half-written
// pair as it is and fail every handshake until it is fixed).
#pragma once

#include <gnutls/abstract.h>
#include <gnutls/gnutls.h>

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "engine/util/status.h"

namespace imagegen::server {

// The largest TLS file read (a certificate chain, a key, a CA bundle): a bound on what a wrong
// path (a device file) makes the daemon allocate.
inline constexpr size_t kMaxTlsFileBytes = 4 << 20;

class ServerCertificate {
 public:
  // From PEM text. Errors name the flag of the part at fault ("--tls-cert: ...", "--tls-key:
  // ..."), as the start-up check reports them.
  static StatusOr<std::shared_ptr<const ServerCertificate>> Parse(std::string cert_pem,
                                                                  std::string key_pem);
  // Reads both files, then Parse. A file that cannot be read names its flag too.
  static StatusOr<std::shared_ptr<const ServerCertificate>> Read(const std::string& cert_path,
                                                                 const std::string& key_path);
  ~ServerCertificate();
  ServerCertificate(const ServerCertificate&) = delete;
  ServerCertificate& operator=(const ServerCertificate&) = delete;

  const std::string& cert_pem() const { return cert_pem_; }
  const std::string& key_pem() const { return key_pem_; }
  // The first certificate's subject (RFC 4514) and end of validity (Unix seconds).
  const std::string& subject() const { return subject_; }
  int64_t not_after() const { return not_after_; }
  std::string not_after_text() const;  // 2026-12-31T23:59:59Z

  // For gnutls_certificate_retrieve_function2: valid while this object lives; GnuTLS does not
  // free them.
  gnutls_pcert_st* chain() const { return chain_.data(); }
  unsigned chain_length() const { return static_cast<unsigned>(chain_.size()); }
  gnutls_privkey_t key() const { return key_; }

 private:
  ServerCertificate() = default;
  std::string cert_pem_, key_pem_, subject_;
  int64_t not_after_ = 0;
  mutable std::vector<gnutls_pcert_st> chain_;
  gnutls_privkey_t key_ = nullptr;
};

// A TLS file (at most kMaxTlsFileBytes), errors naming `flag` ("--tls-cert: <path>: ...").
StatusOr<std::string> ReadTlsFile(const std::string& flag, const std::string& path);

// Checks a CA bundle (--tls-client-ca): PEM certificates that GnuTLS parses.
Status CheckCaBundle(const std::string& pem);

// The checked TLS files that gRPC's file watcher reads (FileWatcherCertificateProvider on
// key_path(), cert_path(), ca_path(), every second): a private directory (mode 0700, files 0600,
// under $TMPDIR when it is set, else /tmp, or /dev/shm where /tmp is not writable) that holds one
// generation of files per published certificate behind a symbolic link swapped atomically. Each
// generation's files carry a modification time of their own (the mirror's creation time plus the
// generation's number, in seconds): gRPC reads a key and certificate again when either time changed
// while it read them, so it never pairs one generation's key with another's certificate. The two
// latest generations are kept (gRPC may be reading the previous one). The directory names its owner
// (pid namespace, boot id, pid, start time): the mirrors of daemons that died without removing
// theirs (SIGKILL, the OOM killer) are removed by the next daemon that makes one in the same place
// (a pod's emptyDir /tmp outlives its container, and the new daemon may have the same pid).
class CertificateMirror {
 public:
  // Makes the directory and publishes the first generation. `client_ca` empty: no CA file.
  static StatusOr<std::unique_ptr<CertificateMirror>> Create(const ServerCertificate& certificate,
                                                             const std::string& client_ca);
  // The same in the first of `parents` where a directory can be made (Create's are $TMPDIR, or
  // /tmp and /dev/shm); FAILED_PRECONDITION naming each when none takes one.
  static StatusOr<std::unique_ptr<CertificateMirror>> CreateIn(
      const std::vector<std::string>& parents, const ServerCertificate& certificate,
      const std::string& client_ca);
  // The mirrors of dead daemons under `parent` (imagegen-tls-*, this user's, whose owner is
  // gone) removed; returns their paths. Only what a mirror holds is removed: a directory with
  // anything else in it, or that names no owner (one being made), is left. Create calls it.
  static std::vector<std::string> RemoveAbandoned(const std::string& parent);
  // What Create's RemoveAbandoned removed (the daemon logs it).
  const std::vector<std::string>& abandoned_removed() const { return abandoned_removed_; }
  // Removes every mirror of the process now, for an exit that skips the destructors
  // (std::_Exit: a SIGTERM while the models load, a second signal while draining); safe from
  // any thread at any time. A mirror removed refuses later publications.
  static void RemoveAllBeforeQuickExit();
  ~CertificateMirror();  // removes the directory
  CertificateMirror(const CertificateMirror&) = delete;
  CertificateMirror& operator=(const CertificateMirror&) = delete;

  // A new generation, served by gRPC from its watcher's next read (within a second).
  Status Publish(const ServerCertificate& certificate, const std::string& client_ca);

  std::string key_path() const { return dir_ + "/current/key.pem"; }
  std::string cert_path() const { return dir_ + "/current/cert.pem"; }
  std::string ca_path() const { return dir_ + "/current/ca.pem"; }
  const std::string& dir() const { return dir_; }

 private:
  explicit CertificateMirror(std::string dir)
      : dir_(std::move(dir)), epoch_(static_cast<int64_t>(::time(nullptr))) {}
  void Register();
  void RemoveFiles();  // under the mirrors' mutex
  void RemoveGeneration(int64_t generation) const;
  const std::string dir_;
  const int64_t epoch_;
  int64_t generation_ = 0;
  std::vector<std::string> abandoned_removed_;
  bool removed_ = false;
};

}  // namespace imagegen::server
