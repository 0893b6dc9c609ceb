#!/usr/bin/env bash
# The long fuzzing run: builds the libFuzzer targets (CMake preset `fuzz`: clang, ASan+UBSan)
# and runs each for RUNS executions (default 1,000,000), starting from the committed corpus
# (fuzz/corpus/<target>) in a scratch copy. Prints, per target, the executions, the edge
# coverage (libFuzzer's cov:) and the corpus it grew. Any crash or sanitizer report stops the
# target with its reproducer in the scratch directory, and the script fails.
#
#   tools/fuzz.sh [RUNS] [TARGET...]    (targets: safetensors model_config request images_request)
#
# Needs clang with libFuzzer (Debian: clang, libclang-rt-14-dev).
# ctest runs the same targets in every build without libFuzzer (fuzz/replay_main.cc): the
# corpus and 20,000 seeded mutations of each input (label fuzz; under ASan+UBSan in
# tests/sanitizers.sh). To keep what a run found: FUZZ_MERGE=1 merges it into fuzz/corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-1000000}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(safetensors model_config request images_request)
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(dirname "$PWD")}"
cmake --preset fuzz > /dev/null
cmake --build --preset fuzz
OUT=$(mktemp -d /tmp/imagegen-fuzz.XXXXXX)
export ASAN_OPTIONS="detect_leaks=1:${ASAN_OPTIONS_EXTRA:-}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
status=0
printf "%-14s %12s %8s %8s %10s %s\n" target executions "cov" features "corpus" result
for t in "${TARGETS[@]}"; do
  mkdir -p "$OUT/$t/corpus"
  cp fuzz/corpus/"$t"/* "$OUT/$t/corpus/"
  log=$OUT/$t/log
  bin=$PWD/build/fuzz/fuzz/${t}_fuzz
  if (cd "$OUT/$t" && "$bin" -runs="$RUNS" -max_len=65536 -print_final_stats=1 corpus \
        > "$log" 2>&1); then
    result=ok
  else
    result="FAILED (see $log)"
    status=1
  fi
  execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  n=$(find "$OUT/$t/corpus" -type f | wc -l)
  printf "%-14s %12s %8s %8s %10s %s\n" "$t" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$n files" \
    "$result"
  if [ "${FUZZ_MERGE:-0}" = 1 ] && [ "$result" = ok ]; then
    "$bin" -merge=1 "fuzz/corpus/$t" "$OUT/$t/corpus" > /dev/null 2>&1
  fi
done
echo "logs: $OUT"
exit $status
