"""Checks deploy/k8s/: every manifest against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields are errors), YAML style (yamllint), and what imagegen relies on that no
schema says (the rules below). --self-test breaks the manifests in memory, one rule at a time,
and fails unless each breakage is caught; --server checks the ConfigMap's flags against
`imagegen-server --help`.

  python deploy/k8s/check.py [--self-test] [--server build/ci/server/imagegen-server]
"""
import argparse
import copy
import glob
import os
import re
import subprocess
import sys

import kubernetes_validate
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
SERVICE = "imagegen.v1.ImageGeneration"
K8S_VERSION = "1.33.0"  # a supported release; the schemas come with kubernetes-validate


def load(paths):
    docs = []
    for p in paths:
        with open(p) as f:
            for d in yaml.safe_load_all(f):
                if d:
                    docs.append((os.path.basename(p), d))
    return docs


def flags_of(docs):
    for _, d in docs:
        if d["kind"] == "ConfigMap" and "imagegen.flags" in d.get("data", {}):
            out = {}
            for line in d["data"]["imagegen.flags"].splitlines():
                line = line.strip()
                if line.startswith("--"):
                    k, _, v = line[2:].partition("=")
                    out[k] = v
            return out
    return {}


def one(docs, kind):
    found = [d for _, d in docs if d["kind"] == kind]
    if len(found) != 1:
        raise AssertionError(f"expected one {kind}, found {len(found)}")
    return found[0]


