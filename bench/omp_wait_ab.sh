#!/usr/bin/env bash
# What libgomp's waiting policy does to the served daemon on the CPU. Between parallel regions
# LibTorch's OpenMP workers spin a while and then sleep (libgomp's default, "default"); with
# OMP_WAIT_POLICY=passive they sleep at once, with OMP_WAIT_POLICY=active they spin for good,
# and GOMP_SPINCOUNT=N sets how long they spin. A spinning worker holds a core the daemon's other
# threads (gRPC, PNG encoding) could use; a sleeping one must be woken at each parallel region,
# hundreds a step. One daemon at a time (an idle daemon whose workers spin for good holds a core
# and would slow the other), each variant restarted every round in rotating order, each with its
# own step-cost cache (calibrated at its first start); per round and cell, `imagegen load` for
# SECONDS. Prints per cell each variant's median images/s and p50, and its ratio to the first
# variant per round. HOG=N: N other processes spin on the CPU while the load runs (started once
# the daemon is healthy, so that its calibration is not theirs to disturb): a host the daemon
# shares with other work, where a spinning worker may hold a core the worker it waits for needs.
# HOG_ON and HOG_OFF (seconds): each of them busy HOG_ON, asleep HOG_OFF, over and over
# (bench/hog.sh).
#
#   [HOG=N [HOG_ON=S HOG_OFF=S]] bench/omp_wait_ab.sh [BUILD_DIR] [SECONDS] [ROUNDS] [CONCURRENCIES] [VARIANT...]
#   VARIANT: NAME or NAME:SETTING[,SETTING], each SETTING ENV=VALUE or a daemon flag --FLAG=VALUE
#            (default: default passive:OMP_WAIT_POLICY=passive active:OMP_WAIT_POLICY=active)
#   HOG=1 bench/omp_wait_ab.sh build/ci 6 3 "1 8" adaptive fixed:--adaptive_cpu_threads=0 \
#     one:--cpu_threads=1
#   bench/omp_wait_ab.sh build/ci 8 3 "1 16"
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/ci}
SECS=${2:-8}
ROUNDS=${3:-3}
CONC=${4:-1 16}
shift $(($# < 4 ? $# : 4))
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(default passive:OMP_WAIT_POLICY=passive
                                       active:OMP_WAIT_POLICY=active)
OUT=$(mktemp -d /tmp/imagegen-omp-wait.XXXXXX)
# abab_port (a daemon's port once it is healthy) and abab_load (`imagegen load` for SECS);
# the daemons are started here, one at a time, with their variant's environment.
source bench/abab.sh
HOG=${HOG:-0}
pid= hogs=()
trap '[ -n "$pid" ] && kill -TERM "$pid" 2> /dev/null; [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2> /dev/null; true' EXIT
n=${#variants[@]}
for r in $(seq 0 $((ROUNDS - 1))); do
  for k in $(seq 0 $((n - 1))); do
    v=${variants[$(((k + r) % n))]}
    name=${v%%:*} settings=() envs=() args=()
    [ "$v" != "$name" ] && IFS=, read -r -a settings <<< "${v#*:}"
    for x in "${settings[@]}"; do
      case "$x" in --*) args+=("$x") ;; *) envs+=("$x") ;; esac
    done
    rm -f "$OUT/$name.ports"
    env "${envs[@]}" "$BUILD/server/imagegen-server" --listen 127.0.0.1:0 --metrics-listen "" \
      --models fmnist-gpt --port-file "$OUT/$name.ports" --cache_dir "$OUT/cache-$name" \
      --log_stats_seconds 4 "${args[@]}" > "$OUT/$name-r$r.log" 2>&1 &
    pid=$!
    port=$(abab_port "$name")
    for _ in $(seq "$HOG"); do
      bench/hog.sh "${HOG_ON:-}" "${HOG_OFF:-0}" &
      hogs+=("$!")
    done
    for c in $CONC; do
      for method in ar scd-mc; do
        abab_load "$port" "$method" "$c" "$OUT/$method-$c-$name-r$r.log"
      done
    done
    if [ ${#hogs[@]} -gt 0 ]; then kill "${hogs[@]}"; wait "${hogs[@]}" 2> /dev/null || true; fi
    hogs=()
    kill -TERM "$pid"; wait "$pid" 2> /dev/null || true; pid=
  done
done
python3 - "$OUT" "$ROUNDS" "$CONC" "${variants[@]%%:*}" <<'PY'
import re, statistics as st, sys
out, rounds, conc, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4:]
def summary(path):
    text = open(path).read()
    ips = float(re.findall(r"([0-9.]+) images/s", text)[-1])
    p50 = float(re.search(r"^latency.*?p50 ([0-9.]+)", text, re.M).group(1))
    return ips, p50
print(f"{'method':8} {'c':>3} " + " | ".join(f"{n} img/s p50" for n in names) +
      " | " + " | ".join(f"{n}/{names[0]} per round" for n in names[1:]))
for c in conc:
    for m in ("ar", "scd-mc"):
        cells = {n: [summary(f"{out}/{m}-{c}-{n}-r{r}.log") for r in range(rounds)] for n in names}
        row = [f"{st.median(x[0] for x in cells[n]):6.2f} {st.median(x[1] for x in cells[n]):.3f}"
               for n in names]
        ratios = [" ".join(f"{cells[n][r][0] / cells[names[0]][r][0]:.2f}" for r in range(rounds))
                  for n in names[1:]]
        print(f"{m:8} {c:>3} " + " | ".join(row) + " | " + " | ".join(ratios))
print("logs:", out)
PY
