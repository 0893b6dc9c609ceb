#!/usr/bin/env python3
"""Plots for imagegen-spec-bench: reads DIR/results.csv and DIR/hist.csv, writes
DIR/compression_vs_window.png (step compression against L per method) and
DIR/tokens_per_step.png (histogram of tokens committed per step, sjd vs scd-mc vs sjd-pac)."""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out):
    rows = list(csv.DictReader(open(f"{out}/results.csv")))
    by_method = defaultdict(list)
    for r in rows:
        if r["method"].startswith("ar") or r["method"].startswith("gsd-G"):
            continue
        by_method[r["method"]].append((int(r["window"]), float(r["step_compression"])))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, pts in sorted(by_method.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window L (tokens fed per step)")
    ax.set_ylabel("step compression (tokens / NFE)")
    ax.set_title("Step compression vs window, bundled Fashion-MNIST GPT")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(f"{out}/compression_vs_window.png", dpi=120)

    hist = defaultdict(dict)
    for r in csv.DictReader(open(f"{out}/hist.csv")):
        hist[(r["method"], int(r["window"]))][int(r["tokens_per_step"])] = int(r["steps"])
    wanted = [k for k in hist if k[0] in ("sjd", "scd-mc", "sjd-pac")]
    # One window for the comparison: the largest one all three ran at.
    common = set.intersection(*[{w for (m, w) in wanted if m == name} for name in ("sjd", "scd-mc", "sjd-pac")]) \
        if wanted else set()
    if common:
        L = max(common)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        width = 0.28
        for i, name in enumerate(("sjd", "scd-mc", "sjd-pac")):
            h = hist[(name, L)]
            total = sum(h.values())
            xs = sorted(h)
            ax.bar([x + (i - 1) * width for x in xs], [h[x] / total for x in xs], width=width, label=name)
        ax.set_xlabel("tokens committed in one step")
        ax.set_ylabel("fraction of steps")
        ax.set_title(f"Tokens per step at L={L}")
        ax.set_xlim(0, 20)
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{out}/tokens_per_step.png", dpi=120)
    print(f"plots written to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