def rules(docs):
    """imagegen's own requirements; returns a list of problems."""
    errs = []

    def need(cond, msg):
        if not cond:
            errs.append(msg)

    try:
        dep = one(docs, "Deployment")
        svcs = [d for _, d in docs if d["kind"] == "Service"]
        grpc_svcs = [d for d in svcs
                     if any(p.get("targetPort") == "grpc" for p in d["spec"].get("ports", []))]
        assert len(grpc_svcs) == 1, f"expected one Service for the grpc port, found {len(grpc_svcs)}"
        svc = grpc_svcs[0]
        hpa = one(docs, "HorizontalPodAutoscaler")
        pdb = one(docs, "PodDisruptionBudget")
    except AssertionError as e:
        return [str(e)]
    # `kubectl apply -f deploy/k8s/` applies every *.yaml: a Secret there, with placeholders,
    # would overwrite the one the operator created from files on each apply.
    need(not any(d["kind"] == "Secret" and name.endswith(".yaml") for name, d in docs),
         "a Secret among the applied *.yaml: it would overwrite the real one on every apply "
         "(keep it as *.yaml.example)")
    flags = flags_of(docs)
    pod = dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    c = pod["containers"][0]
    sc, psc = c.get("securityContext", {}), pod.get("securityContext", {})
    need(psc.get("runAsNonRoot") is True, "pod: runAsNonRoot must be true")
    need(psc.get("runAsUser", 0) != 0, "pod: runAsUser must be a non-zero uid")
    need(sc.get("readOnlyRootFilesystem") is True, "container: readOnlyRootFilesystem")
    need(sc.get("allowPrivilegeEscalation") is False, "container: allowPrivilegeEscalation false")
    need("ALL" in sc.get("capabilities", {}).get("drop", []), "container: drop ALL capabilities")
    res = c.get("resources", {})
    need(str(res.get("limits", {}).get("nvidia.com/gpu", "")) == "1", "container: one GPU (limits)")
    need(flags.get("device", "").startswith("cuda"), "flags: --device=cuda")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    need("grpc" in ports and "metrics" in ports, "container: ports named grpc and metrics")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    need(env.get("IMAGEGEN_PORT") == str(ports.get("grpc")), "IMAGEGEN_PORT != the grpc port")
    need(env.get("IMAGEGEN_METRICS_PORT") == str(ports.get("metrics")),
         "IMAGEGEN_METRICS_PORT != the metrics port")
    # The HTTP API: the port the daemon listens on is the one named http, and a Service
    # balancing per connection (not the headless one) exposes it.
    need(env.get("IMAGEGEN_HTTP_PORT") == (str(ports["http"]) if "http" in ports else None),
         "IMAGEGEN_HTTP_PORT != the http port")
    if "http" in ports:
        http_svcs = [d for d in svcs
                     if any(p.get("targetPort") == "http" for p in d["spec"].get("ports", []))]
        need(len(http_svcs) == 1 and http_svcs[0]["spec"].get("clusterIP") != "None",
             "Service: one ClusterIP Service for the http port")
    # The kubelet's grpc probes speak plaintext: with TLS on they would fail, and the probes
    # must be HTTPS ones on the HTTP API's port (which serves HTTPS with --tls_cert).
    tls = bool(flags.get("tls_cert"))
    for probe, service, path in (("livenessProbe", "", "/health/live"),
                                 ("readinessProbe", SERVICE, "/health/ready"),
                                 ("startupProbe", "", "/health/live")):
        if tls:
            h = c.get(probe, {}).get("httpGet")
            need(h is not None and h.get("scheme") == "HTTPS",
                 f"{probe}: with --tls_cert, an httpGet probe with scheme HTTPS (the kubelet's "
                 f"grpc probes speak plaintext)")
            if h:
                need(h.get("port") in ("http", ports.get("http")) and "http" in ports,
                     f"{probe}: on the http port")
                need(h.get("path") == path, f"{probe}: path must be {path}")
            continue
        g = c.get(probe, {}).get("grpc")
        need(g is not None, f"{probe}: must be a native grpc probe")
        if g:
            need(g.get("port") == ports.get("grpc"), f"{probe}: on the grpc port")
            need(g.get("service", "") == service, f"{probe}: service must be '{service}'")
    grace = float(flags.get("grace_seconds", "30"))
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_s = float(pre[1]) if len(pre) == 2 and pre[0] == "sleep" else 0.0
    need(pod.get("terminationGracePeriodSeconds", 30) > grace + pre_s,
         f"terminationGracePeriodSeconds must exceed --grace_seconds ({grace:g}) + preStop "
         f"({pre_s:g})")
    need(any(a.startswith("--flagfile=") for a in c.get("args", [])), "args: --flagfile")
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    ff = [a.split("=", 1)[1] for a in c.get("args", []) if a.startswith("--flagfile=")]
    need(all(os.path.dirname(f) in mounts for f in ff), "the flagfile's folder is not mounted")
    tok = flags.get("token_file", "")
    need(not tok or os.path.dirname(tok) in mounts, "--token_file's folder is not mounted")
    need(svc["spec"].get("clusterIP") == "None", "Service: headless (clusterIP None) for gRPC")
    for sv in svcs:
        need(sv["spec"].get("selector") == {k: labels.get(k) for k in sv["spec"].get("selector", {})}
             and sv["spec"].get("selector"), "Service: selector must match the pod labels")
    ref = hpa["spec"]["scaleTargetRef"]
    need(ref["kind"] == "Deployment" and ref["name"] == dep["metadata"]["name"],
         "HPA: must scale the Deployment")
    need(any(m.get("pods", {}).get("metric", {}).get("name") == "imagegen_queue_depth"
             for m in hpa["spec"].get("metrics", [])), "HPA: on imagegen_queue_depth")
    need(hpa["spec"].get("minReplicas", 1) >= 2, "HPA: minReplicas >= 2 (PDB with one replica)")
    # The PodMonitor (an example): it must select these pods and scrape the port named metrics
    # at /metrics over plain HTTP, with no field its CRD lacks among those checked here.
    for pm in [d for _, d in docs if d["kind"] == "PodMonitor"]:
        spec = pm.get("spec", {})
        need(pm.get("apiVersion") == "monitoring.coreos.com/v1",
             "PodMonitor: apiVersion monitoring.coreos.com/v1")
        extra = sorted(set(spec) - POD_MONITOR_SPEC_KEYS)
        need(not extra, f"PodMonitor: spec fields this check does not know {extra}")
        sel = spec.get("selector", {}).get("matchLabels", {})
        need(sel and sel.items() <= labels.items(),
             "PodMonitor: selector must match the pod labels")
        eps = spec.get("podMetricsEndpoints", [])
        need(len(eps) >= 1, "PodMonitor: one podMetricsEndpoints entry")
        for ep in eps:
            extra = sorted(set(ep) - POD_METRICS_ENDPOINT_KEYS)
            need(not extra, f"PodMonitor: endpoint fields this check does not know {extra}")
            need(ep.get("port") == "metrics" and "metrics" in ports,
                 "PodMonitor: on the port named metrics")
            need(ep.get("path", "/metrics") == "/metrics", "PodMonitor: path /metrics")
            need(ep.get("scheme", "http") == "http", "PodMonitor: the metrics port is plain HTTP")
    need(pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(),
         "PDB: selector must match the pod labels")
    return errs


