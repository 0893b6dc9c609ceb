#!/usr/bin/env bash
# What the HTTP front costs against gRPC: one daemon with both ports, the same closed-loop load
# (same method, clients, classes and duration) through gRPC (`imagegen load`, C++) and through
# the OpenAI Images API (bench/http_load.py: Python's http.client on keep-alive connections,
# JSON, base64), in ABAB order (bench/abab.sh): per setting one warm-up run of each (discarded:
# the goodput controller learns the setting), then ROUNDS pairs gRPC, HTTP. Each round gives a ratio HTTP/gRPC; the
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
source bench/abab.sh
grpc() {  # method, clients, log
  "$BUILD/client/imagegen" load --target "127.0.0.1:$port" --method "$1" --concurrency "$2" \
    --duration "$SECS" > "$3" 2>&1
}
http() {
  python3 bench/http_load.py --url "http://127.0.0.1:$http" --method "$1" --concurrency "$2" \
    --duration "$SECS" > "$3" 2>&1
}
abab_header gRPC HTTP
for method in ar scd-mc; do
  for c in 1 16; do
    abab "$method" "$c" grpc http
  done
done
echo "logs: $OUT"
