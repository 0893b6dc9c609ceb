#!/usr/bin/env bash
# Served A/B of RowAttention on every row: old (HEAD 70d8800, rows > 16 tokens through SDPA) and
# new load benches, alternating order per round; each run calibrates into its own cache dir.
set -euo pipefail
OLD=/tmp/rowmax/build/ci/bench/imagegen-load-bench
NEW=/work/main/build/ci/bench/imagegen-load-bench
OUT=${1:-/tmp/served_ab}
ROUNDS=${2:-5}
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  if [ $((i % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    bin=$OLD; [ $side = new ] && bin=$NEW
    OMP_NUM_THREADS=2 "$bin" --models-dir /work/main/models --methods scd-mc,sjd-pac --modes none,goodput \
      --concurrency 1,4 --seconds 4 --mixed-concurrency '' --cache-dir "$OUT/cache-$side" \
      --out-dir "$OUT/r$i-$side" > "$OUT/r$i-$side.log" 2>&1
  done
done
