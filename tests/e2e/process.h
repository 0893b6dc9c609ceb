// End-to-end test plumbing: child processes (the real daemon, Prometheus, the clients), free
// loopback ports, and a minimal HTTP GET. POSIX only; no LibTorch, no gRPC.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace imagegen::testing {

inline std::string Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A child process whose stdout and stderr go to `log`.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::string& log,
          const std::vector<std::string>& env_extra = {})
      : log_(log) {
    std::vector<char*> args;
    std::vector<std::string> a = argv;
    for (auto& s : a) args.push_back(s.data());
    args.push_back(nullptr);
    // `env_extra`'s NAME=value entries replace the inherited ones of the same name.
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('=') + 1);
      bool replaced = false;
      for (const auto& x : env_extra) replaced = replaced || x.rfind(name, 0) == 0;
      if (!replaced) env.push_back(entry);
    }
    for (const auto& e : env_extra) env.push_back(e);
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    if (posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Process() {
    if (running()) {
      ::kill(pid_, SIGKILL);
      Wait(std::chrono::seconds(10));
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !exited_; }
  void Signal(int sig) const {
    if (running()) ::kill(pid_, sig);
  }
  // The exit status (128 + signal if killed), or -1 if still running after `timeout`.
  int Wait(std::chrono::milliseconds timeout) {
    if (exited_) return status_;
    if (pid_ <= 0) return 127;  // not started (posix_spawn takes a path: no PATH search)
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (true) {
      int st = 0;
      const pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return status_;
      }
      if (std::chrono::steady_clock::now() >= end) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::string Log() const { return Slurp(log_); }

 private:
  std::string log_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
};

// Runs a command to completion; returns its exit status, output in *out.
inline int RunCommand(const std::vector<std::string>& argv, std::string* out,
                      const std::string& log, const std::vector<std::string>& env_extra = {},
                      std::chrono::seconds timeout = std::chrono::seconds(300)) {
  Process p(argv, log, env_extra);
  const int rc = p.Wait(timeout);
  *out = p.Log();
  return rc;
}

// A loopback port that was free a moment ago.
inline int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// GET http://127.0.0.1:port/path -> (status code, body); status 0 if the connection failed.
inline std::pair<int, std::string> HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return {0, ""};
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string resp;
  char buf[65536];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) resp.append(buf, static_cast<size_t>(n));
  ::close(fd);
  const auto sp = resp.find(' ');
  const auto body = resp.find("\r\n\r\n");
  if (sp == std::string::npos || body == std::string::npos) return {0, resp};
  return {std::atoi(resp.c_str() + sp + 1), resp.substr(body + 4)};
}

inline std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      char b[4];
      std::snprintf(b, sizeof(b), "%%%02X", c);
      out += b;
    }
  }
  return out;
}

// The value of one sample line "name{labels} value" in a text exposition (labels in the order
// the exposition prints them); NaN if absent.
inline double MetricValue(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nan("");
}

}  // namespace imagegen::testing
