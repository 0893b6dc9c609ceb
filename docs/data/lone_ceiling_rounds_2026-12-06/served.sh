#!/usr/bin/env bash
# One client of scd-mc under goodput, each run with a fresh step-cost calibration: the load bench
# of 70d8800 (one request's shapes timed one width after another) and of this change (in rounds),
# alternating order, ROUNDS rounds.
set -euo pipefail
OLD=/tmp/rowmax/build/ci/bench/imagegen-load-bench
NEW=/work/main/build/ci/bench/imagegen-load-bench
OUT=${1:-/tmp/cal_served}
ROUNDS=${2:-8}
rm -rf "$OUT"; mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  if [ $((i % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    bin=$OLD; [ $side = new ] && bin=$NEW
    OMP_NUM_THREADS=2 "$bin" --models-dir /work/main/models --methods scd-mc,sjd --modes goodput \
      --concurrency 1 --seconds 4 --mixed-concurrency '' --cache-dir "$OUT/cache-$i-$side" \
      --out-dir "$OUT/r$i-$side" > "$OUT/r$i-$side.log" 2>&1
  done
done
