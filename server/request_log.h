// The daemon's log lines about its work, on stderr (what an operator reads with `docker logs` or
// `kubectl logs`):
//
//   - one `request` line per generation call, from either front (gRPC or the HTTP API), when
//     the call ends: its request id, the caller's trace (W3C traceparent), front, peer, model,
//     method, images, outcome (the
//     imagegen_requests_total label) and error message, seconds, and over its images the
//     tokens, NFE, acceptance, the longest queue wait and the first image's seed;
//   - every --log-stats-seconds, one `stats` line per model that had work in the interval
//     (vLLM's and TGI's periodic throughput line): requests running and queued, KV slots,
//     steps, tokens and images per second, tokens per forward, acceptance and the share of the
//     interval the engine spent in steps.
//
// Format `text` is "imagegen-server: <event> key=value ..." (logfmt after the prefix: values
// with spaces, quotes or '=' are quoted, control characters escaped); `json` is one JSON object
// per line with "ts" (RFC 3339, UTC, milliseconds) and "event".
//
// Lines are formatted on the caller's thread and written by the log's own thread from a bounded
// queue, so a stderr that does not keep up (a full pipe) costs dropped lines, counted and
// reported in the next line written, never a blocked encoder or engine thread. Prompts are
// never logged (their length in tokens is). Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "engine/scheduler/engine.h"

namespace imagegen::server {

enum class LogFormat { kText, kJson };
// "text" or "json"; false for anything else.
bool ParseLogFormat(const std::string& name, LogFormat* out);

// A client's request id (gRPC metadata or HTTP header `x-request-id`) is used as given when it
// is 1 to 128 characters of A-Z, a-z, 0-9 and "-_.:/+=@"; an empty one counts as absent.
constexpr size_t kMaxRequestIdLength = 128;
bool ValidRequestId(const std::string& id);
// The error for an invalid one (what the field violation of `x-request-id` says).
std::string RequestIdError(const std::string& id);
// A new id: "req_" and 32 hex digits (a per-process random half and a counter, mixed), unique
// within the process and, with overwhelming probability, across processes.
std::string NewRequestId();

// The caller's W3C Trace Context (gRPC metadata or HTTP header `traceparent`,
// https://www.w3.org/TR/trace-context/), logged so that the call's line can be found from the
// caller's trace (Loki's derived fields to Tempo, say). The daemon makes no spans of its own.
struct TraceParent {
  std::string trace_id;   // 32 lowercase hex digits, not all zero
  std::string parent_id;  // the caller's span: 16 lowercase hex digits, not all zero
  bool sampled = false;   // trace-flags bit 0
};
// As the specification parses it: version 00 exactly 55 characters; a later version (not ff)
// at least 55, its first 55 read as version 00's and then "-" or the end. Anything else is no
// trace context (nullopt), which the specification says to ignore rather than refuse.
std::optional<TraceParent> ParseTraceparent(std::string_view value);

// One generation call, as its `request` line says it.
struct CallRecord {
  std::string request_id;
  std::optional<TraceParent> trace;  // the caller's, when it sent a valid one
  std::string api;                   // grpc, grpc-stream, http, http-stream
  std::string peer;                  // "ipv4:127.0.0.1:41234", "ipv6:[::1]:41234"
  std::string model, method;
  std::string user;     // the request's own (empty: none named)
  std::string key;      // the name of the caller's API key (empty: unnamed, or no auth)
  std::string address;  // the caller's, when X-Forwarded-For named it (forwarded.h)
  int priority = 0;     // the request's, or its key's default
  int images = 1;       // asked for (n)
  std::string outcome;  // ok, invalid_argument, ... (imagegen_requests_total's label)
  std::string error;    // the message of an outcome other than ok
  int http_status = 0;  // the HTTP front: the status line sent (0: none, or gRPC)
  double seconds = 0;   // from the call's arrival to its end
  // Over the images sent to the client.
  int images_sent = 0;
  int64_t tokens = 0, nfe = 0, drafts_verified = 0, drafts_accepted = 0, prompt_tokens = 0;
  double queue_seconds = 0;      // the longest wait of its images for a KV slot
  int64_t preemptions = 0;       // times its images gave up their KV slots to more urgent ones
  std::optional<uint64_t> seed;  // the first image's

  void AddImage(const RequestResult& r);
};

// A model's work (kept since the start by Metrics; a stats line reports the difference over
// its interval): engine steps, image tokens committed, per-request forwards (NFE), images
// sent, drafts verified and accepted, and the seconds the steps took.
struct WorkTotals {
  int64_t steps = 0, committed = 0, request_forwards = 0, images = 0;
  int64_t drafts_verified = 0, drafts_accepted = 0;
  double step_seconds = 0;
  // Of the steps with a reading of the engine thread's run-queue wait (StepSample::
  // cpu_wait_seconds): how many, the wait and the steps' time.
  int64_t cpu_wait_steps = 0;
  double cpu_wait_seconds = 0, cpu_wait_step_seconds = 0;
  WorkTotals operator-(const WorkTotals& earlier) const;
  // The share of those steps' time the engine thread waited for a CPU; nullopt without any.
  std::optional<double> CpuWaitShare() const;
};

// One model over one interval, as its `stats` line says it.
struct StatsRecord {
  std::string model;
  double interval_seconds = 0;
  int64_t running = 0, queued = 0, slots_used = 0, slots_total = 0;
  // The engine thread's intra-op threads at the interval's end and at start (0: not the CPU).
  int64_t cpu_threads = 0, cpu_threads_max = 0;
  WorkTotals work;  // in the interval
};

// A line as `format` writes it (with its newline): the daemon's own messages, calls and stats.
std::string FormatMessage(LogFormat format, const std::string& message);
// The request's model and user are logged up to this many bytes, then "...(<n> bytes)".
constexpr size_t kMaxLoggedName = 256;
std::string FormatCall(LogFormat format, const CallRecord& r);
std::string FormatStats(LogFormat format, const StatsRecord& r);
// What the daemon says when a model's engine thread waited for a CPU for at least
// kCpuWaitWarnShare of its step time over an interval with at least kCpuWaitWarnSeconds of
// steps (the daemon says it at most every 10 minutes a model); nullopt otherwise.
constexpr double kCpuWaitWarnShare = 0.2, kCpuWaitWarnSeconds = 1.0;
std::optional<std::string> CpuWaitWarning(const StatsRecord& r);

class RequestLog {
 public:
  // Writes to `fd` (not closed); at most `max_queued` lines wait, beyond that they are dropped.
  explicit RequestLog(LogFormat format, int fd = 2, size_t max_queued = 4096);
  ~RequestLog();  // writes what is queued, then stops
  RequestLog(const RequestLog&) = delete;
  RequestLog& operator=(const RequestLog&) = delete;

  LogFormat format() const { return format_; }
  void Call(const CallRecord& r) { Write(FormatCall(format_, r)); }
  void Stats(const StatsRecord& r) { Write(FormatStats(format_, r)); }
  void Message(const std::string& m) { Write(FormatMessage(format_, m)); }
  // Queues a formatted line; never blocks on the file.
  void Write(std::string line);
  // Lines dropped so far because the queue was full.
  int64_t dropped() const;
  // Blocks until every line queued so far has been written (tests; the destructor).
  void Flush();

 private:
  void Run();

  const LogFormat format_;
  const int fd_;
  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::string> lines_;
  bool writing_ = false, stop_ = false;
  int64_t dropped_ = 0, unreported_ = 0;
  std::thread writer_;
};

}  // namespace imagegen::server
