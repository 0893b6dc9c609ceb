#!/usr/bin/env bash
# One cell per process, the two forwards in alternating order, ROUNDS rounds.
set -euo pipefail
BIN=/tmp/rowmax/build/ci/bench/imagegen-step-cost
ROUNDS=${1:-8}
OUT=${2:-/tmp/rowcells.csv}
echo "round,requests,tok_per_req,forward,median_ms" > "$OUT"
for cell in 1:16 1:32 1:64 1:128 1:192 4:16 4:32 4:64 4:128 16:16 16:24 16:32; do
  r=${cell%%:*}; n=${cell##*:}; t=$((r * n))
  for i in $(seq 1 "$ROUNDS"); do
    if [ $((i % 2)) -eq 1 ]; then order="eager-sdpa eager"; else order="eager eager-sdpa"; fi
    for fw in $order; do
      ms=$(OMP_NUM_THREADS=2 "$BIN" --models-dir /work/main/models --forwards "$fw" --reps 20 \
        --requests "$r" --tokens "$t" | awk -v t="$t" '$3 == t && NF >= 8 {print $5}' | tail -1)
      echo "$i,$r,$n,$fw,$ms" >> "$OUT"
    done
  done
done