# Kinds that Kubernetes' schemas do not hold: a CRD of the Prometheus Operator, whose schema no
# maintained package carries. Their fields are checked by the rules below instead (the keys
# imagegen's example uses, the selector and the port).
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}
POD_MONITOR_SPEC_KEYS = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel",
                         "podTargetLabels", "sampleLimit"}
POD_METRICS_ENDPOINT_KEYS = {"port", "path", "interval", "scrapeTimeout", "scheme",
                             "honorLabels", "relabelings", "metricRelabelings"}


def schema_errors(docs):
    errs = []
    for name, d in docs:
        if (d.get("apiVersion"), d.get("kind")) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errs.append(f"{name} {d.get('kind')}: {e.message}")
    return errs


def yamllint(paths):
    cfg = "{extends: default, rules: {line-length: {max: 100}, document-start: disable}}"
    r = subprocess.run([sys.executable, "-m", "yamllint", "-f", "parsable", "-d", cfg, *paths],
                       capture_output=True, text=True)
    return [l for l in r.stdout.splitlines() if l.strip()]


def server_flags(binary, flags):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    out += subprocess.run([binary, "--help"], capture_output=True, text=True).stderr
    known = set(re.findall(r"--([a-z_]+)", out))
    return [f"flags: --{k} is not a flag of imagegen-server" for k in flags if k not in known]


