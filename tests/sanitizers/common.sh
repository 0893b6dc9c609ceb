# Shared by tests/sanitizers.sh and tests/tsan.sh (sourced, not run).

# ccache: share hits between checkouts beside this one, and let it cache the translation units
# that use CMake's precompiled headers (without pch_defines,time_macros it refuses them all).
sanitizer_ccache() {
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(dirname "$1")}"
  export CCACHE_SLOPPINESS="pch_defines,time_macros${CCACHE_SLOPPINESS:+,$CCACHE_SLOPPINESS}"
}

# Configures CMake preset $1 into folder $2; when that fails, shows the end of CMake's logs and
# tries once more from an empty folder. (CI, 2026-11-28: the asan-ubsan configure failed once
# with "CMAKE_CUDA_ARCHITECTURES must be non-empty if set": CMake's identification of the CUDA
# compiler, which LibTorch's CMake asks for, got no output from nvcc. The same configure passed
# by hand right after, and in every run before.)
sanitizer_configure() {
  if cmake --preset "$1"; then return 0; fi
  {  # on stderr: the tsan script sends the configure's stdout to /dev/null
    echo "== $1: configure failed; CMake's logs end:"
    tail -n 40 "$2/CMakeFiles/CMakeOutput.log" "$2/CMakeFiles/CMakeError.log" || true
    echo "== $1: configuring again from an empty folder"
  } >&2
  rm -rf "$2"
  cmake --preset "$1"
}

# Prints every report a sanitizer wrote to folder $2 under the heading "== $1: reports";
# returns 1 when there was one.
sanitizer_reports() {
  compgen -G "$2/*" > /dev/null || return 0
  echo "== $1: reports"
  for f in "$2"/*; do
    echo "--- $f"
    cat "$f"
  done
  return 1
}

# The control that a ThreadSanitizer run could have failed: a planted race, compiled in folder $1
# with the compiler and flags the builds use, must be reported, also under the TSan options $2
# (a run's suppressions must not hide it). Returns 1 when it was not.
tsan_planted_race_control() {
  cat > "$1/planted_race.cc" << 'CC'
#include <thread>
int shared = 0;
int main() {
  std::thread t([] { shared = 1; });
  shared = 2;
  t.join();
  return shared == 3;
}
CC
  c++ -fsanitize=thread -O1 -g -o "$1/planted_race" "$1/planted_race.cc" -pthread
  # A run that printed nothing at all did not get as far as racing (seen once in CI, 2026-11-27:
  # an empty log, while 45 runs of the same binary right after all reported the race): it is
  # run again, up to three times. A run that ran and did not report the race fails at once.
  local try
  for try in 1 2 3; do
    if TSAN_OPTIONS="exitcode=66${2:+:$2}" "$1/planted_race" > "$1/planted_race.log" 2>&1; then
      break  # exit 0: ran to the end without a report
    fi
    [ -s "$1/planted_race.log" ] && break
    echo "tsan: the planted race's run $try printed nothing; running it again"
  done
  if ! grep -q "WARNING: ThreadSanitizer: data race" "$1/planted_race.log"; then
    echo "tsan: the planted race was not reported"
    return 1
  fi
  echo "tsan: the planted race was reported"
}

# The control that the LSan suppressions (file $2) hide only what they name: compiled in folder $1
# with the builds' compiler, a program leaks one block of its own while its detached threads set
# a thread-specific key numbered 32 or more and main calls exit() (the glibc report lsan.supp
# suppresses; tests/sanitizers/lsan.supp says why). Under the suppressions the planted leak must
# be reported, from main, and nothing from pthread_setspecific. Returns 1 when it was not so.
lsan_planted_leak_control() {
  cat > "$1/planted_leak.cc" << 'CC'
#include <pthread.h>
#include <cstdlib>
#include <thread>
void* volatile kept;
int main() {
  pthread_key_t keys[40];
  for (auto& k : keys) pthread_key_create(&k, nullptr);
  static int value;
  for (int i = 0; i < 64; ++i) std::thread([&] { pthread_setspecific(keys[39], &value); }).detach();
  kept = std::malloc(77);  // planted: the only pointer to it is dropped
  kept = nullptr;
  std::exit(0);
}
CC
  c++ -fsanitize=address -O1 -g -o "$1/planted_leak" "$1/planted_leak.cc" -pthread
  local log=$1/planted_leak.log
  ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS="suppressions=$2:print_suppressions=0" \
    "$1/planted_leak" > "$log" 2>&1 || true  # exits 1: the planted leak
  if ! grep -q "Direct leak of 77 byte" "$log" || ! grep -q "in main .*planted_leak.cc" "$log"; then
    echo "lsan: the planted leak was not reported under $2"
    cat "$log"
    return 1
  fi
  if grep -q pthread_setspecific "$log"; then
    echo "lsan: a pthread_setspecific block was reported under $2"
    cat "$log"
    return 1
  fi
  echo "lsan: the planted leak was reported, no thread-specific block"
}

# Runs folder $1's engine_tests (or test program $4) with gtest filter $2 as two shards at once
# (GTEST_SHARD_INDEX), one LibTorch thread each: on 2 cores about half the wall time of one
# process, and without the two-thread OpenMP pools of two processes spinning against each
# other. Each shard's output goes to $3.N.log; a failed shard's log is printed whole, a passed
# one's summary. Returns 1 when either shard failed.
sharded_engine_tests() {
  local dir=$1 filter=$2 log=$3 bin=${4:-engine_tests} i rc=0 pids=() failed=()
  for i in 0 1; do
    (cd "$dir" && OMP_NUM_THREADS=1 GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$i \
      "./$bin" --gtest_filter="$filter" > "$log.$i.log" 2>&1) &
    pids+=($!)
  done
  for i in 0 1; do
    if ! wait "${pids[$i]}"; then
      rc=1
      failed+=($i)
    fi
  done
  for i in 0 1; do
    echo "--- $bin shard $i of 2 ($log.$i.log)"
    if [[ " ${failed[*]} " == *" $i "* ]]; then
      cat "$log.$i.log"
    else
      grep -E '^\[==========\] .* ran|^\[  (PASSED  |SKIPPED )\] [0-9]' "$log.$i.log"
    fi
  done
  return $rc
}
