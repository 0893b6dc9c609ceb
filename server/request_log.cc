#include "server/request_log.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <random>

namespace imagegen::server {
namespace {

using json = nlohmann::ordered_json;

bool RequestIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.' || c == ':' || c == '/' || c == '+' || c == '=' || c == '@';
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::string Timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[40];
  const size_t k = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + k, sizeof buf - k, ".%03dZ", static_cast<int>(ms));
  return buf;
}

// A logfmt value: as it is when it is a plain word, else quoted with \" \\ and control
// characters escaped.
std::string Value(const std::string& v) {
  bool plain = !v.empty();
  for (unsigned char c : v) {
    if (c <= ' ' || c == '"' || c == '=' || c == '\\' || c == 0x7f) plain = false;
  }
  if (plain) return v;
  std::string out = "\"";
  for (unsigned char c : v) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < ' ' || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string Fixed(double x, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

double Ratio(double num, double den) { return den > 0 ? num / den : 0; }

// Builds one line in either format from ordered (key, value) pairs.
class Line {
 public:
  Line(LogFormat f, const std::string& event) : f_(f) {
    if (f_ == LogFormat::kJson) {
      j_["ts"] = Timestamp();
      j_["event"] = event;
    } else {
      s_ = "imagegen-server: " + event;
    }
  }
  Line& Str(const std::string& k, const std::string& v) {
    if (f_ == LogFormat::kJson) {
      j_[k] = v;
    } else {
      s_ += " " + k + "=" + Value(v);
    }
    return *this;
  }
  Line& Int(const std::string& k, int64_t v) {
    if (f_ == LogFormat::kJson) {
      j_[k] = v;
    } else {
      s_ += " " + k + "=" + std::to_string(v);
    }
    return *this;
  }
  Line& Num(const std::string& k, double v, int digits) {
    if (f_ == LogFormat::kJson) {
      j_[k] = std::stod(Fixed(v, digits));  // rounded as the text line rounds it
    } else {
      s_ += " " + k + "=" + Fixed(v, digits);
    }
    return *this;
  }
  std::string Done() const {
    return (f_ == LogFormat::kJson ? j_.dump(-1, ' ', false, json::error_handler_t::replace) : s_) +
           "\n";
  }

 private:
  const LogFormat f_;
  json j_ = json::object();
  std::string s_;
};

}  // namespace

bool ParseLogFormat(const std::string& name, LogFormat* out) {
  if (name == "text") {
    *out = LogFormat::kText;
  } else if (name == "json") {
    *out = LogFormat::kJson;
  } else {
    return false;
  }
  return true;
}

bool ValidRequestId(const std::string& id) {
  if (id.empty() || id.size() > kMaxRequestIdLength) return false;
  for (char c : id) {
    if (!RequestIdChar(c)) return false;
  }
  return true;
}

std::optional<TraceParent> ParseTraceparent(std::string_view v) {
  auto hex = [&](size_t from, size_t n, bool nonzero) {
    bool any = false;
    for (size_t i = from; i < from + n; ++i) {
      const char c = v[i];
      if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
      any |= c != '0';
    }
    return any || !nonzero;
  };
  constexpr size_t kLength = 55;  // 00-<32>-<16>-<2>
  if (v.size() < kLength || !hex(0, 2, false) || v.substr(0, 2) == "ff") return std::nullopt;
  if (v.substr(0, 2) == "00" ? v.size() != kLength : (v.size() > kLength && v[kLength] != '-')) {
    return std::nullopt;
  }
  if (v[2] != '-' || v[35] != '-' || v[52] != '-' || !hex(3, 32, true) || !hex(36, 16, true) ||
      !hex(53, 2, false)) {
    return std::nullopt;
  }
  TraceParent t;
  t.trace_id = std::string(v.substr(3, 32));
  t.parent_id = std::string(v.substr(36, 16));
  const char flags = v[54];
  t.sampled = ((flags >= 'a' ? flags - 'a' + 10 : flags - '0') & 1) != 0;
  return t;
}

std::string RequestIdError(const std::string& id) {
  return "must be 1 to " + std::to_string(kMaxRequestIdLength) +
         " characters of A-Z, a-z, 0-9 and -_.:/+=@ (got " + std::to_string(id.size()) +
         " characters" + (id.size() <= kMaxRequestIdLength ? ", not all of them allowed" : "") +
         ")";
}

std::string NewRequestId() {
  static const uint64_t kProcess = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  static std::atomic<uint64_t> counter{0};
  const uint64_t n = counter.fetch_add(1);
  char buf[40];
  std::snprintf(buf, sizeof buf, "req_%016llx%016llx",
                static_cast<unsigned long long>(SplitMix64(kProcess)),
                static_cast<unsigned long long>(SplitMix64(kProcess ^ SplitMix64(n))));
  return buf;
}

WorkTotals WorkTotals::operator-(const WorkTotals& e) const {
  return {steps - e.steps,
          committed - e.committed,
          request_forwards - e.request_forwards,
          images - e.images,
          drafts_verified - e.drafts_verified,
          drafts_accepted - e.drafts_accepted,
          step_seconds - e.step_seconds,
          cpu_wait_steps - e.cpu_wait_steps,
          cpu_wait_seconds - e.cpu_wait_seconds,
          cpu_wait_step_seconds - e.cpu_wait_step_seconds};
}

std::optional<double> WorkTotals::CpuWaitShare() const {
  if (cpu_wait_steps <= 0 || !(cpu_wait_step_seconds > 0)) return std::nullopt;
  return std::clamp(cpu_wait_seconds / cpu_wait_step_seconds, 0.0, 1.0);
}

void CallRecord::AddImage(const RequestResult& r) {
  if (images_sent == 0) seed = r.seed;
  images_sent += 1;
  const RequestCounters& c = r.stats.counters;
  tokens += c.tokens;
  nfe += c.nfe;
  drafts_verified += c.drafts_verified;
  drafts_accepted += c.drafts_accepted;
  prompt_tokens = std::max(prompt_tokens, r.prompt_tokens);
  queue_seconds = std::max(queue_seconds, r.stats.queue_seconds);
  preemptions += r.stats.preemptions;
}

std::string FormatMessage(LogFormat format, const std::string& message) {
  if (format == LogFormat::kText) return "imagegen-server: " + message + "\n";
  return Line(format, "log").Str("msg", message).Done();
}

std::string FormatCall(LogFormat format, const CallRecord& r) {
  // What the client named is logged as it came, up to a bound: a request that names a 4 MB
  // model (refused NOT_FOUND) must not write 4 MB to the log.
  auto cut = [](const std::string& v, size_t max) {
    return v.size() <= max ? v : v.substr(0, max) + "...(" + std::to_string(v.size()) + " bytes)";
  };
  Line l(format, "request");
  l.Str("request_id", r.request_id).Str("api", r.api);
  if (r.trace.has_value()) {
    l.Str("trace_id", r.trace->trace_id).Str("parent_span_id", r.trace->parent_id);
  }
  if (!r.peer.empty()) l.Str("peer", r.peer);
  if (!r.address.empty()) l.Str("addr", r.address);
  if (!r.key.empty()) l.Str("key", r.key);
  if (!r.user.empty()) l.Str("user", cut(r.user, kMaxLoggedName));
  l.Str("model", r.model.empty() ? "-" : cut(r.model, kMaxLoggedName)).Str("method", r.method);
  if (r.priority != 0) l.Int("priority", r.priority);
  l.Int("n", r.images).Str("outcome", r.outcome);
  if (r.http_status != 0) l.Int("status", r.http_status);
  l.Num("seconds", r.seconds, 3);
  if (r.images_sent > 0) {
    l.Int("images", r.images_sent).Int("tokens", r.tokens).Int("nfe", r.nfe);
    l.Num("tokens_per_forward", Ratio(static_cast<double>(r.tokens), static_cast<double>(r.nfe)),
          2);
    if (r.drafts_verified > 0) {
      l.Num("acceptance",
            Ratio(static_cast<double>(r.drafts_accepted), static_cast<double>(r.drafts_verified)),
            3);
    }
    if (r.prompt_tokens > 0) l.Int("prompt_tokens", r.prompt_tokens);
    l.Num("queue_seconds", r.queue_seconds, 3);
    if (r.preemptions > 0) l.Int("preemptions", r.preemptions);
    if (r.seed.has_value()) l.Str("seed", std::to_string(*r.seed));
  }
  if (!r.error.empty()) l.Str("error", r.error);
  return l.Done();
}

std::string FormatStats(LogFormat format, const StatsRecord& r) {
  const double s = r.interval_seconds;
  const WorkTotals& w = r.work;
  Line l(format, "stats");
  l.Str("model", r.model).Num("interval_seconds", s, 1);
  l.Int("running", r.running).Int("queued", r.queued);
  l.Str("kv_slots", std::to_string(r.slots_used) + "/" + std::to_string(r.slots_total));
  l.Num("steps_per_second", Ratio(static_cast<double>(w.steps), s), 1);
  l.Num("tokens_per_second", Ratio(static_cast<double>(w.committed), s), 1);
  l.Num("images_per_second", Ratio(static_cast<double>(w.images), s), 2);
  l.Num("tokens_per_forward",
        Ratio(static_cast<double>(w.committed), static_cast<double>(w.request_forwards)), 2);
  if (w.drafts_verified > 0) {
    l.Num("acceptance",
          Ratio(static_cast<double>(w.drafts_accepted), static_cast<double>(w.drafts_verified)), 3);
  }
  l.Num("busy", Ratio(w.step_seconds, s), 2);
  if (const std::optional<double> wait = w.CpuWaitShare()) l.Num("cpu_wait", *wait, 2);
  if (r.cpu_threads_max > 0) {
    l.Str("cpu_threads", std::to_string(r.cpu_threads) + "/" + std::to_string(r.cpu_threads_max));
  }
  return l.Done();
}

std::optional<std::string> CpuWaitWarning(const StatsRecord& r) {
  const std::optional<double> share = r.work.CpuWaitShare();
  if (!share || *share < kCpuWaitWarnShare || r.work.cpu_wait_step_seconds < kCpuWaitWarnSeconds) {
    return std::nullopt;
  }
  // On the CPU, the count now against the start's (--adaptive-cpu-threads lowers it while the
  // wait lasts).
  char threads[96] = "";
  if (r.cpu_threads_max > 0) {
    std::snprintf(threads, sizeof threads, "; --adaptive-cpu-threads lowers them, now %lld of %lld",
                  static_cast<long long>(r.cpu_threads), static_cast<long long>(r.cpu_threads_max));
  }
  char text[640];
  std::snprintf(text, sizeof text,
                "%s: the engine thread waited for a CPU %.0f%% of its step time in the last "
                "%.0f s: other work shares the daemon's cores, and each step waits at every "
                "parallel region for the thread that is off its core. On shared cores fewer "
                "--cpu-threads than the cores serve more (docs/deploy.md, \"Cores shared with "
                "other busy work\"%s); imagegen_engine_cpu_wait_seconds_total counts it",
                r.model.c_str(), *share * 100, r.interval_seconds, threads);
  return std::string(text);
}

RequestLog::RequestLog(LogFormat format, int fd, size_t max_queued)
    : format_(format), fd_(fd), max_queued_(std::max<size_t>(max_queued, 1)) {
  writer_ = std::thread([this] { Run(); });
}

RequestLog::~RequestLog() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  writer_.join();
}

