#!/usr/bin/env bash
# Does a client that asks for previews, or stops reading, slow anyone else? The engine's mean
# step time (imagegen_step_duration_seconds) and the plain streams' images/s, in one run.
# N plain GenerateStream clients (closed loop, `imagegen load --stream`) run in every phase;
# beside them, M side clients of one kind:
#   alone     none
#   plain     M more plain streams (ar): the batch the next two phases have, without previews
#   previews  M streams (ar) with a preview every step at scale 16, reading
#   stalled   M streams (ar) with a preview every step at scale 16, never reading (opened
#             once; each holds its slots until its image is done, then waits unread)
#   alone'    the first phase again: the noise of the measurement
#
#   bench/preview_isolation.sh [BUILD_DIR] [N] [M] [SECONDS] [METHOD]
#   (defaults: build/release 16 16 30 scd-mc)
# To measure another daemon build with this build's clients (before/after a change):
#   IMAGEGEN_SERVER=/other/build/server/imagegen-server IMAGEGEN_SERVER_FLAGS= bench/...
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build/release}
N=${2:-16}
M=${3:-16}
SECS=${4:-30}
METHOD=${5:-scd-mc}
OUT=$(mktemp -d /tmp/imagegen-preview-isolation.XXXXXX)
PY=${IMAGEGEN_PYTHON:-python3}
SERVER=${IMAGEGEN_SERVER:-$BUILD/server/imagegen-server}
# shellcheck disable=SC2086  # the flags are words
"$SERVER" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --port-file "$OUT/ports" \
  --max-slots $((2 * (N + M))) --max-queue 512 ${IMAGEGEN_SERVER_FLAGS---stream-stall-seconds 3600} \
  > "$OUT/server.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$OUT/ports" ] && break; sleep 0.05; done
read -r port mport _ < "$OUT/ports"
T=127.0.0.1:$port
for _ in $(seq 1200); do
  "$BUILD/client/imagegen" models --target "$T" > /dev/null 2>&1 && break; sleep 0.1
done
# "sum count" of the step-duration histogram.
steps() {
  "$PY" - "$mport" <<'PYEOF'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=30).read().decode()
s = c = 0.0
for line in text.splitlines():
    if line.startswith("imagegen_step_duration_seconds_sum"): s += float(line.split()[-1])
    if line.startswith("imagegen_step_duration_seconds_count"): c += float(line.split()[-1])
print(s, c)
PYEOF
}
printf "%-44s %12s %8s %14s\n" phase "mean step ms" steps "plain img/s"
phase() {
  local name=$1 extra=$2
  local log=${name%%:*}
  read -r s0 c0 < <(steps)
  case $extra in
    plain)
      "$BUILD/client/imagegen" load --target "$T" --method ar --concurrency "$M" --stream \
        --duration "$SECS" > "$OUT/$log.side.log" 2>&1 & ;;
    reading)
      "$BUILD/client/imagegen" load --target "$T" --method ar --concurrency "$M" --stream \
        --preview-every 1 --scale 16 --duration "$SECS" > "$OUT/$log.previews.log" 2>&1 & ;;
    stalled)
      PYTHONPATH="$BUILD/python" "$PY" bench/stalled_streams.py --target "$T" --streams "$M" \
        --seconds "$SECS" > "$OUT/$log.stalled.log" 2>&1 & ;;
  esac
  local side=$!
  [ "$extra" = none ] && side=""
  "$BUILD/client/imagegen" load --target "$T" --method "$METHOD" --concurrency "$N" --stream \
    --duration "$SECS" > "$OUT/$log.log" 2>&1
  [ -n "$side" ] && wait "$side" || true
  read -r s1 c1 < <(steps)
  local ips
  ips=$(awk '/images\/s/ {print $(NF-1)}' "$OUT/$log.log")
  printf "%-44s %12.1f %8d %14s\n" "$name" \
    "$(awk -v a="$s0" -v b="$s1" -v c="$c0" -v d="$c1" 'BEGIN {print (d > c) ? 1000 * (b - a) / (d - c) : 0}')" \
    "$(awk -v c="$c0" -v d="$c1" 'BEGIN {print d - c}')" "$ips"
}
phase "alone:    $N plain streams" none
phase "plain:    + $M plain streams" plain
phase "previews: + $M reading preview streams" reading
phase "stalled:  + $M non-reading preview streams" stalled
phase "alone':   $N plain streams again (noise)" none
echo "server: $SERVER; logs: $OUT"
