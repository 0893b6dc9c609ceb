// The daemon's log lines (server/request_log.h): request ids, the text and JSON shapes of a
// call's and a model's line, and a log whose reader stops: it drops lines (counted and then
// reported) rather than block the threads that log. The lines of a running daemon:
// E2eTest.RequestLogNamesEveryCallByTheIdItEchoes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <regex>
#include <set>
#include <string>

#include "server/request_log.h"

namespace imagegen::testing {
namespace {

using server::CallRecord;
using server::FormatCall;
using server::FormatStats;
using server::LogFormat;
using server::RequestLog;
using server::StatsRecord;

TEST(RequestLogTest, RequestIdsAreCheckedAndNewOnesAreUnique) {
  EXPECT_TRUE(server::ValidRequestId("req_abc"));
  EXPECT_TRUE(server::ValidRequestId("7f1c9a2e-1b2d-4c3e-9f00-0a1b2c3d4e5f"));  // a UUID
  EXPECT_TRUE(server::ValidRequestId("trace:a/b+c=d@e.f"));
  EXPECT_TRUE(server::ValidRequestId(std::string(128, 'x')));
  EXPECT_FALSE(server::ValidRequestId(""));
  EXPECT_FALSE(server::ValidRequestId(std::string(129, 'x')));
  EXPECT_FALSE(server::ValidRequestId("a b"));
  EXPECT_FALSE(server::ValidRequestId("a\nimagegen-server: request forged=1"));
  EXPECT_FALSE(server::ValidRequestId("a\"b"));
  EXPECT_NE(server::RequestIdError(std::string(200, 'x')).find("got 200 characters"),
            std::string::npos);

  const std::regex shape("req_[0-9a-f]{32}");
  std::set<std::string> seen;
  for (int i = 0; i < 20000; ++i) {
    const std::string id = server::NewRequestId();
    ASSERT_TRUE(std::regex_match(id, shape)) << id;
    ASSERT_TRUE(server::ValidRequestId(id)) << id;
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 20000u);
}

CallRecord Sample() {
  CallRecord r;
  r.request_id = "req_1";
  r.api = "http";
  r.peer = "ipv4:127.0.0.1:41234";
  r.model = "fmnist-gpt";
  r.method = "scd-mc";
  r.images = 2;
  r.outcome = "ok";
  r.http_status = 200;
  r.seconds = 0.41234;
  RequestResult a, b;
  a.seed = 7;
  a.prompt_tokens = 0;
  a.stats.counters = {.nfe = 60,
                      .draft_forwards = 0,
                      .drafts_verified = 300,
                      .drafts_accepted = 136,
                      .tokens = 196};
  a.stats.queue_seconds = 0.25;
  b = a;
  b.seed = 8;
  b.stats.counters.nfe = 40;
  b.stats.queue_seconds = 0.5;
  r.AddImage(a);
  r.AddImage(b);
  return r;
}

TEST(RequestLogTest, ACallIsOneLineOfKeyValuesOrOneJsonObject) {
  CallRecord r = Sample();
  const std::string text = FormatCall(LogFormat::kText, r);
  EXPECT_EQ(text,
            "imagegen-server: request request_id=req_1 api=http peer=ipv4:127.0.0.1:41234 "
            "model=fmnist-gpt method=scd-mc n=2 outcome=ok status=200 seconds=0.412 images=2 "
            "tokens=392 nfe=100 tokens_per_forward=3.92 acceptance=0.453 queue_seconds=0.500 "
            "seed=7\n");

  const nlohmann::json j = nlohmann::json::parse(FormatCall(LogFormat::kJson, r));
  EXPECT_EQ(j["event"], "request");
  EXPECT_TRUE(std::regex_match(j["ts"].get<std::string>(),
                               std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)")))
      << j["ts"];
  EXPECT_EQ(j["request_id"], "req_1");
  EXPECT_EQ(j["nfe"], 100);
  EXPECT_EQ(j["tokens"], 392);
  EXPECT_DOUBLE_EQ(j["acceptance"].get<double>(), 0.453);
  EXPECT_EQ(j["seed"], "7");  // a string: 64-bit seeds do not survive a JSON double
  EXPECT_FALSE(j.contains("error"));
  EXPECT_FALSE(j.contains("preemptions"));  // only when an image was preempted

  // Preemptions are summed over the images sent.
  CallRecord p = Sample();
  RequestResult c;
  c.stats.preemptions = 2;
  p.AddImage(c);
  EXPECT_NE(FormatCall(LogFormat::kText, p).find(" queue_seconds=0.500 preemptions=2 seed=7\n"),
            std::string::npos)
      << FormatCall(LogFormat::kText, p);

  // An error message with quotes, '=' and a newline stays on one line, and reads back.
  CallRecord e;
  e.request_id = "req_2";
  e.api = "grpc";
  e.method = "unknown";
  e.outcome = "invalid_argument";
  e.error = "top_p: must be in (0, 1], got \"2\"\nsecond=line";
  const std::string et = FormatCall(LogFormat::kText, e);
  EXPECT_EQ(std::count(et.begin(), et.end(), '\n'), 1) << et;
  EXPECT_NE(et.find(R"(error="top_p: must be in (0, 1], got \"2\"\nsecond=line")"),
            std::string::npos)
      << et;
  EXPECT_NE(et.find("model=- "), std::string::npos) << et;  // no model resolved
  EXPECT_EQ(et.find("images="), std::string::npos) << et;   // no image was sent
  const nlohmann::json ej = nlohmann::json::parse(FormatCall(LogFormat::kJson, e));
  EXPECT_EQ(ej["error"], e.error);
  EXPECT_FALSE(ej.contains("status"));

  // Invalid UTF-8 from a client does not break the JSON line.
  e.error = std::string("bad \xff byte");
  const nlohmann::json bad = nlohmann::json::parse(FormatCall(LogFormat::kJson, e));
  EXPECT_EQ(bad["error"], "bad \xef\xbf\xbd byte");  // U+FFFD in its place

  // A model or user name as long as a message may be is cut, in both formats.
  e.model = std::string(4 << 20, 'm');
  e.user = std::string(1 << 20, 'u');
  const std::string lt = FormatCall(LogFormat::kText, e);
  EXPECT_LT(lt.size(), 2000u);
  EXPECT_NE(
      lt.find(" model=\"" + std::string(server::kMaxLoggedName, 'm') + "...(4194304 bytes)\" "),
      std::string::npos)
      << lt.substr(0, 200);
  const nlohmann::json lj = nlohmann::json::parse(FormatCall(LogFormat::kJson, e));
  EXPECT_EQ(lj["user"], std::string(server::kMaxLoggedName, 'u') + "...(1048576 bytes)");
}

// W3C Trace Context's traceparent, parsed as its specification says (the examples are its own
// shapes): version 00 exactly, a later version's first fields, and everything it says to
// ignore.
TEST(RequestLogTest, TraceparentIsParsedAsTheSpecificationSaysAndLogged) {
  const std::string tid = "4bf92f3577b34da6a3ce929d0e0e4736", pid = "00f067aa0ba902b7";
  auto t = server::ParseTraceparent("00-" + tid + "-" + pid + "-01");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->trace_id, tid);
  EXPECT_EQ(t->parent_id, pid);
  EXPECT_TRUE(t->sampled);
  t = server::ParseTraceparent("00-" + tid + "-" + pid + "-00");
  ASSERT_TRUE(t.has_value());
  EXPECT_FALSE(t->sampled);
  EXPECT_TRUE(server::ParseTraceparent("00-" + tid + "-" + pid + "-0b")->sampled);
  // A later version: its first fields as 00's, then "-" and whatever it adds, or the end.
  EXPECT_TRUE(server::ParseTraceparent("cc-" + tid + "-" + pid + "-01").has_value());
  EXPECT_TRUE(
      server::ParseTraceparent("cc-" + tid + "-" + pid + "-01-what-the-future-adds").has_value());
  EXPECT_FALSE(server::ParseTraceparent("cc-" + tid + "-" + pid + "-01x").has_value());
  // What is to be ignored.
  for (const std::string& bad : {
           std::string(""),
           "ff-" + tid + "-" + pid + "-01",                       // version ff
           "00-" + tid + "-" + pid + "-01-extra",                 // 00 has no more fields
           "00-" + tid + "-" + pid + "-1",                        // short flags
           "00-00000000000000000000000000000000-" + pid + "-01",  // zero trace id
           "00-" + tid + "-0000000000000000-01",                  // zero parent id
           "00-4BF92F3577B34DA6A3CE929D0E0E4736-" + pid + "-01",  // uppercase
           "00-" + tid.substr(1) + "-" + pid + "0-01",            // fields shifted
           "00_" + tid + "-" + pid + "-01",                       // separator
           "0g-" + tid + "-" + pid + "-01",                       // version not hex
           "00-" + tid + "-" + pid.substr(0, 15) + "z-01",        // parent id not hex
       }) {
    EXPECT_FALSE(server::ParseTraceparent(bad).has_value()) << bad;
  }
  // Logged beside the request id, in both formats; absent without one.
  CallRecord r = Sample();
  r.trace = server::ParseTraceparent("00-" + tid + "-" + pid + "-01");
  EXPECT_NE(
      FormatCall(LogFormat::kText, r)
          .find("request_id=req_1 api=http trace_id=" + tid + " parent_span_id=" + pid + " peer="),
      std::string::npos)
      << FormatCall(LogFormat::kText, r);
  const nlohmann::json j = nlohmann::json::parse(FormatCall(LogFormat::kJson, r));
  EXPECT_EQ(j["trace_id"], tid);
  EXPECT_EQ(j["parent_span_id"], pid);
  EXPECT_FALSE(nlohmann::json::parse(FormatCall(LogFormat::kJson, Sample())).contains("trace_id"));
}

TEST(RequestLogTest, AStatsLineGivesRatesOverItsInterval) {
  StatsRecord s;
  s.model = "fmnist-gpt";
  s.interval_seconds = 10;
  s.running = 3;
  s.queued = 1;
  s.slots_used = 6;
  s.slots_total = 64;
  const server::WorkTotals before{.steps = 500,
                                  .committed = 120,
                                  .request_forwards = 400,
                                  .images = 2,
                                  .drafts_verified = 1000,
                                  .drafts_accepted = 220,
                                  .step_seconds = 3.0};
  server::WorkTotals after = before;
  after.steps += 2000;
  after.committed += 5880;
  after.request_forwards += 2100;
  after.images += 30;
  after.drafts_verified += 9000;
  after.drafts_accepted += 3780;
  after.step_seconds += 9.1;
  s.work = after - before;
  EXPECT_EQ(FormatStats(LogFormat::kText, s),
            "imagegen-server: stats model=fmnist-gpt interval_seconds=10.0 running=3 queued=1 "
            "kv_slots=6/64 steps_per_second=200.0 tokens_per_second=588.0 images_per_second=3.00 "
            "tokens_per_forward=2.80 acceptance=0.420 busy=0.91\n");
  const nlohmann::json j = nlohmann::json::parse(FormatStats(LogFormat::kJson, s));
  EXPECT_EQ(j["event"], "stats");
  EXPECT_DOUBLE_EQ(j["tokens_per_second"].get<double>(), 588.0);
  EXPECT_EQ(j["kv_slots"], "6/64");
  EXPECT_FALSE(j.contains("cpu_wait"));  // no reading of the engine thread's wait
  EXPECT_FALSE(server::CpuWaitWarning(s).has_value());
}

// The engine thread's wait for a CPU: its share of the steps' time in the stats line, and the
// warning from kCpuWaitWarnShare with at least kCpuWaitWarnSeconds of steps in the interval.
TEST(RequestLogTest, CpuWaitIsAShareOfStepTimeAndWarnsFromAFifth) {
  StatsRecord s;
  s.model = "fmnist-gpt";
  s.interval_seconds = 10;
  s.work.steps = 3000;
  s.work.step_seconds = 9.0;
  s.work.cpu_wait_steps = 3000;
  s.work.cpu_wait_step_seconds = 9.0;
  s.work.cpu_wait_seconds = 3.15;
  s.cpu_threads = 1;  // lowered by --adaptive-cpu-threads
  s.cpu_threads_max = 2;
  EXPECT_NE(FormatStats(LogFormat::kText, s).find(" busy=0.90 cpu_wait=0.35 cpu_threads=1/2\n"),
            std::string::npos)
      << FormatStats(LogFormat::kText, s);
  const std::optional<std::string> w = server::CpuWaitWarning(s);
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->rfind("fmnist-gpt: the engine thread waited for a CPU 35% of its step time in the "
                     "last 10 s",
                     0),
            0u)
      << *w;
  EXPECT_NE(w->find("--cpu-threads"), std::string::npos) << *w;
  EXPECT_NE(w->find("now 1 of 2"), std::string::npos) << *w;
  StatsRecord cuda = s;  // no CPU threads to speak of
  cuda.cpu_threads = cuda.cpu_threads_max = 0;
  EXPECT_EQ(server::CpuWaitWarning(cuda)->find("adaptive"), std::string::npos);

