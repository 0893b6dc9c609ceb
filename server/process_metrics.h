// The process's own metrics, as Prometheus' client libraries export them (the "process"
// collector of client_golang and client_python; prometheus-cpp has none): CPU seconds, resident
// and virtual memory, open and maximum file descriptors, start time. Read from /proc at scrape
// time (Linux). A memory or descriptor leak shows on the dashboard and can be alerted on
// without a node exporter or cAdvisor in reach of the pod.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace imagegen::server {

// The fields of /proc/<pid>/stat that the collector reads (proc(5): utime, stime, starttime in
// clock ticks; vsize in bytes; rss in pages).
struct ProcStat {
  uint64_t utime_ticks = 0, stime_ticks = 0, start_ticks = 0, vsize_bytes = 0;
  int64_t rss_pages = 0;
};
// Parses the text of /proc/<pid>/stat. The command name (field 2) is in parentheses and may
// itself hold spaces and parentheses: the fields that follow are counted from its last ')'.
std::optional<ProcStat> ParseProcStat(const std::string& text);
// The boot time (the `btime` line of /proc/stat), in Unix seconds.
std::optional<int64_t> ParseBootTime(const std::string& proc_stat);

class ProcessMetrics : public prometheus::Collectable {
 public:
  // process_cpu_seconds_total, process_resident_memory_bytes, process_virtual_memory_bytes,
  // process_open_fds, process_max_fds, process_start_time_seconds; a value /proc cannot give
  // is left out.
  std::vector<prometheus::MetricFamily> Collect() const override;
};

}  // namespace imagegen::server
