#!/usr/bin/env bash
# Two builds of the daemon side by side: what a change gives the served daemon. The daemon of
# BUILD_A (say, a clean clone of the commit before the change, built) and that of BUILD_B, both
# on the bundled models with the same flags, under the same closed-loop gRPC load (`imagegen
# load`, BUILD_B's client for both) in ABAB order (bench/abab.sh): per cell one warm-up run on
# each (discarded), then ROUNDS pairs A, B. Each round gives a ratio B/A; the spread of A's runs
# among themselves is the noise. Each daemon calibrates its own step cost (a cache directory of
# its own), the second after the first is up.
#
#   bench/build_ab.sh BUILD_A BUILD_B [SECONDS] [ROUNDS] [CONCURRENCIES] [METHODS] [-- FLAG...]
#   (defaults: 10 3 "1 16" "ar scd-mc"; FLAGs go to both daemons)
#   git clone -q . /tmp/base && (cd /tmp/base && git checkout -q HEAD~1 && cmake --preset ci \
#     && ninja -C build/ci imagegen-server) && bench/build_ab.sh /tmp/base/build/ci build/ci
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,13p "$0"; exit 2; }
BUILD_A=$1 BUILD_B=$2
shift 2
SECS=10 ROUNDS=3 CONC="1 16" METHODS="ar scd-mc"
for v in SECS ROUNDS CONC METHODS; do
  [ $# -gt 0 ] && [ "$1" != "--" ] || break
  printf -v "$v" '%s' "$1"
  shift
done
[ $# -gt 0 ] && shift
FLAGS=("$@")
BUILD=$BUILD_B  # abab_port and abab_load run this build's client
OUT=$(mktemp -d /tmp/imagegen-build-ab.XXXXXX)
source bench/abab.sh
abab_start a "$BUILD_A" --cache_dir "$OUT/cache-a" ${FLAGS[@]+"${FLAGS[@]}"}
abab_start b "$BUILD_B" --cache_dir "$OUT/cache-b" ${FLAGS[@]+"${FLAGS[@]}"}
a_run() { abab_load "$port_a" "$@"; }
b_run() { abab_load "$port_b" "$@"; }
echo "A: $BUILD_A  B: $BUILD_B  flags: ${FLAGS[*]-}"
abab_header A B
for c in $CONC; do
  for method in $METHODS; do
    abab "$method" "$c" a_run b_run
  done
done
echo "logs: $OUT"
