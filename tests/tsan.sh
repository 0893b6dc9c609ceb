#!/usr/bin/env bash
# ThreadSanitizer on the engine's threads: builds engine_tests in the `tsan` preset (-O1 -g
# -fsanitize=thread; our code instrumented, LibTorch not) and runs EngineTest.*, the tests of the
# engine thread with client threads submitting, cancelling, timing out, asking for previews and
# shutting it down. LibTorch's intra-op pool (OpenMP) is not instrumented, so its hand-offs would
# be invisible to TSan: OMP_NUM_THREADS=1 keeps every LibTorch op on the calling thread. Any
# report fails the script.
#
# Two checks that the run could have failed: the test binary must hold TSan's instrumentation
# (__tsan_read/__tsan_write calls), and a planted race, compiled and run here with the same
# compiler and flags, must be reported.
#
# Not covered: the daemon's gRPC threads. Debian's gRPC and Abseil are not instrumented, and
# their locks (absl::Mutex on futexes) are invisible to TSan: server_tests alone gave 534 reports,
# all through gRPC's and Abseil's internals. That needs gRPC and Abseil built with TSan.
#
# Usage: tests/tsan.sh   (about 10 min cold on 2 cores, 4 min of tests)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=$root/build/tsan
start=$(date +%s)
. "$root/tests/sanitizers/common.sh"
sanitizer_ccache "$root"

echo "== tsan: configure and build (preset tsan: engine_tests)"
cmake --preset tsan > /dev/null
cmake --build --preset tsan
built=$(date +%s)

logs=$build/tsan-logs
rm -rf "$logs"
mkdir -p "$logs"
status=0

echo "== tsan: the controls"
tsan_calls=$(nm "$build/tests/engine_tests" | grep -c "__tsan_read" || true)  # -c: no SIGPIPE
if [ "$tsan_calls" -eq 0 ]; then
  echo "tsan: engine_tests has no TSan instrumentation"
  status=1
fi
cat > "$build/planted_race.cc" << 'CC'
#include <thread>
int shared = 0;
int main() {
  std::thread t([] { shared = 1; });
  shared = 2;
  t.join();
  return shared == 3;
}
CC
c++ -fsanitize=thread -O1 -g -o "$build/planted_race" "$build/planted_race.cc" -pthread
if TSAN_OPTIONS="exitcode=66" "$build/planted_race" > "$build/planted_race.log" 2>&1 ||
    ! grep -q "WARNING: ThreadSanitizer: data race" "$build/planted_race.log"; then
  echo "tsan: the planted race was not reported"
  status=1
else
  echo "tsan: the planted race was reported; engine_tests calls $tsan_calls __tsan_read* symbols"
fi

echo "== tsan: EngineTest.* with OMP_NUM_THREADS=1"
export OMP_NUM_THREADS=1
export TSAN_OPTIONS="log_path=$logs/tsan:halt_on_error=0:second_deadlock_stack=1"
(cd "$build/tests" && ./engine_tests --gtest_filter='EngineTest.*') || status=1
end=$(date +%s)

sanitizer_reports tsan "$logs" || status=1
echo "== tsan: build $((built - start)) s, tests $((end - built)) s;" \
  "$([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
