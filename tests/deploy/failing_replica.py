#!/usr/bin/env python3
"""A failure drill: two replicas, one of whose engines fails every step for a while, as after a
transient device error (the daemon's --inject_step_failures_seconds), under two kinds of client,
both round robin over the two with gRPC retries on UNAVAILABLE (docs/deploy.md): half with
client-side health checks (the documented service config), half without (a client that only
retries).

    PYTHONPATH=build/ci/python python3 tests/deploy/failing_replica.py \\
        --server build/ci/server/imagegen-server [--clients 8] [--drill-seconds 6]

Replica A runs the drill with --engine_failed_steps=3 and --engine_probe_seconds=1; B is
healthy. Under load from the start, A's first steps fail and end their calls INTERNAL (not
retryable: the model may have run); after 3 in a row A turns NOT_SERVING and refuses its new
calls UNAVAILABLE: the clients with health checks stop picking A, the others' calls to A are
refused and retried on B. A probes itself every second; once the drill is over a probe's step
succeeds, A turns SERVING and takes calls again. Checked:
  - every call ended with an image or INTERNAL from the drill (or, for a client without
    health checks, UNAVAILABLE when all its attempts were refused); nothing else, nothing lost;
  - no call sent after A was seen NOT_SERVING failed (the refusal comes before the health
    change, so such a call went to B, or was refused and retried there);
  - A refused calls (the clients without health checks met the refusal);
  - A turned NOT_SERVING once (reason failing), came back through a probe whose step
    succeeded, and then completed at least 3 calls; B completed calls meanwhile;
  - both exit 0 on SIGTERM.
--no-refusal-control runs A with --engine_probe_seconds=0 (no probe, so no refusal either:
calls are taken): the clients without health checks keep sending calls to A for the rest of
the drill, which fail INTERNAL; exits 0 only if the check caught those.
"""
import argparse
import shutil
import signal
import sys
import tempfile
import time
import urllib.request

import grpc
import health_pb2
from imagegen.v1 import imagegen_pb2_grpc

from replicas import Load, Replica, channel_for, metric_sum

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DrillLoad(Load):
    """The replicas' load, where INTERNAL from the drill is a clear status too; each failure
    keeps the time its call was sent."""

    def __init__(self, stub, clients, seed, refusals_clear=False):
        super().__init__(stub, clients, seed)
        self.failed_at = []
        self.refusals_clear = refusals_clear

    def failure(self, e, stream, sent_at):
        kind = 'stream' if stream else 'unary'
        if e.code() == grpc.StatusCode.INTERNAL and "failure drill" in (e.details() or ""):
            with self.lock:
                self.failed_at.append(sent_at)
            return f"{kind} INTERNAL (drill)"
        # A client without health checks keeps A in its rotation, and round robin shares its
        # picks among every call of the channel, so all 5 attempts of a call can land on A
        # (1 call of 70 in a clean-clone CI run): a clear status that says to go elsewhere.
        if (e.code() == grpc.StatusCode.UNAVAILABLE and self.refusals_clear
                and "are refused here" in (e.details() or "")):
            return f"{kind} UNAVAILABLE (refused at every attempt)"
        return None


