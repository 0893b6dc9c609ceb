#!/usr/bin/env bash
# N fresh step-cost calibrations of the daemon on the bundled model: the lone-request ceilings
# each says at start.
set -uo pipefail
BIN=${1:-/work/main/build/ci/server/imagegen-server}
N=${2:-8}
OUT=${3:-/tmp/cal_noise}
rm -rf "$OUT"; mkdir -p "$OUT"
for i in $(seq 1 "$N"); do
  d=$OUT/$i; mkdir -p "$d"
  OMP_NUM_THREADS=2 "$BIN" --models-dir /work/main/models --models fmnist-gpt --cache-dir "$d/cache" \
    --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --port-file "$d/ports" > "$d/log" 2>&1 &
  pid=$!
  for k in $(seq 1 600); do grep -q "ready:" "$d/log" && break; sleep 0.1; done
  kill $pid; wait $pid 2>/dev/null
  echo "$i: $(grep -o 'calibration): .*' "$d/log" | cut -c15-)"
done
