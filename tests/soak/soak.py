#!/usr/bin/env python3
"""Soak: the daemon on loopback under many concurrent clients that misbehave in every way a
client can, for a while; then checks that nothing leaked.

    PYTHONPATH=build/ci/python python3 tests/soak/soak.py --server build/ci/server/imagegen-server \\
        --streams 64 --seconds 600            # the long form (about 11 minutes)
    ... --streams 16 --seconds 60             # the short form (CI)
    ... --leak-control                        # the negative control: must report the leak
    ... --tls                                 # over TLS, the certificate rotated (ctest's form)

Each of --streams client threads loops over scenarios drawn with a fixed seed: a stream read to
the end, a unary call, a stream with previews (every 1-10 steps, scale 1-16), a stream
cancelled after a few messages, a call with a deadline of 1 ms to 2 s, a slow reader (50-200 ms
per message), a stream whose client stops reading (a 1 KiB HTTP/2 window, never read: the
daemon ends it after --stream-stall-seconds), and, from one more thread, clients in a child
process killed with SIGKILL mid-stream. With --http (the default) the threads also drive the
OpenAI-shaped HTTP API (--http-listen) the same ways: a request read to the end (n of 1-2), a
server-sent-event stream read to its completed events (partial images, per-step events), a
parameter the API refuses (a 400 that must name it), a client that hangs up after 0-5 events
or right after sending, a slow reader, and a reader that stalls (a 2 KiB receive buffer, not
read for longer than the API's 30 s idle limit, then read to the end: on the bundled models a
stream's 50-200 KB fit in the daemon's socket send buffer, which the kernel grows up to 4 MB
(`ss` showed 186 KB queued there, the daemon's side closed), so it ends OK; the idle limit
itself, a write blocked for 30 s, is not reached). Every outcome a scenario may legitimately
have is listed; any other is an unintended error.

Sampled every 5 s: the daemon's RSS, open file descriptors and threads (/proc), KV slots in
use, and the calls opened and closed (imagegen_calls_*_total). Passes when: no unintended
error; after the load, slots 0 and calls opened == closed within 60 s; RSS at the end at most
50 MB above RSS after the warm-up (the first fifth of the run); file descriptors and threads at
the end at most 16 above the warm-up's; and no client wedged the engine: the daemon, run with
--engine-stall-seconds (10 here), never declared it unhealthy (imagegen_engine_unhealthy_total 0:
no stall, no run of failed steps), and
the longest wait its threads' work saw (imagegen_engine_stalled_seconds, sampled) is printed.

--leak-control adds clients that stop reading and never cancel while the daemon's stall limit
is off (an hour): their calls stay open, so the check must fail. The script then exits 0 only
if the check caught it.

--tls serves both ports over TLS (a test CA made with openssl; every client trusts it) and
rotates the certificate under the load (server/tls.h): every 1-3 s another certificate of that
CA replaces the files (the key first, then the certificate, each by a rename, so the daemon may
see a pair that does not match for a moment), and one change in five is a broken pair (one
certificate's key beside another's certificate) left for 2-3 s before it is fixed. A handshake
that fails is an unintended error (UNAVAILABLE, an SSL error); the verdict also wants the
daemon to have served rotations (imagegen_tls_certificate_reloads_total{outcome="ok"}) and
refused the broken pairs (outcome="error").
"""
import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc

from imagegen.v1 import imagegen_pb2, imagegen_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C = grpc.StatusCode

# Outcomes each scenario may legitimately end with (a status code name).
ALLOWED = {
    "stream": {"OK"},
    "unary": {"OK"},
    "previews": {"OK"},
    "cancel": {"CANCELLED", "OK"},
    "deadline": {"DEADLINE_EXCEEDED", "OK"},
    "slow": {"OK"},
    # Ended by the daemon at the stall limit (the client sees CANCELLED, the daemon counts
    # ABORTED); or OK (once in 173 at 64 clients, 2026-11-29): the stream ended before a write
    # waited out the limit, likely because under load the preview share sent it few previews,
    # which then fitted in the window and buffers. A daemon that enforced no limit would make
    # every one OK: the verdict requires that at most a tenth (+1) are.
    "stalled": {"ABORTED", "CANCELLED", "OK"},
    "killed": {"KILLED", "OK"},
    # The HTTP API: the status line (a stream's OK needs every image's completed event).
    "http": {"OK"},
    "http-stream": {"OK"},
    "http-bad": {"400 names it"},
    "http-hangup": {"HANGUP"},
    "http-slow": {"OK"},
    # Not read for longer than the idle limit: a stream the socket buffers could not hold would
    # be cut there (CUT); one that fitted in them ends OK.
    "http-stalled": {"CUT", "OK"},
}
HTTP_IDLE_SECONDS = 30  # HttpApi::kIdleTimeoutSeconds

