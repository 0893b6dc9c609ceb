#!/usr/bin/env bash
# What the daemon's log costs (server/request_log.h): two daemons on the same models, one with
# every log line on (a JSON request line per call, a stats line every second, stderr to a
# file) and one with none (--log-requests=false --log-stats-seconds 0), under the same
# closed-loop gRPC load (`imagegen load`) in ABAB order (bench/abab.sh): per setting one warm-up run on each
# (discarded), then ROUNDS pairs off, on. Each round gives a ratio on/off; the spread of the
# "off" runs among themselves is the noise. Many short calls (ar, 16 clients) log the most
# lines per second.
#
#   bench/log_overhead.sh [BUILD_DIR] [SECONDS] [ROUNDS]      (defaults: build/release 20 3)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
SECS=${2:-20}
ROUNDS=${3:-3}
OUT=$(mktemp -d /tmp/imagegen-log-overhead.XXXXXX)
source bench/abab.sh
abab_start on "$BUILD" --log-format json --log-stats-seconds 1
abab_start off "$BUILD" --log-requests=false --log-stats-seconds 0
off_run() { abab_load "$port_off" "$@"; }
on_run() { abab_load "$port_on" "$@"; }
abab_header off on
for method in ar scd-mc; do
  abab "$method" 16 off_run on_run
done
echo "log lines written by the logging daemon: $(grep -c '"event":"request"' "$OUT/on.log") request," \
  "$(grep -c '"event":"stats"' "$OUT/on.log") stats; dropped notices:" \
  "$(grep -c 'log lines dropped' "$OUT/on.log" || true)"
echo "logs: $OUT"
