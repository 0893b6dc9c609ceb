#!/usr/bin/env bash
# Window control under load, paired: the load bench's cells (imagegen-load-bench, one method
# and mode each) at one concurrency, run ROUNDS times in an order that rotates each round, so
# that a drift of the machine over minutes falls on every cell alike. A sweep that runs each
# method's cells minutes apart compares cells the machine ran at different speeds (on the
# 2-core VM the same decode once took 3.2 ms in one method's cells and 6.5 ms in the next's:
# docs/results-serving.md). Each round gives every cell's images/s over each other cell's of
# the same round; tools/paired_load_summary.py prints, with each listed cell as the reference
# in turn, the median ratio per cell, its range, a bootstrap interval and the rounds above 1.
#
#   bench/paired_load.sh BUILD_DIR OUT ROUNDS CLIENTS CELL... [-- BENCH_FLAG...]
#   CELL: METHOD/MODE[/FLAG=VALUE...]: the load bench's --methods and --modes, and flags of
#   this cell alone (scd-mc/goodput/window-stickiness=0.05)
#   bench/paired_load.sh build/ci out 6 16 ar/none scd-mc/goodput scd-mc/budget:128
#
# The cells share one step-cost calibration (OUT/cache). Results: OUT/paired.csv (the bench's
# results.csv rows with the cell, the round and the position in it) and OUT/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 5 ] || { sed -n 2,17p "$0"; exit 2; }
BUILD=$1 OUT=$2 ROUNDS=$3 C=$4
shift 4
cells=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do cells+=("$1"); shift; done
[ $# -gt 0 ] && shift
extra=("$@")
mkdir -p "$OUT/cache"
csv=$OUT/paired.csv
n=${#cells[@]}
for r in $(seq 0 $((ROUNDS - 1))); do
  for k in $(seq 0 $((n - 1))); do
    cell=${cells[$(((k + r) % n))]}
    IFS=/ read -r -a parts <<< "$cell"
    method=${parts[0]} mode=${parts[1]} own=()
    for flag in "${parts[@]:2}"; do own+=("--$flag"); done
    dir=$OUT/r$r-$(echo "$cell" | tr -c 'A-Za-z0-9.\n-' _)
    "$BUILD/bench/imagegen-load-bench" --methods "$method" --concurrency "$C" --modes "$mode" \
      --mixed-concurrency '' --cache-dir "$OUT/cache" --out-dir "$dir" "${extra[@]}" "${own[@]}" \
      > "$dir.log" 2>&1 || { echo "error: $cell in round $r: see $dir.log" >&2; exit 1; }
    [ -f "$csv" ] || echo "cell,round,position,$(head -1 "$dir/results.csv")" > "$csv"
    tail -n +2 "$dir/results.csv" | sed "s|^|$cell,$r,$k,|" >> "$csv"
    echo "round $r, $cell: $(tail -1 "$dir/results.csv" | cut -d, -f7) images/s"
  done
done
"${PYTHON:-python3}" tools/paired_load_summary.py "$csv" "${cells[@]}" | tee "$OUT/summary.txt"
