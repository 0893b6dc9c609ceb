#!/usr/bin/env python3
"""Issue 15's criterion from paired load runs (bench/paired_load.sh), every concurrency at once.

    tools/goodput_criterion.py [--plot OUT.png] PAIRED_CSV...

Each PAIRED_CSV is one bench/paired_load.sh run (one concurrency, several rounds) whose cells
include ar/none and, per speculative method M, M/none, M/budget:B for some budgets B and
M/goodput. For every concurrency and method it prints the median images/s over the rounds of
AR, of whole windows, of the best fixed budget (the budget whose median over the rounds is the
highest: chosen once, not round by round, which would favour the budgets by the noise) and of
the controller; then the controller's images/s over max(AR, that budget) of the same round:
median, range and the rounds at or above 1; and the noise, the largest spread over the rounds
((max - min) / median) of the cells compared. At one client also the p50 latency of AR and of
the controller. --plot draws images/s against concurrency, one panel a method.
"""
import csv
import statistics
import sys
from collections import defaultdict


def load(paths):
    # (c, cell) -> round -> row
    rows = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                rows[(int(r["concurrency"]), r["cell"])][int(r["round"])] = r
    return rows


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def spread(xs):
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def main():
    args = sys.argv[1:]
    plot = None
    if len(args) >= 2 and args[0] == "--plot":
        plot, args = args[1], args[2:]
    if not args:
        sys.exit(__doc__)
    rows = load(args)
    rate = lambda c, cell: {k: float(v["images_per_s"]) for k, v in rows.get((c, cell), {}).items()}
    cs = sorted({c for c, _ in rows})
    methods = []
    for _, cell in rows:
        m = cell.split("/")[0]
        if m != "ar" and m not in methods:
            methods.append(m)
    print("| method | c | rounds | ar | whole windows | best budget | goodput | goodput / max(ar, best budget): median (range), rounds >= 1 | noise (largest cell spread) | goodput window | goodput NFE |")
    print("|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|")
    series = defaultdict(lambda: defaultdict(list))  # method -> line -> [(c, img/s)]
    for m in methods:
        for c in cs:
            ar = rate(c, "ar/none")
            gp = rate(c, f"{m}/goodput")
            whole = rate(c, f"{m}/none")
            budgets = {}
            for (cc, cell) in rows:
                if cc == c and cell.startswith(f"{m}/budget:"):
                    budgets[cell] = rate(c, cell)
            if not ar or not gp or not budgets:
                continue
            best = max(budgets, key=lambda b: med(list(budgets[b].values())))
            bb = budgets[best]
            rounds = sorted(set(ar) & set(gp) & set(bb))
            ratios = [gp[r] / max(ar[r], bb[r]) for r in rounds]
            noise = max(spread(list(x.values())) for x in (ar, gp, bb))
            g = rows[(c, f"{m}/goodput")]
            window = med([float(v["mean_window"]) for v in g.values()])
            nfe = med([float(v["nfe"]) for v in g.values()])
            print(f"| {m} | {c} | {len(rounds)} | {med(list(ar.values())):.2f} | "
                  f"{med(list(whole.values())):.2f} | {med(list(bb.values())):.2f} "
                  f"({best.split(':')[1]}) | **{med(list(gp.values())):.2f}** | "
                  f"{med(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}), "
                  f"{sum(x >= 1 for x in ratios)}/{len(ratios)} | {100 * noise:.0f}% | "
                  f"{window:.1f} | {nfe:.0f} |")
            for line, d in (("ar", ar), ("whole windows", whole), ("best budget", bb),
                            ("goodput", gp)):
                if d:
                    series[m][line].append((c, med(list(d.values()))))
    if 1 in cs:
        print()
        for m in methods:
            ar = rows.get((1, "ar/none"), {})
            gp = rows.get((1, f"{m}/goodput"), {})
            rounds = sorted(set(ar) & set(gp))
            if not rounds:
                continue
            r = [float(ar[k]["p50_s"]) / float(gp[k]["p50_s"]) for k in rounds]
            print(f"1 client, {m}: p50 AR {med([float(ar[k]['p50_s']) for k in rounds]):.3f} s, "
                  f"goodput {med([float(gp[k]['p50_s']) for k in rounds]):.3f} s; "
                  f"AR / goodput per round: median {med(r):.2f} ({min(r):.2f}-{max(r):.2f})")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.6), squeeze=False)
        for ax, m in zip(axes[0], series):
            for line, pts in series[m].items():
                ax.plot([c for c, _ in pts], [y for _, y in pts], marker="o", label=line)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("clients")
            ax.set_ylabel("images/s (median of rounds)")
            ax.set_title(m)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"plot: {plot}")


if __name__ == "__main__":
    main()
