#!/usr/bin/env bash
# What the gRPC layer costs: the same closed-loop load run twice, one after the other, in one
# run of this script: once on the engine's own API (imagegen-load-bench) and once through the
# daemon (imagegen load against imagegen-server on loopback: protobuf, HTTP/2, a handler
# thread per call). Same engine options on both sides.
#
#   bench/grpc_overhead.sh [BUILD_DIR] [SECONDS]      (defaults: build/release 20)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
SECS=${2:-20}
OUT=$(mktemp -d /tmp/imagegen-grpc-overhead.XXXXXX)
printf "%-8s %4s | %10s %8s %8s | %10s %8s %8s | %9s\n" method c "engine/s" "p50 s" "p99 s" \
  "daemon/s" "p50 s" "p99 s" "overhead"
for method in ar scd-mc; do
  for c in 1 16; do
    "$BUILD/bench/imagegen-load-bench" --methods "$method" --concurrency "$c" --seconds "$SECS" \
      --serial 0 --sweep-budgets "" --out-dir "$OUT/engine" > "$OUT/engine.log" 2>&1
    read -r e_ips e_p50 e_p99 < <(awk -F, 'NR == 2 {print $7, $8, $9}' "$OUT/engine/results.csv")
    rm -f "$OUT/ports"
    "$BUILD/server/imagegen-server" --listen 127.0.0.1:0 --metrics-listen "" --port-file "$OUT/ports" \
      --max-slots $((2 * c > 2 ? 2 * c : 2)) --max-queue "$c" > "$OUT/server.log" 2>&1 &
    pid=$!
    for _ in $(seq 200); do [ -s "$OUT/ports" ] && break; sleep 0.05; done
    read -r port _ < "$OUT/ports"
    for _ in $(seq 200); do
      "$BUILD/client/imagegen" models --target "127.0.0.1:$port" > /dev/null 2>&1 && break; sleep 0.05
    done
    "$BUILD/client/imagegen" load --target "127.0.0.1:$port" --method "$method" --concurrency "$c" \
      --duration "$SECS" > "$OUT/load.log" 2>&1
    kill -TERM "$pid"; wait "$pid" || true
    d_ips=$(awk '/images\/s/ {print $(NF-1)}' "$OUT/load.log")
    d_p50=$(awk '/^latency/ {print $4}' "$OUT/load.log")
    d_p99=$(awk '/^latency/ {print $8}' "$OUT/load.log")
    printf "%-8s %4s | %10.2f %8.3f %8.3f | %10.2f %8.3f %8.3f | %8.1f%%\n" "$method" "$c" \
      "$e_ips" "$e_p50" "$e_p99" "$d_ips" "$d_p50" "$d_p99" \
      "$(awk -v e="$e_ips" -v d="$d_ips" 'BEGIN {print 100 * (e - d) / e}')"
  done
done
echo "logs: $OUT"
