#!/usr/bin/env python3
"""Summary of bench/paired_load.sh: each cell's images/s over the reference cell's, per round.

    paired_load_summary.py [--p50] PAIRED_CSV REFERENCE_CELL [REFERENCE_CELL...]

A cell is named as bench/paired_load.sh lists it (METHOD/MODE[/FLAG=VALUE...], its CSV's `cell`
column; METHOD/MODE for a CSV without one). For every cell at every concurrency: the median
images/s over the rounds and their spread ((max - min) / median: what one unpaired cell is
worth), then the ratio to the reference cell of the same round: its median, its range, a 90%
bootstrap interval of the median (10,000 resamples of the rounds, fixed seed) and the rounds in
which the cell was ahead. One table per reference cell. --p50: the same of the median latency
instead, the ratio being the reference's p50 over the cell's (above 1: the cell is faster).
"""
import csv
import random
import statistics
import sys
from collections import defaultdict


def main():
    args = sys.argv[1:]
    p50 = bool(args) and args[0] == "--p50"
    if p50:
        args = args[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    path = args[0]
    rate = defaultdict(dict)  # (c, cell) -> round -> images/s (--p50: 1 / p50)
    with open(path) as f:
        for row in csv.DictReader(f):
            cell = row.get("cell") or f"{row['method']}/{row['mode']}"
            key, r = (int(row["concurrency"]), cell), int(row["round"])
            # A latency's inverse, so that the ratio reads as the rate's: above 1, the cell ahead.
            rate[key][r] = 1 / float(row["p50_s"]) if p50 else float(row["images_per_s"])
    for reference in args[1:]:
        table(rate, reference, p50)


def table(rate, reference, p50=False):
    width = max(22, max(len(cell) for _, cell in rate))
    unit = "1/p50" if p50 else "img/s"
    print(f"{'c':>3} {'cell':<{width}} {'rounds':>6} {unit:>7} {'spread':>7} "
          f"{'/ ' + reference:>18} {'range':>12} {'90% interval':>14} {'ahead':>6}")
    for (c, cell) in sorted(rate, key=lambda k: (k[0], k[1] != reference, k[1])):
        runs = rate[(c, cell)]
        ref = rate.get((c, reference), {})
        values = list(runs.values())
        med = statistics.median(values)
        spread = (max(values) - min(values)) / med if med > 0 else float("nan")
        line = f"{c:>3} {cell:<{width}} {len(values):>6} {med:>7.2f} {100 * spread:>6.0f}%"
        ratios = [runs[r] / ref[r] for r in runs if r in ref and ref[r] > 0]
        if cell != reference and ratios:
            rng = random.Random(15)  # per cell: its interval does not depend on the others
            boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                          for _ in range(10000))
            ahead = sum(x > 1 for x in ratios)
            line += (f" {statistics.median(ratios):>18.2f} "
                     f"{min(ratios):>5.2f}-{max(ratios):<6.2f} "
                     f"{boot[500]:>6.2f}-{boot[9499]:<7.2f} {ahead:>3}/{len(ratios)}")
        print(line)
    print()


if __name__ == "__main__":
    main()
