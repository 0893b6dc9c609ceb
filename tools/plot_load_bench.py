#!/usr/bin/env python3
"""Plots for imagegen-load-bench: reads DIR/results.csv (and DIR/mixed.csv if present) and
writes DIR/load_throughput_latency.png (per method: images/s and p50 latency against
concurrency for AR, whole windows, the best fixed token budget of the run, and the goodput
controller) and DIR/load_mixed.png (the mixed load's p50 per method and mode)."""
import csv
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out):
    rows = list(csv.DictReader(open(f"{out}/results.csv")))
    cell = defaultdict(dict)  # (method, c) -> mode -> row
    for r in rows:
        cell[(r["method"], int(r["concurrency"]))][r["mode"]] = r
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "ar"]
    if not methods:
        methods = ["ar"]
    fig, axes = plt.subplots(2, len(methods), figsize=(4.2 * len(methods), 7.5), squeeze=False)
    for j, m in enumerate(methods):
        cs = sorted(c for (mm, c) in cell if mm == m)
        series = defaultdict(list)
        for c in cs:
            modes = cell[(m, c)]
            ar = cell.get(("ar", c), {}).get("none")
            if ar:
                series["ar"].append((c, float(ar["images_per_s"]), float(ar["p50_s"])))
            if "none" in modes:
                series["whole windows"].append(
                    (c, float(modes["none"]["images_per_s"]), float(modes["none"]["p50_s"])))
            budgets = [r for k, r in modes.items() if k.startswith("budget:")]
            if budgets:
                b = max(budgets, key=lambda r: float(r["images_per_s"]))
                series["best fixed budget"].append(
                    (c, float(b["images_per_s"]), float(b["p50_s"])))
            if "goodput" in modes:
                series["goodput controller"].append(
                    (c, float(modes["goodput"]["images_per_s"]), float(modes["goodput"]["p50_s"])))
        styles = {"ar": ("k", "--"), "whole windows": ("C1", ":"),
                  "best fixed budget": ("C2", "-."), "goodput controller": ("C0", "-")}
        for name, pts in series.items():
            colour, style = styles[name]
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                            color=colour, label=name)
            axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], style, marker="o",
                            color=colour, label=name)
        axes[0][j].set_title(m)
        axes[0][j].set_ylabel("images / s")
        axes[1][j].set_ylabel("p50 latency (s)")
        axes[1][j].set_yscale("log")
        for a in (axes[0][j], axes[1][j]):
            a.set_xscale("log", base=2)
            a.set_xlabel("concurrent clients (closed loop)")
            a.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{out}/load_throughput_latency.png", dpi=100)

    mixed = []
    if os.path.exists(f"{out}/mixed.csv"):
        mixed = [r for r in csv.DictReader(open(f"{out}/mixed.csv")) if r["method"] != "all"]
    if mixed:  # none with --mixed-concurrency ''
        rows = mixed
        cs = sorted({int(r["concurrency"]) for r in rows})
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        ms = list(dict.fromkeys(r["method"] for r in rows))
        fig, axes = plt.subplots(1, len(cs), figsize=(4.2 * len(cs), 4), squeeze=False)
        width = 0.8 / max(len(modes), 1)
        for j, c in enumerate(cs):
            a = axes[0][j]
            for k, mode in enumerate(modes):
                vals = []
                for m in ms:
                    r = [x for x in rows if int(x["concurrency"]) == c and x["mode"] == mode
                         and x["method"] == m]
                    vals.append(float(r[0]["p50_s"]) if r else 0)
                a.bar([i + k * width for i in range(len(ms))], vals, width, label=mode)
            a.set_xticks([i + 0.4 - width / 2 for i in range(len(ms))])
            a.set_xticklabels(ms)
            a.set_title(f"mixed load, {c} clients")
            a.set_ylabel("p50 latency (s)")
            a.grid(alpha=0.3, axis="y")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{out}/load_mixed.png", dpi=100)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "load-bench")
