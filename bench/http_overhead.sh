#!/usr/bin/env bash
# What the HTTP front costs against gRPC: one daemon with both ports, the same closed-loop load
# (same method, clients, classes and duration) through gRPC (`imagegen load`, C++) and through
# the OpenAI Images API (bench/http_load.py: Python's http.client on keep-alive connections,
# JSON, base64), in ABAB order: per setting one warm-up run (discarded: the goodput controller
# learns the setting), then ROUNDS pairs gRPC, HTTP. Each round gives a ratio HTTP/gRPC; the
# spread of the gRPC runs among themselves is the noise. The clients run on the same machine as
# the daemon and take CPU from it (the Python client more than the C++ one).
#
#   bench/http_overhead.sh [BUILD_DIR] [SECONDS] [ROUNDS]      (defaults: build/release 20 3)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
SECS=${2:-20}
ROUNDS=${3:-3}
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
grpc() {
  "$BUILD/client/imagegen" load --target "127.0.0.1:$port" --method "$1" --concurrency "$2" \
    --duration "$SECS" > "$3" 2>&1
}
http() {
  python3 bench/http_load.py --url "http://127.0.0.1:$http" --method "$1" --concurrency "$2" \
    --duration "$SECS" > "$3" 2>&1
}
median() { tr ' ' '\n' | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
printf "%-8s %3s | %-26s | %-26s | %-22s %s\n" method c "gRPC img/s p50 p99 (median)" \
  "HTTP img/s p50 p99 (median)" "HTTP/gRPC per round" "gRPC spread"
for method in ar scd-mc; do
  for c in 1 16; do
    grpc "$method" "$c" "$OUT/warmup.log"
    gi=() gp50=() gp99=() hi=() hp50=() hp99=() ratios=()
    for r in $(seq "$ROUNDS"); do
      grpc "$method" "$c" "$OUT/grpc-$method-$c-$r.log"
      http "$method" "$c" "$OUT/http-$method-$c-$r.log"
      read -r g a b < <(summary "$OUT/grpc-$method-$c-$r.log")
      read -r h x y < <(summary "$OUT/http-$method-$c-$r.log")
      gi+=("$g") gp50+=("$a") gp99+=("$b") hi+=("$h") hp50+=("$x") hp99+=("$y")
      ratios+=("$(awk -v h="$h" -v g="$g" 'BEGIN {printf "%.2f", h / g}')")
    done
    gm=$(echo "${gi[@]}" | median) hm=$(echo "${hi[@]}" | median)
    printf "%-8s %3s | %6.2f %6.3f %6.3f        | %6.2f %6.3f %6.3f        | %-22s %5.1f%%\n" \
      "$method" "$c" "$gm" "$(echo "${gp50[@]}" | median)" "$(echo "${gp99[@]}" | median)" \
      "$hm" "$(echo "${hp50[@]}" | median)" "$(echo "${hp99[@]}" | median)" "${ratios[*]}" \
      "$(echo "${gi[@]}" | tr ' ' '\n' | sort -g | awk -v m="$gm" 'NR == 1 {lo = $1} {hi = $1} END {print 100 * (hi - lo) / m}')"
  done
done
echo "logs: $OUT"
