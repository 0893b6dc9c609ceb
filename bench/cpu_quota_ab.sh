#!/usr/bin/env bash
# The daemon under a CPU quota (a cgroup's CFS quota: Docker's --cpus, a Kubernetes CPU limit),
# with its intra-op threads capped by the quota (the default since engine/util/cpu_quota.h)
# against LibTorch's own count (--cpu_threads set to it: what the daemon did before). Each
# round starts both daemons in turn, in alternating order, inside one cgroup with the quota,
# and drives each with `imagegen load` from outside it.
#
#   sudo bench/cpu_quota_ab.sh BUILD_DIR CPUS ROUNDS SECONDS METHOD CONCURRENCY...
#   e.g. bench/cpu_quota_ab.sh build/ci 1 4 10 ar 1 4
#
# Needs root and a cgroup with the cpu controller: v1 (/sys/fs/cgroup/cpu) or v2 (with cpu in
# the root's cgroup.subtree_control). Prints one line per cell and round; logs in a temp dir.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=$1 CPUS=$2 ROUNDS=$3 SECS=$4 METHOD=$5
shift 5
OUT=$(mktemp -d /tmp/imagegen-cpu-quota.XXXXXX)
NAME=imagegen-quota-ab-$$
period=100000
quota=$(awk -v c="$CPUS" -v p=$period 'BEGIN {printf "%d", c * p}')
if [ -d /sys/fs/cgroup/cpu ] && [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
  CG=/sys/fs/cgroup/cpu/$NAME
  mkdir "$CG"
  echo $period > "$CG/cpu.cfs_period_us"
  echo "$quota" > "$CG/cpu.cfs_quota_us"
elif grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; then
  CG=/sys/fs/cgroup/$NAME
  mkdir "$CG"
  echo "$quota $period" > "$CG/cpu.max"
else
  echo "no cgroup cpu controller to set a quota in" >&2
  exit 1
fi
trap 'rmdir "$CG" 2>/dev/null || true' EXIT
# LibTorch's own count, as a daemon outside the cgroup logs it.
default_threads=$(nproc)

serve() {  # serve THREADS LOG: the daemon inside the cgroup; sets pid and port
  rm -f "$OUT/ports"
  local threads=()
  [ "$1" != quota ] && threads=(--cpu_threads "$1")
  bash -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$CG" "$BUILD/server/imagegen-server" \
    --listen 127.0.0.1:0 --metrics-listen "" --port-file "$OUT/ports" --max-slots 64 \
    --max-queue 256 --cache-dir "$OUT/cache" "${threads[@]}" > "$2" 2>&1 &
  pid=$!
  for _ in $(seq 6000); do [ -s "$OUT/ports" ] && break; sleep 0.05; done
  read -r port _ < "$OUT/ports"
  for _ in $(seq 6000); do
    "$BUILD/client/imagegen" models --target "127.0.0.1:$port" > /dev/null 2>&1 && break
    sleep 0.05
  done
}

printf "%-5s %-6s %3s | %-16s %8s %8s %8s\n" round method c variant "images/s" "p50 s" "p99 s"
for r in $(seq "$ROUNDS"); do
  for c in "$@"; do
    order=("quota" "$default_threads")
    [ $((r % 2)) -eq 0 ] && order=("$default_threads" "quota")
    for v in "${order[@]}"; do
      log="$OUT/server-r$r-c$c-$v.log"
      serve "$v" "$log"
      "$BUILD/client/imagegen" load --target "127.0.0.1:$port" --method "$METHOD" \
        --concurrency "$c" --duration "$SECS" > "$OUT/load-r$r-c$c-$v.log" 2>&1
      kill -TERM "$pid"; wait "$pid" || true
      ips=$(awk '/images\/s/ {print $(NF-1)}' "$OUT/load-r$r-c$c-$v.log")
      p50=$(awk '/^latency/ {print $4}' "$OUT/load-r$r-c$c-$v.log")
      p99=$(awk '/^latency/ {print $8}' "$OUT/load-r$r-c$c-$v.log")
      label=$([ "$v" = quota ] && echo "by quota ($(grep -o 'cpu_threads: [0-9]*' "$log" | head -1 | awk '{print $2}'))" || echo "$v threads")
      printf "%-5s %-6s %3s | %-16s %8s %8s %8s\n" "$r" "$METHOD" "$c" "$label" "$ips" "$p50" "$p99"
    done
  done
done
echo "logs: $OUT"
