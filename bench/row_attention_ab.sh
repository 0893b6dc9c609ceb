#!/usr/bin/env bash
# What RowAttention (engine/model/row_attention.h, the daemon's --row_attention) gives the
# served daemon on the CPU: two daemons on the bundled models, one with one SDPA call per
# request and layer (--row_attention=false, "sdpa") and one with RowAttention (the default,
# "row"), under the same closed-loop gRPC load (`imagegen load`) in ABAB order (bench/abab.sh):
# per cell one warm-up run on each (discarded), then ROUNDS pairs sdpa, row. Each round gives a
# ratio row/sdpa; the spread of the sdpa runs among themselves is the noise. Each daemon
# calibrates its own step cost (a cache directory of its own), the second after the first is up.
#
#   bench/row_attention_ab.sh [BUILD_DIR] [SECONDS] [ROUNDS] [CONCURRENCIES]
#   (defaults: build/release 10 3 "1 16")
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
SECS=${2:-10}
ROUNDS=${3:-3}
CONC=${4:-1 16}
OUT=$(mktemp -d /tmp/imagegen-row-attention.XXXXXX)
start() {  # name, flags...
  local name=$1
  shift
  "$BUILD/server/imagegen-server" --listen 127.0.0.1:0 --metrics-listen "" --models fmnist-gpt \
    --cache_dir "$OUT/cache-$name" --port-file "$OUT/$name.ports" "$@" > "$OUT/$name.log" 2>&1 &
  echo $!
}
source bench/abab.sh
# One after the other: a daemon calibrates its step cost while it starts, and two calibrating
# at once on the same cores would each measure the other's load.
sdpa_pid=$(start sdpa --row_attention=false)
trap 'kill -TERM $sdpa_pid 2> /dev/null || true' EXIT
sdpa=$(abab_port sdpa)
row_pid=$(start row)
trap 'kill -TERM $sdpa_pid $row_pid 2> /dev/null || true' EXIT
row=$(abab_port row)
sdpa_run() { abab_load "$sdpa" "$@"; }
row_run() { abab_load "$row" "$@"; }
abab_header sdpa row
for c in $CONC; do
  for method in ar scd-mc; do
    abab "$method" "$c" sdpa_run row_run
  done
done
echo "logs: $OUT"