void RequestLog::Write(std::string line) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (lines_.size() >= max_queued_) {
      dropped_ += 1;
      unreported_ += 1;
      return;
    }
    if (unreported_ > 0) {
      lines_.push_back(FormatMessage(format_, std::to_string(unreported_) +
                                                  " log lines dropped (the log was not read "
                                                  "fast enough)"));
      unreported_ = 0;
    }
    lines_.push_back(std::move(line));
  }
  cv_.notify_one();
}

int64_t RequestLog::dropped() const {
  std::lock_guard<std::mutex> l(mu_);
  return dropped_;
}

void RequestLog::Flush() {
  std::unique_lock<std::mutex> l(mu_);
  idle_cv_.wait(l, [&] { return lines_.empty() && !writing_; });
}

void RequestLog::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] { return stop_ || !lines_.empty(); });
    if (lines_.empty()) return;  // stopping, and everything is written
    std::string line = std::move(lines_.front());
    lines_.pop_front();
    writing_ = true;
    l.unlock();
    for (size_t off = 0; off < line.size();) {
      const ssize_t k = ::write(fd_, line.data() + off, line.size() - off);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) break;  // a closed or broken file: the line is lost, the daemon goes on
      off += static_cast<size_t>(k);
    }
    l.lock();
    writing_ = false;
    if (lines_.empty()) idle_cv_.notify_all();
  }
}

}  // namespace imagegen::server