def self_test(docs):
    """Each breakage must be caught, by the rules or the schema."""

    def dep(ds):
        return next(d for _, d in ds if d["kind"] == "Deployment")

    def ctr(ds):
        return dep(ds)["spec"]["template"]["spec"]["containers"][0]

    def cm(ds):
        return next(d for _, d in ds if d["kind"] == "ConfigMap" and "imagegen.flags" in d["data"])

    def pm(ds):
        return next(d for _, d in ds if d["kind"] == "PodMonitor")

    def tls_on(ds):
        cm(ds)["data"]["imagegen.flags"] += ("--tls_cert=/etc/imagegen/tls/tls.crt\n"
                                             "--tls_key=/etc/imagegen/tls/tls.key\n")

    def https_probes(ds):
        tls_on(ds)
        for probe, path in (("livenessProbe", "/health/live"), ("readinessProbe", "/health/ready"),
                            ("startupProbe", "/health/live")):
            p = ctr(ds)[probe]
            p.pop("grpc")
            p["httpGet"] = {"port": "http", "path": path, "scheme": "HTTPS"}

    # What docs/deploy.md tells a TLS deployment to do must pass.
    ds = copy.deepcopy(docs)
    https_probes(ds)
    wrong = rules(ds) + schema_errors(ds)
    print(f"  self-test: TLS with HTTPS probes passes: {'no: ' + wrong[0] if wrong else 'yes'}")

    breakages = {
        "root filesystem writable": lambda ds: ctr(ds)["securityContext"].update(
            readOnlyRootFilesystem=False),
        "runs as root": lambda ds: dep(ds)["spec"]["template"]["spec"]["securityContext"].update(
            runAsNonRoot=False, runAsUser=0),
        "grace period shorter than the drain": lambda ds: dep(ds)["spec"]["template"][
            "spec"].update(terminationGracePeriodSeconds=30),
        "longer drain in the flags": lambda ds: cm(ds)["data"].update(
            {"imagegen.flags": cm(ds)["data"]["imagegen.flags"].replace(
                "--grace_seconds=30", "--grace_seconds=60")}),
        "readiness on the process, not the service": lambda ds: ctr(ds)["readinessProbe"][
            "grpc"].update(service=""),
        "HTTP probe instead of gRPC": lambda ds: ctr(ds).update(
            livenessProbe={"httpGet": {"port": 9464, "path": "/metrics"}}),
        "Service not headless": lambda ds: next(d for _, d in ds if d["kind"] == "Service")[
            "spec"].pop("clusterIP"),
        "HTTP port off in the env": lambda ds: ctr(ds)["env"].__setitem__(
            slice(None), [e for e in ctr(ds)["env"] if e["name"] != "IMAGEGEN_HTTP_PORT"]),
        "HTTP Service headless": lambda ds: [d for _, d in ds if d["kind"] == "Service"][1][
            "spec"].update(clusterIP="None"),
        "HTTP Service selects other pods": lambda ds: [
            d for _, d in ds if d["kind"] == "Service"][1]["spec"].update(
                selector={"app": "other"}),
        "no GPU": lambda ds: ctr(ds)["resources"]["limits"].pop("nvidia.com/gpu"),
        "misspelt field (schema)": lambda ds: dep(ds)["spec"]["template"]["spec"].update(
            terminationGracePeriodSecond=45),
        "wrong type (schema)": lambda ds: dep(ds)["spec"].update(replicas="two"),
        "Secret applied with the manifests": lambda ds: ds.__setitem__(
            slice(None), [("secret.yaml" if d["kind"] == "Secret" else n, d) for n, d in ds]),
        "TLS on, probes still plaintext gRPC": lambda ds: tls_on(ds),
        "PodMonitor on another port": lambda ds: pm(ds)["spec"]["podMetricsEndpoints"][0].update(
            port="grpc"),
        "PodMonitor selects other pods": lambda ds: pm(ds)["spec"]["selector"].update(
            matchLabels={"app": "other"}),
        "PodMonitor misspelt field": lambda ds: pm(ds)["spec"]["podMetricsEndpoints"][0].update(
            intervall="15s"),
        "HPA on the wrong target": lambda ds: next(
            d for _, d in ds if d["kind"] == "HorizontalPodAutoscaler")["spec"][
            "scaleTargetRef"].update(name="other"),
    }
    missed = ["TLS with HTTPS probes (refused)"] if wrong else []
    for what, breakit in breakages.items():
        ds = copy.deepcopy(docs)
        breakit(ds)
        caught = rules(ds) + schema_errors(ds)
        print(f"  self-test: {what}: {'caught' if caught else 'MISSED'}"
              + (f" ({caught[0]})" if caught else ""))
        if not caught:
            missed.append(what)
    return missed


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--server", default="", help="imagegen-server binary: check the flags")
    args = ap.parse_args()
    # The examples (the Secret, the PodMonitor) are checked too, though `kubectl apply -f`
    # skips them.
    paths = sorted(glob.glob(os.path.join(HERE, "*.yaml")) +
                   glob.glob(os.path.join(HERE, "*.yaml.example")))
    docs = load(paths)
    errs = schema_errors(docs) + yamllint(paths) + rules(docs)
    if args.server:
        errs += server_flags(args.server, flags_of(docs))
    print(f"k8s: {len(docs)} resources in {len(paths)} files, Kubernetes {K8S_VERSION} schemas "
          f"(strict), yamllint, imagegen's rules")
    for e in errs:
        print("  ERROR", e)
    missed = self_test(docs) if args.self_test else []
    if missed:
        print("  self-test missed:", ", ".join(missed))
    ok = not errs and not missed
    print("k8s:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
