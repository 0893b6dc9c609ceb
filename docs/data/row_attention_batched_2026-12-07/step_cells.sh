#!/usr/bin/env bash
# The padded (batch_invariant off) forward with RowAttention ("eager") against its one padded SDPA
# call ("eager-sdpa", --row_attention off): one cell per process, the two in alternating order,
# ROUNDS rounds, 100 committed entries before each row's new tokens, 2 threads.
set -euo pipefail
BIN=${BIN:-build/ci/bench/imagegen-step-cost}
ROUNDS=${1:-6}
OUT=${2:-/tmp/rowcells_batched.csv}
echo "round,requests,tok_per_req,forward,median_ms" > "$OUT"
for cell in 1:1 1:16 1:64 16:1 16:4 16:16 16:64 64:1 64:4 64:16; do
  r=${cell%%:*}; n=${cell##*:}; t=$((r * n))
  for i in $(seq 1 "$ROUNDS"); do
    if [ $((i % 2)) -eq 1 ]; then order="eager-sdpa eager"; else order="eager eager-sdpa"; fi
    for fw in $order; do
      ms=$(OMP_NUM_THREADS=2 "$BIN" --models-dir models --batch-invariant 0 --prefix 100 \
        --forwards "$fw" --reps 10 --requests "$r" --tokens "$t" |
        awk -v t="$t" '$3 == t && NF >= 8 {print $5}' | tail -1)
      echo "$i,$r,$n,$fw,$ms" >> "$OUT"
    done
  done
done
