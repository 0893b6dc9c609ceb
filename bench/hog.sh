#!/usr/bin/env bash
# Other work on the benches' CPUs: one process that keeps a CPU busy, for good, or (ON and OFF
# given, in seconds) busy ON and asleep OFF over and over, work that comes and goes faster than
# the thread governor's windows (engine/scheduler/thread_governor.h).
#
#   bench/hog.sh [ON OFF] &
set -euo pipefail
if [ $# -ge 2 ] && [ -n "$1" ]; then
  exec python3 -c '
import sys, time
on, off = float(sys.argv[1]), float(sys.argv[2])
while True:
    end = time.monotonic() + on
    while time.monotonic() < end:
        pass
    time.sleep(off)' "$1" "$2"
fi
exec sh -c 'while :; do :; done'
