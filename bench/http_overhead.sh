#!/usr/bin/env bash
# What the HTTP front costs against gRPC: one daemon with both ports, the same closed-loop load
# (same method, clients, classes and duration) through gRPC (`imagegen load`, C++), through
# the OpenAI Images API (bench/http_load.py: Python's http.client on keep-alive connections,
# JSON, base64), and through gRPC again, so that the two gRPC runs give the run-to-run noise.
# The clients run on the same machine as the daemon and take CPU from it (the Python client
# more than the C++ one).
#
#   bench/http_overhead.sh [BUILD_DIR] [SECONDS]      (defaults: build/release 20)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
SECS=${2:-20}
OUT=$(mktemp -d /tmp/imagegen-http-overhead.XXXXXX)
"$BUILD/server/imagegen-server" --listen 127.0.0.1:0 --metrics-listen "" --http-listen 127.0.0.1:0 \
  --models fmnist-gpt --port-file "$OUT/ports" > "$OUT/server.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2> /dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$OUT/ports" ] && break; sleep 0.05; done
read -r port _ http < "$OUT/ports"
for _ in $(seq 600); do
  "$BUILD/client/imagegen" health --target "127.0.0.1:$port" > /dev/null 2>&1 && break; sleep 0.1
done
summary() {  # images/s, p50, p99 of a load log
  awk '/images\/s/ {ips = $(NF-1)} /^latency/ {p50 = $4; p99 = $8} END {print ips, p50, p99}' "$1"
}
printf "%-8s %4s | %-22s | %-22s | %-22s | %8s %8s\n" method c "gRPC images/s p50 p99" \
  "HTTP images/s p50 p99" "gRPC again" "HTTP/gRPC" "noise"
for method in ar scd-mc; do
  for c in 1 16; do
    "$BUILD/client/imagegen" load --target "127.0.0.1:$port" --method "$method" --concurrency "$c" \
      --duration "$SECS" > "$OUT/grpc1.log" 2>&1
    python3 bench/http_load.py --url "http://127.0.0.1:$http" --method "$method" \
      --concurrency "$c" --duration "$SECS" > "$OUT/http.log" 2>&1
    "$BUILD/client/imagegen" load --target "127.0.0.1:$port" --method "$method" --concurrency "$c" \
      --duration "$SECS" > "$OUT/grpc2.log" 2>&1
    read -r g1 g1p50 g1p99 < <(summary "$OUT/grpc1.log")
    read -r h hp50 hp99 < <(summary "$OUT/http.log")
    read -r g2 g2p50 g2p99 < <(summary "$OUT/grpc2.log")
    printf "%-8s %4s | %7.2f %6.3f %6.3f | %7.2f %6.3f %6.3f | %7.2f %6.3f %6.3f | %8.3f %7.1f%%\n" \
      "$method" "$c" "$g1" "$g1p50" "$g1p99" "$h" "$hp50" "$hp99" "$g2" "$g2p50" "$g2p99" \
      "$(awk -v h="$h" -v a="$g1" -v b="$g2" 'BEGIN {print 2 * h / (a + b)}')" \
      "$(awk -v a="$g1" -v b="$g2" 'BEGIN {d = a - b; if (d < 0) d = -d; print 200 * d / (a + b)}')"
  done
done
echo "logs: $OUT"
