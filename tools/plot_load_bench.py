#!/usr/bin/env python3
"""Plots for imagegen-load-bench: reads DIR/results.csv (and DIR/budget.csv if present) and
writes DIR/load_throughput_latency.png (images/s and p50 latency against concurrency, continuous
batching solid, one request at a time dashed) and DIR/load_budget.png (images/s against the
token budget at one concurrency)."""
import csv
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out):
    rows = list(csv.DictReader(open(f"{out}/results.csv")))
    series = defaultdict(list)
    for r in rows:
        series[(r["method"], r["mode"])].append(
            (int(r["concurrency"]), float(r["images_per_s"]), float(r["p50_s"]), float(r["p99_s"])))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {}
    for (method, mode), pts in sorted(series.items()):
        pts.sort()
        c = colours.setdefault(method, f"C{len(colours)}")
        style = "-" if mode == "batched" else "--"
        label = f"{method} ({'continuous batching' if mode == 'batched' else 'one at a time'})"
        a1.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=c, label=label)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], style, marker="o", color=c, label=label)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent clients (closed loop)")
        a.grid(alpha=0.3)
    a1.set_ylabel("images / s")
    a1.set_title("Throughput")
    a2.set_yscale("log")
    a2.set_ylabel("p50 latency (s)")
    a2.set_title("Latency")
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{out}/load_throughput_latency.png", dpi=110)

    if os.path.exists(f"{out}/budget.csv"):
        rows = list(csv.DictReader(open(f"{out}/budget.csv")))
        by = defaultdict(list)
        for r in rows:
            by[r["method"]].append((int(r["budget"]), float(r["images_per_s"]), float(r["nfe"])))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, pts in sorted(by.items()):
            top = max(p[0] for p in pts) * 2 or 4096
            pts = sorted((p[0] if p[0] > 0 else top, p[1], p[2]) for p in pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget per step (rightmost point: no budget)")
        ax.set_ylabel("images / s")
        ax.set_title(f"Token budget at concurrency {rows[0]['concurrency']}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{out}/load_budget.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "load-bench")
