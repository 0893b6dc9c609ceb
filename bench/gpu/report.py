#!/usr/bin/env python3
"""Writes results-gpu.md from what bench/gpu/run_all.sh left in its --out directory.

Standard library only (a GPU host has Python but maybe not pandas). Tables: the machine, the
test summaries, the step-cost curve (ratio to one token, and to the weight-read limit), the
speculative bench at batch 1 (compression, wall-clock speedup vs AR, forward vs the rest of a
step), the load bench (batched vs serial, speculation vs AR). Missing inputs are reported as
missing, never filled in.
"""
import argparse
import csv
import os
import re
import sys


def read_csv(path):
    if not os.path.exists(path):
        return None
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def gtest_summary(path):
    if not os.path.exists(path):
        return "not run"
    text = open(path, errors="replace").read()
    passed = re.search(r"\[  PASSED  \] (\d+) tests?", text)
    failed = re.search(r"\[  FAILED  \] (\d+) tests?, listed below", text)
    skipped = re.search(r"\[  SKIPPED \] (\d+) tests?", text)
    parts = []
    if passed:
        parts.append(f"{passed.group(1)} passed")
    if failed:
        parts.append(f"**{failed.group(1)} failed**")
    if skipped:
        parts.append(f"{skipped.group(1)} skipped")
    return ", ".join(parts) or "no summary (crashed?)"


def f(x, nd=2):
    try:
        return f"{float(x):.{nd}f}"
    except (TypeError, ValueError):
        return "-"