def metric_where(mport, name, *labels):
    """The sum of the series of `name` that carry every one of `labels` ('outcome="ok"')."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30).read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(name + "{") and all(x in l for x in labels))


def completed(r):
    return metric_where(r.mport, "imagegen_requests_total", 'outcome="ok"')


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--server", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--drill-seconds", type=float, default=6)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-refusal-control", action="store_true",
                    help="the negative control: A without probes (and so without refusals) "
                         "must fail calls sent after it turned NOT_SERVING")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="imagegen-failing-replica-")
    probe = 0 if args.no_refusal_control else 1
    a = Replica("a", args.server, work, 20,
                flags=(f"--inject_step_failures_seconds={args.drill_seconds:g}",
                       "--engine_failed_steps=3", f"--engine_probe_seconds={probe}"))
    b = Replica("b", args.server, work, 20)
    for r in (a, b):
        r.wait_serving()
    half = max(args.clients // 2, 1)
    loads = [DrillLoad(imagegen_pb2_grpc.ImageGenerationStub(channel_for([a, b])), half,
                       args.seed),
             DrillLoad(imagegen_pb2_grpc.ImageGenerationStub(
                 channel_for([a, b], health_checks=False)), half, args.seed + 1000,
                       refusals_clear=True)]
    threads = [t for l in loads for t in l.threads]
    t0 = time.time()
    for t in threads:
        t.start()

    # A's health every 20 ms: when it turned NOT_SERVING, and when SERVING again. The drill
    # starts at A's first step; give it the drill's time and 60 s more to come back.
    t_down = t_back = None
    end = t0 + args.drill_seconds + 60
    while time.time() < end and t_back is None:
        s = a.status(timeout=1.0)
        now = time.time()
        if t_down is None and s == NOT_SERVING:
            t_down = now
        elif t_down is not None and s == SERVING:
            t_back = now
        time.sleep(0.02)
    b_during = completed(b)
    # Back: A takes calls again (round robin picks it once its health watch hears SERVING).
    a_back = completed(a)
    a_after = a_back
    until = time.time() + 120
    while t_back is not None and time.time() < until and a_after < a_back + 3:
        time.sleep(0.2)
        a_after = completed(a)
    for l in loads:
        l.stop.set()
    for t in threads:
        t.join(timeout=180)
    hung = sum(t.is_alive() for t in threads)
    probes_ok = metric_where(a.mport, "imagegen_engine_probes_total", 'outcome="ok"')
    probes_failed = metric_where(a.mport, "imagegen_engine_probes_total", 'outcome="failed"')
    refused = metric_where(a.mport, "imagegen_requests_total", 'outcome="unavailable"')
    unhealthy = metric_where(a.mport, "imagegen_engine_unhealthy_total", 'reason="failing"')
    retries = metric_sum(b.mport, "imagegen_call_retries_total")
    codes = []
    for r in (a, b):
        r.proc.send_signal(signal.SIGTERM)
        codes.append(r.proc.wait(timeout=120))

    k = {key: sum(l.counts[key] for l in loads) for key in loads[0].counts}
    failures = {}
    for l in loads:
        for key, n in l.failures.items():
            failures[key] = failures.get(key, 0) + n
    lost = [x for l in loads for x in l.lost]
    late = sorted(s for l in loads for s in l.failed_at if t_down is not None and s > t_down)
    rel = lambda t: f"{t - t0:.2f} s" if t is not None else "never"
    print(f"failing replica: {args.clients} clients, 2 replicas, A's steps fail for "
          f"{args.drill_seconds:g} s from its first step"
          + (" (control: no probes, no refusals)" if args.no_refusal_control else ""))
    print(f"  A NOT_SERVING at {rel(t_down)}, SERVING again at {rel(t_back)}; probes ok "
          f"{probes_ok:g}, failed {probes_failed:g}; calls refused by A {refused:g}; retried "
          f"attempts on B {retries:g}")
    print(f"  A completed {a_after - a_back:g} calls after it came back; B {b_during:g} by then;"
          f" exit codes {codes}")
    print(f"  sent {k['sent']}, completed {k['completed']}, failed with a status {k['failed']} "
          f"{failures}, lost {k['lost']}")
    problems = []
    if lost:
        problems.append(f"lost requests: {lost[:5]}")
    if hung:
        problems.append(f"{hung} client threads still waiting")
    if k["sent"] != k["completed"] + k["failed"] + k["lost"]:
        problems.append("the counts do not add up")
    if k["failed"] == 0:
        problems.append("no call met the drill: it was not exercised")
    if late:
        problems.append(f"{len(late)} calls sent after A was seen NOT_SERVING failed INTERNAL "
                        f"(the first sent {late[0] - t_down:.3f} s after)")
    if refused == 0 and not args.no_refusal_control:
        problems.append("A refused no call: the clients without health checks never met it")
    if t_down is None or unhealthy != 1:
        problems.append(f"A's health: NOT_SERVING at {t_down}, failing {unhealthy:g} times")
    if t_back is None:
        problems.append("A did not come back to SERVING")
    elif probes_ok < 1:
        problems.append("A came back without a probe's step succeeding")
    if t_back is not None and a_after < a_back + 3:
        problems.append(f"A completed {a_after - a_back:g} calls after it came back")
    if b_during == 0:
        problems.append("B completed nothing")
    if codes != [0, 0]:
        problems.append(f"exit codes {codes}")
    for p in problems:
        print("  PROBLEM", p)
    if args.no_refusal_control:
        caught = any("after A was seen NOT_SERVING failed" in p for p in problems)
        print("failing replica (control without probes and refusals):",
              "the check caught the calls A failed after it turned NOT_SERVING" if caught
              else "NOT CAUGHT")
        if caught:
            shutil.rmtree(work, ignore_errors=True)
        return 0 if caught else 1
    print("failing replica:", "ok" if not problems else f"FAILED (logs in {work})")
    if not problems:
        shutil.rmtree(work, ignore_errors=True)  # kept, with its logs, only when it failed
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
