#!/usr/bin/env bash
# RowAttention split A/B in one binary: A = even split by task count (IMAGEGEN_ROW_SPLIT_EVEN,
# a temporary switch), B = split by cost. Alternating, order rotated each round.
set -euo pipefail
BIN=/work/main/build/ci/bench/imagegen-load-bench
OUT=${OUT:-/tmp/rowab/run}; ROUNDS=${ROUNDS:-6}; SECS=${SECS:-6}
mkdir -p "$OUT/cache"
echo "cell,round,variant,images_per_s,p50_s,step_ms,tokens_per_step,requests_per_step" > "$OUT/ab.csv"
run() { # variant cell method conc mode round
  local v=$1 cell=$2 m=$3 c=$4 mode=$5 r=$6 d=$OUT/$2-$1-r$6
  if [ "$v" = A ]; then env IMAGEGEN_ROW_SPLIT_EVEN=1 OMP_NUM_THREADS=2 "$BIN" --methods "$m" --concurrency "$c" --modes "$mode" --mixed-concurrency '' --seconds "$SECS" --cache-dir "$OUT/cache" --out-dir "$d" > "$d.log" 2>&1
  else env OMP_NUM_THREADS=2 "$BIN" --methods "$m" --concurrency "$c" --modes "$mode" --mixed-concurrency '' --seconds "$SECS" --cache-dir "$OUT/cache" --out-dir "$d" > "$d.log" 2>&1; fi
  python3 - "$d/results.csv" "$cell" "$r" "$v" >> "$OUT/ab.csv" <<'PY'
import csv,sys
row=list(csv.DictReader(open(sys.argv[1])))[0]
print(",".join([sys.argv[2],sys.argv[3],sys.argv[4],row['images_per_s'],row['p50_s'],row['step_ms'],row['tokens_per_step'],row['requests_per_step']]))
PY
}
for r in $(seq 1 $ROUNDS); do
  for cell in "ar c16:ar:16:none" "scd-mc c8:scd-mc:8:goodput" "mixed-window c16:scd-mc:16:budget:256"; do
    IFS=: read -r name m c mode rest <<< "$cell"; [ -n "${rest:-}" ] && mode="$mode:$rest"
    name=${name// /_}
    if [ $((r % 2)) = 1 ]; then run A "$name" "$m" "$c" "$mode" "$r"; run B "$name" "$m" "$c" "$mode" "$r"
    else run B "$name" "$m" "$c" "$mode" "$r"; run A "$name" "$m" "$c" "$mode" "$r"; fi
  done
done
python3 - "$OUT/ab.csv" <<'PY'
import csv,sys,statistics as st
rows=list(csv.DictReader(open(sys.argv[1])))
for cell in dict.fromkeys(r['cell'] for r in rows):
  A={r['round']:r for r in rows if r['cell']==cell and r['variant']=='A'}
  B={r['round']:r for r in rows if r['cell']==cell and r['variant']=='B'}
  ks=[k for k in A if k in B]
  ips=[float(B[k]['images_per_s'])/float(A[k]['images_per_s']) for k in ks]
  stp=[float(A[k]['step_ms'])/float(B[k]['step_ms']) for k in ks]
  print(f"{cell}: images/s B/A median {st.median(ips):.3f} range {min(ips):.3f}-{max(ips):.3f} ({sum(x>1 for x in ips)}/{len(ips)} above 1); step ms A/B median {st.median(stp):.3f} range {min(stp):.3f}-{max(stp):.3f}; A img/s {[round(float(A[k]['images_per_s']),2) for k in ks]}")
PY