  s.work.cpu_wait_seconds = 0.19 * 9.0;  // under a fifth
  EXPECT_FALSE(server::CpuWaitWarning(s).has_value());
  s.work.cpu_wait_seconds = 0.21 * 9.0;
  EXPECT_TRUE(server::CpuWaitWarning(s).has_value());
  s.work.cpu_wait_step_seconds = 0.9;  // a few steps: too little to say
  s.work.cpu_wait_seconds = 0.5;
  EXPECT_FALSE(server::CpuWaitWarning(s).has_value());
}

// Reads what is in the pipe now (non-blocking).
std::string Available(int fd) {
  std::string out;
  char buf[65536];
  ssize_t k;
  while ((k = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(k));
  return out;
}

TEST(RequestLogTest, AReaderThatStopsCostsDroppedLinesNeverABlockedCaller) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  ::fcntl(p[0], F_SETFL, O_NONBLOCK);
  {
    RequestLog log(LogFormat::kText, p[1], /*max_queued=*/16);
    log.Message("first");
    log.Flush();
    EXPECT_EQ(Available(p[0]), "imagegen-server: first\n");

    // Nobody reads: the pipe fills (64 KiB), the writer blocks in write(2), the queue fills.
    // Each Write still returns at once (a blocking one would hang the test here).
    const std::string line(1000, 'x');
    for (int i = 0; i < 2000; ++i) log.Write(line + "\n");
    EXPECT_GT(log.dropped(), 1000);
    const int64_t dropped = log.dropped();

    // The reader comes back: what was queued is written (it fits in the emptied pipe), and
    // the next line is preceded by the count of the lines that were not.
    std::string got = Available(p[0]);
    log.Flush();
    log.Message("after");
    log.Flush();
    got += Available(p[0]);
    // Every dropped line is reported (in one notice or several: a line that found room in
    // the flood reports the drops before it).
    const std::regex notice(
        "imagegen-server: (\\d+) log lines dropped \\(the log was not read fast enough\\)\n");
    int64_t reported = 0;
    for (auto it = std::sregex_iterator(got.begin(), got.end(), notice);
         it != std::sregex_iterator(); ++it) {
      reported += std::stoll((*it)[1]);
    }
    EXPECT_EQ(reported, dropped);
    EXPECT_EQ(got.substr(got.size() - 23), "imagegen-server: after\n");
    EXPECT_EQ(log.dropped(), dropped);
  }
  ::close(p[0]);
  ::close(p[1]);
}

}  // namespace
}  // namespace imagegen::testing
