#!/usr/bin/env python3
"""What the goodput controller's exploring steps cost, from the load bench's step traces.

    tools/explore_share.py TRACE.csv...   (imagegen-load-bench --trace-dir DIR: DIR/trace_*.csv)

For each trace: the steps, the planned ones (two or more requests), the exploring ones, the
median measured time of plain and of exploring steps, the exploring steps' share of the traced
time, their time over a plain step's median (the extra), and the tokens they committed per
request.
"""
import collections
import csv
import statistics
import sys


def main(paths):
    for path in paths:
        steps = collections.OrderedDict()
        for r in csv.DictReader(open(path)):
            s = steps.setdefault(int(r["step"]), {"explore": int(r["explore"]),
                                                  "ms": float(r["measured_ms"]),
                                                  "requests": int(r["requests"]), "committed": 0})
            s["committed"] += int(r["committed"])
        explore = [s for s in steps.values() if s["explore"]]
        plain = [s for s in steps.values() if not s["explore"] and s["requests"] > 1]
        total = sum(s["ms"] for s in steps.values())
        plain_ms = statistics.median(s["ms"] for s in plain) if plain else 0
        explore_ms = statistics.median(s["ms"] for s in explore) if explore else 0
        extra = sum(s["ms"] - plain_ms for s in explore)
        per_request = (sum(s["committed"] for s in explore) /
                       max(1, sum(s["requests"] for s in explore)))
        print(f"{path}: {len(steps)} steps, {len(plain) + len(explore)} planned, "
              f"{len(explore)} exploring; median ms plain {plain_ms:.2f}, exploring "
              f"{explore_ms:.2f}; exploring {100 * sum(s['ms'] for s in explore) / total:.1f}% "
              f"of the time, {100 * extra / total:.1f}% over plain steps; "
              f"{per_request:.2f} tokens committed a request in exploring steps")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
