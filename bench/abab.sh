# Sourced by the ABAB benches (bench/http_overhead.sh, bench/log_overhead.sh,
# bench/row_attention_ab.sh): two ways of serving the same closed-loop load, A and B, compared
# in alternating runs so that a drift of the machine falls on both. Needs OUT (a folder for the
# load logs) and ROUNDS; abab_start, abab_port and abab_load need BUILD (its client), and
# abab_load SECS.
#
#   abab_header A B                  the table's header
#   abab METHOD C RUN_A RUN_B        one warm-up run of each (discarded: the goodput controller
#                                    learns the setting), then ROUNDS pairs A, B; RUN_A and
#                                    RUN_B are called as `RUN METHOD C LOG` and write an
#                                    `imagegen load`-shaped log; prints the row: medians of
#                                    images/s, p50 and p99 of each, B/A per round, and the
#                                    spread of A's runs among themselves (the noise)

abab_start() {  # NAME BUILD_DIR FLAG...: that build's daemon on the bundled models, with FLAGs
  # (logs in $OUT/NAME.log); returns once it is healthy, its gRPC port in port_NAME. Call one
  # after the other: a daemon calibrates its step cost while it starts, and two calibrating at
  # once on the same cores would each measure the other's load. Every daemon started here is
  # stopped when the script exits.
  local name=$1 build=$2
  shift 2
  "$build/server/imagegen-server" --listen 127.0.0.1:0 --metrics-listen "" --models fmnist-gpt \
    --port-file "$OUT/$name.ports" "$@" > "$OUT/$name.log" 2>&1 &
  ABAB_PIDS+=("$!")
  trap 'kill -TERM ${ABAB_PIDS[*]} 2> /dev/null || true' EXIT
  printf -v "port_$name" '%s' "$(abab_port "$name")"
}

abab_port() {  # NAME: the gRPC port of the daemon writing $OUT/NAME.ports, once it is healthy
  for _ in $(seq 1200); do [ -s "$OUT/$1.ports" ] && break; sleep 0.05; done
  local p
  read -r p _ < "$OUT/$1.ports"
  for _ in $(seq 1200); do
    "$BUILD/client/imagegen" health --target "127.0.0.1:$p" > /dev/null 2>&1 && break; sleep 0.1
  done
  echo "$p"
}

abab_load() {  # PORT METHOD CLIENTS LOG: `imagegen load` for SECS seconds
  "$BUILD/client/imagegen" load --target "127.0.0.1:$1" --method "$2" --concurrency "$3" \
    --duration "$SECS" > "$4" 2>&1
}

summary() {  # images/s, p50, p99 of a load log
  awk '/images\/s/ {ips = $(NF-1)} /^latency/ {p50 = $4; p99 = $8} END {print ips, p50, p99}' "$1"
}
median() { tr ' ' '\n' | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

abab_header() {
  printf "%-8s %3s | %-26s | %-26s | %-22s %s\n" method c "$1 img/s p50 p99 (median)" \
    "$2 img/s p50 p99 (median)" "$2/$1 per round" "$1 spread"
}

abab() {
  local method=$1 c=$2 run_a=$3 run_b=$4 r g a b h x y am bm
  "$run_a" "$method" "$c" "$OUT/warmup-a.log"
  "$run_b" "$method" "$c" "$OUT/warmup-b.log"
  local ai=() ap50=() ap99=() bi=() bp50=() bp99=() ratios=()
  for r in $(seq "$ROUNDS"); do
    "$run_a" "$method" "$c" "$OUT/$run_a-$method-$c-$r.log"
    "$run_b" "$method" "$c" "$OUT/$run_b-$method-$c-$r.log"
    read -r g a b < <(summary "$OUT/$run_a-$method-$c-$r.log")
    read -r h x y < <(summary "$OUT/$run_b-$method-$c-$r.log")
    ai+=("$g") ap50+=("$a") ap99+=("$b") bi+=("$h") bp50+=("$x") bp99+=("$y")
    ratios+=("$(awk -v h="$h" -v g="$g" 'BEGIN {printf "%.2f", h / g}')")
  done
  am=$(echo "${ai[@]}" | median) bm=$(echo "${bi[@]}" | median)
  printf "%-8s %3s | %6.2f %6.3f %6.3f        | %6.2f %6.3f %6.3f        | %-22s %5.1f%%\n" \
    "$method" "$c" "$am" "$(echo "${ap50[@]}" | median)" "$(echo "${ap99[@]}" | median)" \
    "$bm" "$(echo "${bp50[@]}" | median)" "$(echo "${bp99[@]}" | median)" "${ratios[*]}" \
    "$(echo "${ai[@]}" | tr ' ' '\n' | sort -g | awk -v m="$am" 'NR == 1 {lo = $1} {hi = $1} END {print 100 * (hi - lo) / m}')"
}
