#!/usr/bin/env bash
# The engine's intra-op threads over time while other work comes and goes on the daemon's cores
# (--adaptive-cpu-threads, engine/scheduler/thread_governor.h): one daemon on the bundled
# fmnist-gpt under a closed-loop load of METHOD at CLIENTS for SECONDS, with HOG busy loops
# running from HOG_FROM to HOG_TO seconds into the load. Prints the daemon's stats lines as a
# timeline (seconds into the load, images/s, the engine thread's CPU wait share, its threads)
# and its notices of each change. Extra arguments go to the daemon (e.g.
# --adaptive_cpu_threads=0 for the fixed count). HOG_ON and HOG_OFF (seconds) make each loop
# intermittent: busy HOG_ON, asleep HOG_OFF, over and over (other work that comes and goes
# faster than the governor's windows); unset, the loops never rest. LOAD_FLAGS: more flags for
# `imagegen load` (e.g. "--stream --preview_every 1": a preview PNG of every step of every
# request, the daemon's own threads busy beside the engine's).
#
#   bench/cpu_threads_timeline.sh [BUILD_DIR] [SECONDS] [HOG_FROM] [HOG_TO] [FLAG...]
#   METHOD=ar CLIENTS=8 HOG=1 bench/cpu_threads_timeline.sh build/ci 120 10 50
#   HOG_ON=0.3 HOG_OFF=0.3 bench/cpu_threads_timeline.sh build/ci 90 10 80
#   HOG=0 LOAD_FLAGS="--stream --preview_every 1" bench/cpu_threads_timeline.sh build/ci 120 0 0
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/ci}
SECS=${2:-120}
FROM=${3:-10}
TO=${4:-50}
shift $(($# < 4 ? $# : 4))
METHOD=${METHOD:-ar}
CLIENTS=${CLIENTS:-8}
HOG=${HOG:-1}
HOG_ON=${HOG_ON:-}
HOG_OFF=${HOG_OFF:-0}
OUT=$(mktemp -d /tmp/imagegen-cpu-threads.XXXXXX)
ROUNDS=1
source bench/abab.sh
hogs=()
trap 'kill ${hogs[*]} ${ABAB_PIDS[*]} 2> /dev/null || true' EXIT
abab_start daemon "$BUILD" --cache_dir "$OUT/cache" --log_stats_seconds 2 "$@"
start=$(date +%s.%N)
"$BUILD/client/imagegen" load --target "127.0.0.1:$port_daemon" --method "$METHOD" \
  --concurrency "$CLIENTS" --duration "$SECS" ${LOAD_FLAGS:-} > "$OUT/load.log" 2>&1 &
load=$!
sleep "$FROM"
for _ in $(seq "$HOG"); do
  bench/hog.sh "$HOG_ON" "$HOG_OFF" &
  hogs+=("$!")
done
sleep "$((TO - FROM))"
if [ ${#hogs[@]} -gt 0 ]; then  # a bare `wait` would wait for the daemon too
  kill "${hogs[@]}" 2> /dev/null || true
  wait "${hogs[@]}" 2> /dev/null || true
fi
hogs=()
wait "$load" || true
duty=""
[ -n "$HOG_ON" ] && duty=" (busy ${HOG_ON} s, asleep ${HOG_OFF} s, over and over)"
python3 - "$OUT/daemon.log" "$FROM" "$TO" "$duty" "$HOG" "${LOAD_FLAGS:-}" <<'PY'
import re, sys
log, hog_from, hog_to = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
t = 0.0
if int(sys.argv[5]) > 0:
    print(f"{sys.argv[5]} busy loop(s) from {hog_from:.0f} s to {hog_to:.0f} s{sys.argv[4]}")
else:
    print("no busy loop")
if sys.argv[6]:
    print(f"load flags: {sys.argv[6]}")
print(f"{'t s':>6} {'img/s':>6} {'cpu_wait':>8} {'threads':>7}")
for line in open(log):
    if " stats " in line:
        f = dict(re.findall(r"(\w+)=(\S+)", line))
        t += float(f["interval_seconds"])
        print(f"{t:6.0f} {float(f['images_per_second']):6.2f} {f.get('cpu_wait', '-'):>8} "
              f"{f.get('cpu_threads', '-'):>7}")
    elif "cpu threads" in line:
        print("      ", line.split(": ", 1)[1].strip())
PY
tail -4 "$OUT/load.log"
echo "logs: $OUT"