def step_cost_section(rows):
    out = ["## Step cost (one target forward, CFG: two rows per request)", ""]
    if not rows:
        return out + ["step_cost.csv missing.", ""]
    groups = {}
    for r in rows:
        # Older CSVs have no forward column: the eager forward.
        groups.setdefault((r["shape"], r["dtype"], r.get("forward") or "eager"), []).append(r)
    for (shape, dtype, forward), rs in groups.items():
        wr = float(rs[0]["weight_read_ms"] or 0)
        head = f"### {shape}, {dtype}, {forward} forward"
        head += f" ({float(rs[0]['params_bytes']) / 1e6:.0f} MB of weights"
        head += f", weight-read limit {wr * 1e3:.0f} us)" if wr > 0 else ")"
        out += [head, "", "| requests | tokens/step | tokens/request | ms | x one token |"
                " tokens/s | launches |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rs:
            # Older CSVs have no launches column.
            out.append(f"| {r['requests']} | {r['tokens_per_step']} | {r['tokens_per_request']} | "
                       f"{f(r['median_ms'], 3)} | {f(r['ratio_to_one_token'])} | "
                       f"{float(r['tokens_per_s']):.0f} | {r.get('launches') or '-'} |")
        one = [r for r in rs if r["requests"] == "1" and r["tokens_per_step"] == "1"]
        if one and wr > 0:
            ms = float(one[0]["median_ms"])
            out += ["", f"1 request, 1 token: {ms * 1e3:.0f} us = {ms / wr:.2f} x the weight-read "
                    "limit."]
        flat = [r for r in rs if r["requests"] == "1" and int(r["tokens_per_step"]) <= 256]
        if one and flat:
            worst = max(float(r["ratio_to_one_token"]) for r in flat)
            out += ["", f"1 request, 1..256 tokens per step: at most {worst:.2f} x the 1-token "
                    "step (target: within 1.2 x)."]
        out.append("")
    return out


# LlamaGen's serving README (autoregressive/serve/README.md): sample_c2i.py draws 8 images (8
# class labels, CFG 4.0: 16 rows) of 384 px (24 x 24 = 576 tokens) in bf16 on an A100; seconds
# for the whole batch with their own PyTorch loop and with vLLM 0.4.1.
LLAMAGEN_384 = {"gpt-b": (7.80, 2.39), "gpt-l": (13.72, 3.48), "gpt-xl": (19.76, 4.84)}


def llamagen_section(rows):
    """imagegen's forward against LlamaGen's own figures on the same model shapes: 576 steps of
    8 requests at one token each, from the step-cost rows measured at exactly that (8 requests,
    1 token per request; step_profile.sh measures them with --grid 24)."""
    out = ["## Against LlamaGen's own serving figures (8 images of 384 px, CFG)", ""]
    sel = [r for r in rows if r["shape"] in LLAMAGEN_384 and r["requests"] == "8"
           and r["tokens_per_request"] == "1"]
    if not sel:
        return out + ["No step-cost row with 8 requests of 1 token (bench/gpu/step_profile.sh "
                      "measures them).", ""]
    out += ["Estimate: 576 x one measured step (the target forward of 8 CFG pairs, one token "
            "each, at the context in the table); no sampling, no VQ decode. LlamaGen's figures "
            "are for the same 8 images on an A100 (their serve/README.md).", "",
            "| shape | dtype | forward | context | step ms | imagegen s (est.) | LlamaGen PyTorch s "
            "| LlamaGen + vLLM s | imagegen / vLLM |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in sel:
        ms = float(r["median_ms"])
        est = 576 * ms / 1e3
        base, vllm = LLAMAGEN_384[r["shape"]]
        out.append(f"| {r['shape']} | {r['dtype']} | {r.get('forward') or 'eager'} | "
                   f"{r['committed_prefix']} | {ms:.2f} | {est:.2f} | {base:.2f} | {vllm:.2f} | "
                   f"{est / vllm:.2f} |")
    return out + [""]


def spec_section(rows, split_rows=None):
    out = ["## Speculative decoding at batch 1 (imagegen-spec-bench)", ""]
    if not rows:
        return out + ["spec/results.csv missing.", ""]
    if split_rows:
        # Speedups come from the run with the step split off; the split (which syncs the device
        # up to three times a step) from its own smaller run.
        by_key = {(r["method"], r["window"]): r for r in split_rows}
        merged = []
        for r in rows:
            r = dict(r)
            s = by_key.get((r["method"], r["window"]))
            for k in ("forward_ms_per_step", "other_ms_per_step", "other_share",
                      "forward_launches_per_step", "other_launches_per_step"):
                r[k] = s.get(k, "") if s else ""
            merged.append(r)
        rows = merged
        out += ["Speedups: a run with the step split off. Forward and other ms per step: a second "
                "run (one image per class) that synchronises the device around the forward.", ""]
    out += ["| method | L | NFE | step compression | wall-clock speedup vs AR | speedup / "
            "compression | forward ms/step | other ms/step | other share | forward launches/step "
            "| other launches/step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        comp = float(r["step_compression"])
        speed = float(r["latency_ratio_vs_ar"])
        eff = speed / comp if comp > 0 else 0
        share = r.get("other_share", "")
        out.append(f"| {r['method']} | {r['window']} | {f(r['nfe'], 1)} | {f(comp)} | "
                   f"{f(speed)} | {f(eff)} | {f(r.get('forward_ms_per_step'), 3)} | "
                   f"{f(r.get('other_ms_per_step'), 3)} | "
                   f"{f(100 * float(share), 1) + '%' if share not in ('', 'nan') else '-'} | "
                   f"{f(r.get('forward_launches_per_step'), 0)} | "
                   f"{f(r.get('other_launches_per_step'), 0)} |")
    return out + [""]


def load_section(rows):
    out = ["## Load (imagegen-load-bench: closed loop, continuous batching vs one at a time)", ""]
    if not rows:
        return out + ["load/results.csv missing.", ""]
    out += ["| method | mode | concurrency | images/s | p50 s | p99 s | tokens/step | step ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['mode']} | {r['concurrency']} | {f(r['images_per_s'])} | "
                   f"{f(r['p50_s'], 3)} | {f(r['p99_s'], 3)} | {f(r['tokens_per_step'], 1)} | "
                   f"{f(r['step_ms'], 2)} |")
    return out + [""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="run_all.sh's output directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--docs", help="also write the report here (docs/results-gpu.md)")
    ap.add_argument("--llamagen", metavar="CSV",
                    help="only print the comparison with LlamaGen's figures from a step-cost CSV")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when an input is missing or a test log shows a failure")
    a = ap.parse_args()
    if a.llamagen:
        print("\n".join(llamagen_section(read_csv(a.llamagen) or [])))
        return 0
    if not a.out:
        ap.error("--out is required")
    problems = []
    lines = ["# GPU results (bench/gpu/run_all.sh)", "",
             "Written by bench/gpu/report.py from one run of bench/gpu/run_all.sh "
             f"(--device {a.device}). Every number below was measured in that run; the raw "
             "logs and CSVs are beside this file in the run's output directory.", "",
             "## Machine", "", "```"]
    mi = os.path.join(a.out, "machine.txt")
    lines += open(mi).read().strip().splitlines() if os.path.exists(mi) else ["machine.txt missing"]
    lines += ["```", "", "## Tests on the device", ""]
    for name in ("engine_tests", "parity_tests", "kernels_tests"):
        summary = gtest_summary(os.path.join(a.out, name + ".log"))
        lines.append(f"- {name}: {summary}")
        if "failed" in summary or "crashed" in summary or (name == "engine_tests" and
                                                            summary == "not run"):
            problems.append(f"{name}: {summary}")
    lease = os.path.join(a.out, "lease.log")
    if os.path.exists(lease):  # bench/gpu/lease.sh's phases, and its kernels fallback
        lease_lines = [l.rstrip() for l in open(lease, errors="replace") if l.strip()]
        if any("IMAGEGEN_FUSED_KERNELS=0" in l for l in lease_lines):
            lines.append("- **the fused kernels failed their tests on this device: every phase "
                         "after them ran the eager path (IMAGEGEN_FUSED_KERNELS=0)**")
            problems.append("kernels: failed, later phases on the eager path")
        lines += ["", "Phases (lease.log):", "", "```"] + lease_lines + ["```"]
    syncs = os.path.join(a.out, "engine_tests.log")
    if os.path.exists(syncs):
        sync_lines = [l.rstrip() for l in open(syncs, errors="replace")
                      if re.match(r"^\S+\s+on (cpu|cuda)", l)]
        if sync_lines:
            lines += ["", "Host syncs per step (HostSyncTest):", "", "```"] + sync_lines + ["```"]
    lines.append("")
    inputs = {}
    for key, rel in (("step", "step_cost.csv"), ("spec", "spec/results.csv"),
                     ("load", "load/results.csv")):
        inputs[key] = read_csv(os.path.join(a.out, rel))
        if not inputs[key]:
            problems.append(f"{rel} missing or empty")
    lines += step_cost_section(inputs["step"])
    lines += llamagen_section((inputs["step"] or []) +
                              (read_csv(os.path.join(a.out, "step_cost_vllm.csv")) or []))
    lines += spec_section(inputs["spec"], read_csv(os.path.join(a.out, "spec-split/results.csv")))
    lines += load_section(inputs["load"])
    serve = os.path.join(a.out, "serve.log")
    lines += ["## The daemon on the device (--phase serve: generate, classify, load ar and scd-mc, "
              "SIGTERM)", ""]
    if os.path.exists(serve):
        lines += ["```"] + open(serve, errors="replace").read().strip().splitlines() + ["```", ""]
    else:
        lines += ["not run (bench/gpu/pack_server.sh, then --phase serve).", ""]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "results-gpu.md"), "w") as fh:
        fh.write(text)
    if a.docs:
        with open(a.docs, "w") as fh:
            fh.write(text)
    print(f"wrote {os.path.join(a.out, 'results-gpu.md')}" + (f" and {a.docs}" if a.docs else ""))
    for p in problems:
        print(f"report: {p}", file=sys.stderr)
    return 1 if a.strict and problems else 0


if __name__ == "__main__":
    sys.exit(main())
