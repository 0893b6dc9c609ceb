"""Checks the Grafana dashboard (deploy/grafana/dashboards/imagegen.json): it parses, its panels
have distinct ids and do not overlap, every query is valid PromQL (promtool, each query as a
recording rule), and every imagegen_* series a query names is one the daemon exports (the names
named in server/metrics.cc; a histogram's _bucket, _sum and _count). --self-test breaks the
dashboard in memory, one way at a time, and fails unless each breakage is caught.

  python deploy/grafana/check.py --promtool /usr/bin/promtool [--self-test]
"""
import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DASHBOARD = os.path.join(HERE, "dashboards", "imagegen.json")


def exported_metrics():
    """The metric names server/metrics.cc registers (the quoted imagegen_* names there: its
    families and the ones its collectable builds at scrape time)."""
    with open(os.path.join(ROOT, "server", "metrics.cc"), encoding="utf-8") as f:
        names = set(re.findall(r'"(imagegen_[a-z0-9_]+)"', f.read()))
    if len(names) < 10:
        raise SystemExit("check: found only %d metric names in server/metrics.cc" % len(names))
    return names


def problems(dash, promtool, metrics):
    """What is wrong with the dashboard `dash` (a parsed JSON object): a list of sentences."""
    out = []
    panels = dash.get("panels", [])
    ids = [p.get("id") for p in panels]
    if len(set(ids)) != len(ids):
        out.append("panel ids repeat: %s" % ids)
    cells = {}
    for p in panels:
        g = p.get("gridPos", {})
        for x in range(g.get("x", 0), g.get("x", 0) + g.get("w", 0)):
            for y in range(g.get("y", 0), g.get("y", 0) + g.get("h", 0)):
                if (x, y) in cells:
                    out.append("panels %s and %s overlap" % (cells[(x, y)], p.get("id")))
                    break
                cells[(x, y)] = p.get("id")
            else:
                continue
            break
    exprs = [(p.get("id"), t["expr"]) for p in panels for t in p.get("targets", [])]
    if not exprs:
        out.append("no queries")
    for pid, e in exprs:
        for name in re.findall(r"\bimagegen_[a-z0-9_]+", e):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name not in metrics and base not in metrics:
                out.append("panel %s names %s, which the daemon does not export" % (pid, name))
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        f.write("groups:\n  - name: dashboard\n    rules:\n")
        for i, (_, e) in enumerate(exprs):
            f.write("      - record: dashboard_query_%d\n        expr: %s\n" % (i, json.dumps(e)))
        rules = f.name
    try:
        r = subprocess.run([promtool, "check", "rules", rules], capture_output=True, text=True)
        if r.returncode != 0:
            out.append("promtool: " + (r.stdout + r.stderr).strip().replace("\n", " "))
    finally:
        os.unlink(rules)
    return out


def self_test(dash, promtool, metrics):
    """Each breakage must be reported; 0 when all are."""
    def broken(fn):
        d = copy.deepcopy(dash)
        fn(d)
        return d

    cases = {  # name: (breakage, words the report must hold)
        "a repeated panel id": (
            lambda d: d["panels"][1].update(id=d["panels"][0]["id"]), "ids repeat"),
        "overlapping panels": (
            lambda d: d["panels"][1].update(gridPos=dict(d["panels"][0]["gridPos"])), "overlap"),
        "a metric the daemon does not export": (
            lambda d: d["panels"][0]["targets"][0].update(
                expr="sum(rate(imagegen_imgaes_total[1m]))"), "imagegen_imgaes_total"),
        "a query that is not PromQL": (
            lambda d: d["panels"][0]["targets"][0].update(
                expr="sum by (method (rate(imagegen_images_total[1m]))"), "promtool"),
    }
    failures = 0
    for name, (fn, words) in cases.items():
        found = problems(broken(fn), promtool, metrics)
        ok = len(found) == 1 and words in found[0]
        failures += not ok
        print("self-test: %s: %s" % (name, "caught: " + found[0] if ok else "WRONG: %s" % found))
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--promtool", default="promtool")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    metrics = exported_metrics()
    found = problems(dash, args.promtool, metrics)
    for p in found:
        print("check: " + p)
    queries = sum(len(p.get("targets", [])) for p in dash["panels"])
    if not found:
        print("check: %d panels, %d queries: valid PromQL, every series one of the daemon's %d "
              "metrics" % (len(dash["panels"]), queries, len(metrics)))
    failures = self_test(dash, args.promtool, metrics) if args.self_test else 0
    return 1 if found or failures else 0


if __name__ == "__main__":
    sys.exit(main())
