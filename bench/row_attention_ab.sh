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
source bench/abab.sh
abab_start sdpa "$BUILD" --cache_dir "$OUT/cache-sdpa" --row_attention=false
abab_start row "$BUILD" --cache_dir "$OUT/cache-row"
sdpa_run() { abab_load "$port_sdpa" "$@"; }
row_run() { abab_load "$port_row" "$@"; }
abab_header sdpa row
for c in $CONC; do
  for method in ar scd-mc; do
    abab "$method" "$c" sdpa_run row_run
  done
done
echo "logs: $OUT"