KILLED_CHILD = r"""
import sys, grpc
from imagegen.v1 import imagegen_pb2, imagegen_pb2_grpc
if len(sys.argv) > 4:
    ca = open(sys.argv[4], "rb").read()
    ch = grpc.secure_channel(sys.argv[1], grpc.ssl_channel_credentials(root_certificates=ca))
else:
    ch = grpc.insecure_channel(sys.argv[1])
stub = imagegen_pb2_grpc.ImageGenerationStub(ch)
req = imagegen_pb2.GenerateRequest(class_id=int(sys.argv[2]), seed=int(sys.argv[3]),
                                   method="sjd", preview_every=2)
for m in stub.GenerateStream(req):
    print("step", flush=True)
"""


def make_pki(d):
    """A CA and three server certificates for 127.0.0.1 it signed (0, 1, 2), in `d`."""
    subprocess.run([os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                 "make_test_pki.sh"), d, "0", "1", "2"], check=True)


def metrics(mport):
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def proc_sample(pid):
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024.0
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds, threads


class Soak:
    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="imagegen-soak-")
        stall = "3600" if args.leak_control else str(args.stream_stall_seconds)
        ports = os.path.join(self.dir, "ports")
        self.ca = None
        tls_flags = []
        if args.tls:
            self.pki = os.path.join(self.dir, "pki")
            make_pki(self.pki)
            self.ca = os.path.join(self.pki, "ca.pem")
            self.live = os.path.join(self.dir, "live")
            os.makedirs(self.live)
            self.install(0, 0)
            tls_flags = ["--tls-cert", os.path.join(self.live, "cert.pem"), "--tls-key",
                         os.path.join(self.live, "key.pem"), "--tls-poll-seconds", "1"]
            self.ssl = ssl.create_default_context(cafile=self.ca)
            self.creds = grpc.ssl_channel_credentials(root_certificates=open(self.ca, "rb").read())
        self.rotations = {"good": 0, "broken": 0}
        self.log = open(os.path.join(self.dir, "server.log"), "w")
        self.server = subprocess.Popen(
            [args.server, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             "--port-file", ports, "--max-slots", str(2 * args.streams + 16), "--max-queue",
             str(4 * args.streams), "--stream-stall-seconds", stall,
             "--engine-stall-seconds", str(args.engine_stall_seconds)]
            + (["--http-listen", "127.0.0.1:0"] if args.http else []) + tls_flags,
            stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(1200):
            if os.path.exists(ports) and open(ports).read().strip():
                break
            time.sleep(0.05)
        numbers = list(map(int, open(ports).read().split()))
        self.port, self.mport = numbers[:2]
        self.hport = numbers[2] if args.http else 0
        self.target = f"127.0.0.1:{self.port}"
        self.channel = self.new_channel()
        self.stub = imagegen_pb2_grpc.ImageGenerationStub(self.channel)
        end = time.time() + 300
        while True:
            try:
                self.stub.ListModels(imagegen_pb2.ListModelsRequest(), timeout=5)
                break
            except grpc.RpcError:
                if time.time() > end or self.server.poll() is not None:
                    raise RuntimeError("the daemon did not become ready: " + self.dir)
                time.sleep(0.2)
        self.classes = []
        if args.http:
            status, body = self.http("GET", "/v1/models")
            models = {m["id"]: m for m in json.loads(body)["data"]}
            self.classes = models["fmnist-gpt"]["imagegen"]["classes"]
        self.lock = threading.Lock()
        self.outcomes = {}  # (scenario, code) -> count
        self.unintended = []
        self.samples = []  # (t, rss MB, fds, threads, slots, opened, closed, waited s, stalls)
        self.stop = threading.Event()
        self.held = []  # leak-control calls, kept open to the end

    def new_channel(self, options=None):
        if self.ca:
            return grpc.secure_channel(self.target, self.creds, options=options)
        return grpc.insecure_channel(self.target, options=options)

    def install(self, cert, key):
        """Certificate `cert`'s file and key `key`'s in the live files, each by a rename."""
        for name, src in (("key.pem", f"{key}.key"), ("cert.pem", f"{cert}.pem")):
            tmp = os.path.join(self.live, name + ".new")
            shutil.copyfile(os.path.join(self.pki, src), tmp)
            os.replace(tmp, os.path.join(self.live, name))

    def rotator(self):
        rng = random.Random(7)
        current = 0
        while not self.stop.wait(rng.uniform(1, 3)):
            if rng.random() < 0.2:
                self.install(current, (current + 1) % 3)  # a key of another certificate
                self.rotations["broken"] += 1
                if self.stop.wait(rng.uniform(2, 3)):
                    break
                self.install(current, current)
            else:
                current = (current + 1) % 3
                self.install(current, current)
                self.rotations["good"] += 1

    def record(self, scenario, code, detail=""):
        with self.lock:
            self.outcomes[(scenario, code)] = self.outcomes.get((scenario, code), 0) + 1
            if code not in ALLOWED[scenario] and len(self.unintended) < 20:
                self.unintended.append(f"{scenario}: {code} {detail[:120]}")
            elif code not in ALLOWED[scenario]:
                self.unintended.append("...")

    def request(self, rng, **kw):
        r = imagegen_pb2.GenerateRequest(class_id=rng.randrange(10), seed=rng.randrange(1 << 30),
                                         method=rng.choice(["ar", "sjd", "scd-mc", "sjd-pac"]))
        for k, v in kw.items():
            setattr(r, k, v)
        return r

    def one(self, rng):
        kind = rng.choices(["stream", "unary", "previews", "cancel", "deadline", "slow",
                            "stalled"], weights=[3, 3, 2, 2, 2, 1, 1])[0]
        if kind == "stalled" and self.args.leak_control:
            kind = "stream"  # the stall limit is off: such a client would wait for an hour
        try:
            if kind == "stream":
                for _ in self.stub.GenerateStream(self.request(rng), timeout=600):
                    pass
            elif kind == "unary":
                self.stub.Generate(self.request(rng), timeout=600)
            elif kind == "previews":
                r = self.request(rng, preview_every=rng.randint(1, 10))
                r.output.scale = rng.randint(1, 16)
                for _ in self.stub.GenerateStream(r, timeout=600):
                    pass
            elif kind == "cancel":
                call = self.stub.GenerateStream(self.request(rng), timeout=600)
                n = rng.randint(1, 30)
                for i, _ in enumerate(call):
                    if i + 1 >= n:
                        call.cancel()
                        break
                try:
                    for _ in call:
                        pass
                except grpc.RpcError as e:
                    if e.code() != C.CANCELLED:
                        raise
                    self.record(kind, "CANCELLED")
                    return
            elif kind == "deadline":
                self.stub.Generate(self.request(rng), timeout=rng.uniform(0.001, 2.0))
            elif kind == "slow":
                for _ in self.stub.GenerateStream(self.request(rng), timeout=600):
                    time.sleep(rng.uniform(0.05, 0.2))
            elif kind == "stalled":
                opts = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
                with self.new_channel(opts) as ch:
                    stub = imagegen_pb2_grpc.ImageGenerationStub(ch)
                    r = self.request(rng, preview_every=1)
                    r.output.scale = 16
                    call = stub.GenerateStream(r, timeout=600)
                    # Never read; wait for the daemon to end the call, then read what came. The
                    # client may see the call active until it reads (gRPC Python keeps it so
                    # while unread messages are buffered): after the stall limit and 15 s more,
                    # the read tells (a call the daemon did not end would block to its 600 s
                    # timeout and count as an unintended DEADLINE_EXCEEDED).
                    end = time.time() + self.args.stream_stall_seconds + 15
                    while call.is_active() and time.time() < end:
                        time.sleep(0.5)
                    try:
                        for _ in call:
                            pass
                    except grpc.RpcError as e:
                        self.record(kind, e.code().name, e.details() or "")
                        return
                    self.record(kind, "OK")
                    return
            self.record(kind, "OK")
        except grpc.RpcError as e:
            self.record(kind, e.code().name, e.details() or "")

    def http(self, verb, path, body=None, timeout=600):
        """One HTTP request on a connection of its own: (status, body as text)."""
        c = self.http_connection(timeout)
        try:
            c.request(verb, path, body=None if body is None else json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()

    def http_connection(self, timeout=600):
        if self.ca:
            return http.client.HTTPSConnection("127.0.0.1", self.hport, timeout=timeout,
                                               context=self.ssl)
        return http.client.HTTPConnection("127.0.0.1", self.hport, timeout=timeout)

    def http_body(self, rng, **kw):
        b = {"model": "fmnist-gpt", "prompt": rng.choice(self.classes),
             "seed": rng.randrange(1 << 30),
             "method": rng.choice(["ar", "sjd", "scd-mc", "sjd-pac"])}
        b.update(kw)
        return b

    def raw_post(self, body, rcvbuf=0):
        """A socket that has sent a POST of `body` (its receive buffer set first when rcvbuf)."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(600)
        s.connect(("127.0.0.1", self.hport))
        if self.ca:
            s = self.ssl.wrap_socket(s, server_hostname="127.0.0.1")
        data = json.dumps(body).encode()
        s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: soak\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
        return s

    def sse_events(self, body, pause=None):
        """The event names of a stream read to its end (sleeping `pause()` s after each)."""
        c = self.http_connection()
        try:
            c.request("POST", "/v1/images/generations", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                return r.status, []
            names = []
            for line in r:
                if line.startswith(b"event: "):
                    names.append(line[7:].strip().decode())
                    if pause:
                        time.sleep(pause())
            return 200, names
        finally:
            c.close()

    def one_http(self, rng):
        kind = rng.choices(["http", "http-stream", "http-bad", "http-hangup", "http-slow",
                            "http-stalled"], weights=[3, 3, 1, 3, 1, 1])[0]
        try:
            self.http_scenario(kind, rng)
        except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
            # A refused or dropped connection, a timeout, a body that is not the API's JSON.
            self.record(kind, type(e).__name__, str(e))

    def http_scenario(self, kind, rng):
        if kind == "http":
            n = rng.randint(1, 2)
            status, text = self.http("POST", "/v1/images/generations", self.http_body(rng, n=n))
            ok = status == 200 and len(json.loads(text).get("data", [])) == n
            self.record(kind, "OK" if ok else str(status), text[:200])
        elif kind in ("http-stream", "http-slow"):
            n = rng.randint(1, 2)
            body = self.http_body(rng, n=n, stream=True, partial_images=rng.randint(0, 3),
                                  stream_steps=rng.random() < 0.5, size=rng.choice(
                                      ["28x28", "112x112", "448x448"]))
            pause = (lambda: rng.uniform(0.01, 0.05)) if kind == "http-slow" else None
            status, names = self.sse_events(body, pause)
            done = names.count("image_generation.completed")
            self.record(kind, "OK" if status == 200 and done == n else
                        f"{status}: {done} of {n} completed, last {names[-1:]}")
        elif kind == "http-bad":
            param, value = rng.choice([("top_p", 2.0), ("n", 0), ("size", "7x9"),
                                       ("response_format", "url"), ("temperature", -1),
                                       ("window", -3), ("prompt", "no such class")])
            status, text = self.http("POST", "/v1/images/generations",
                                     self.http_body(rng, **{param: value}))
            named = status == 400 and json.loads(text)["error"].get("param") == param
            self.record(kind, "400 names it" if named else f"{status} for {param}", text[:200])
        elif kind == "http-hangup":
            body = self.http_body(rng, n=rng.randint(1, 4), stream=rng.random() < 0.7,
                                  partial_images=rng.randint(0, 3), stream_steps=True)
            s = self.raw_post(body)
            try:
                want = rng.randint(0, 5) if body["stream"] else 0
                got = b""
                while got.count(b"\nevent: ") + got.startswith(b"event: ") < want:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    got += chunk
                if not want:
                    time.sleep(rng.uniform(0, 0.3))
            finally:
                s.close()
            self.record(kind, "HANGUP")
        elif kind == "http-stalled":
            body = self.http_body(rng, stream=True, partial_images=3, stream_steps=True,
                                  size="448x448")
            s = self.raw_post(body, rcvbuf=2048)
            try:
                self.stop.wait(HTTP_IDLE_SECONDS + 10)
                got = b""
                try:
                    while True:
                        chunk = s.recv(65536)
                        if not chunk:
                            break
                        got += chunk
                except ConnectionResetError:
                    pass
            finally:
                s.close()
            self.record(kind, "OK" if b"image_generation.completed" in got else "CUT")

    def worker(self, seed):
        rng = random.Random(seed)
        while not self.stop.is_set():
            if self.args.http and rng.random() < 0.5:
                self.one_http(rng)
            else:
                self.one(rng)

    def killer(self):
        rng = random.Random(99)
        env = dict(os.environ)
        while not self.stop.is_set():
            p = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, self.target,
                                  str(rng.randrange(10)), str(rng.randrange(1 << 30))]
                                 + ([self.ca] if self.ca else []),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            time.sleep(rng.uniform(0.5, 3.0))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                self.record("killed", "KILLED")
            else:
                self.record("killed", "OK" if p.returncode == 0 else f"exit {p.returncode}")
            p.wait()
            self.stop.wait(rng.uniform(1, 4))

    def leak(self):
        # Clients that stop reading and never cancel, on channels kept open to the end.
        opts = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        for i in range(4):
            ch = self.new_channel(opts)
            r = imagegen_pb2.GenerateRequest(class_id=i, seed=i, method="ar", preview_every=1)
            r.output.scale = 16
            self.held.append((ch, imagegen_pb2_grpc.ImageGenerationStub(ch).GenerateStream(r)))

    def sample(self):
        rss, fds, threads = proc_sample(self.server.pid)
        m = metrics(self.mport)
        slots = m.get('imagegen_kv_cache_slots_in_use{model="fmnist-gpt"}', float("nan"))
        opened = m.get("imagegen_calls_opened_total", 0)
        closed = m.get("imagegen_calls_closed_total", 0)
        # The longest the engine's work has waited on one of its threads, and the stalls.
        waited = max(m.get('imagegen_engine_stalled_seconds{thread="engine"}', 0),
                     m.get('imagegen_engine_stalled_seconds{thread="decoder"}', 0))
        stalls = sum(m.get(f'imagegen_engine_unhealthy_total{{reason="{r}"}}', float("nan"))
                     for r in ("stalled", "failing"))
        self.samples.append((time.time(), rss, fds, threads, slots, opened, closed, waited,
                             stalls))
        return self.samples[-1]

    def run(self):
        a = self.args
        t0 = time.time()
        threads = [threading.Thread(target=self.worker, args=(1000 + i,), daemon=True)
                   for i in range(a.streams)]
        threads.append(threading.Thread(target=self.killer, daemon=True))
        if a.tls:
            threads.append(threading.Thread(target=self.rotator, daemon=True))
        for t in threads:
            t.start()
        if a.leak_control:
            self.leak()
        while time.time() - t0 < a.seconds:
            s = self.sample()
            print(f"t {s[0] - t0:6.0f} s  rss {s[1]:7.1f} MB  fds {s[2]:4d}  threads {s[3]:4d}  "
                  f"slots {s[4]:4.0f}  calls open {s[5] - s[6]:4.0f}  engine waited {s[7]:5.2f} s",
                  flush=True)
            time.sleep(5)
        self.stop.set()
        for t in threads:
            t.join(timeout=900)
        # Quiescence: slots back to 0 and every call closed. The leak control's held calls never
        # close, however long it waits: 20 s there (CI's time), 60 s for the soak itself.
        end = time.time() + (20 if a.leak_control else 60)
        while True:
            s = self.sample()
            if (s[4] == 0 and s[5] == s[6]) or time.time() > end:
                break
            time.sleep(0.5)
        return t0

    def verdict(self, t0):
        a = self.args
        warm_end = t0 + a.seconds / 5
        warm = [s for s in self.samples if s[0] <= warm_end][-1]
        last = self.samples[-1]
        growth = last[1] - warm[1]
        checks = [
            ("no unintended error", not self.unintended, f"{len(self.unintended)}"),
            ("KV slots back to 0", last[4] == 0, f"{last[4]:.0f}"),
            ("calls opened == closed", last[5] == last[6],
             f"{last[5]:.0f} opened, {last[6]:.0f} closed"),
            (f"RSS growth after warm-up < {a.max_rss_growth_mb:g} MB", growth < a.max_rss_growth_mb,
             f"{warm[1]:.1f} -> {last[1]:.1f} MB ({growth:+.1f})"),
            ("file descriptors flat", last[2] <= warm[2] + 16, f"{warm[2]} -> {last[2]}"),
            ("threads flat", last[3] <= warm[3] + 16, f"{warm[3]} -> {last[3]}"),
            (f"engine never unhealthy (--engine-stall-seconds {a.engine_stall_seconds:g})",
             last[8] == 0, f"{last[8]:.0f} times; longest wait sampled "
             f"{max(s[7] for s in self.samples):.2f} s"),
        ]
        if a.tls:
            # Each good change lasts 1-3 s and each broken pair 2-3 s, against the daemon's 1-s
            # poll: it sees most changes (two within one poll count as one), and every broken
            # pair at least once (and a good change's key beside the old certificate, sometimes).
            m = metrics(self.mport)
            served = m.get('imagegen_tls_certificate_reloads_total{outcome="ok"}', 0)
            refused = m.get('imagegen_tls_certificate_reloads_total{outcome="error"}', 0)
            good, broken = self.rotations["good"], self.rotations["broken"]
            checks.append(("TLS rotations served (at least half of the changes)",
                           served >= 0.5 * good and good > 0,
                           f"{served:.0f} served for {good} changes"))
            checks.append(("TLS broken pairs refused", refused >= broken and broken > 0,
                           f"{refused:.0f} refusals (polls) for {broken} broken pairs"))
        stalled = sum(n for (kind, _), n in self.outcomes.items() if kind == "stalled")
        stalled_ok = self.outcomes.get(("stalled", "OK"), 0)
        checks.append(("stalled streams ended by the daemon (at most a tenth + 1 complete)",
                       stalled_ok <= 0.1 * stalled + 1, f"{stalled - stalled_ok} of {stalled}"))
        total = sum(self.outcomes.values())
        print(f"\n{total} calls in {a.seconds:.0f} s with {a.streams} client threads; outcomes:")
        for (kind, code), n in sorted(self.outcomes.items()):
            print(f"  {kind:12s} {code:18s} {n}")
        for u in self.unintended:
            print(f"  unintended: {u}")
        ok = True
        for name, passed, detail in checks:
            print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
            ok &= passed
        return ok

    def close(self):
        for ch, call in self.held:
            call.cancel()
            ch.close()
        self.server.send_signal(signal.SIGTERM)
        try:
            self.server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.server.kill()
        self.channel.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--stream-stall-seconds", type=float, default=5)
    ap.add_argument("--engine-stall-seconds", type=float, default=10,
                    help="the daemon's stall limit; the verdict wants no stall at all")
    ap.add_argument("--leak-control", action="store_true")
    ap.add_argument("--http", action=argparse.BooleanOptionalAction, default=True,
                    help="half the clients' calls through the HTTP API (--http-listen)")
    ap.add_argument("--tls", action="store_true",
                    help="TLS on both ports, its certificate rotated under the load")
    ap.add_argument("--max-rss-growth-mb", type=float, default=50,
                    help="the RSS bound (tests/tsan.sh --soak widens it: TSan's own memory grows)")
    args = ap.parse_args()
    soak = Soak(args)
    try:
        ok = soak.verdict(soak.run())
    finally:
        soak.close()
    rc = (1 if ok else 0) if args.leak_control else (0 if ok else 1)
    if rc == 0:
        shutil.rmtree(soak.dir, ignore_errors=True)  # kept, with the log, only when it failed
    else:
        print(f"server log: {soak.dir}/server.log")
    if args.leak_control:
        print("leak control: the check " + ("MISSED the leak" if ok else "caught the leak"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
