#!/usr/bin/env python3
"""Probes an imagegen-server binary for the defects of issue 12, one line per probe with what
happened. Run it against two builds to compare them (before/after a change):

    PYTHONPATH=build/ci/python python3 tools/hostile_probe.py --server build/ci/server/imagegen-server

Every probe starts its own daemon on loopback ports (the bundled models). The probes:
  reuseport   a second daemon on the same gRPC port: refused, or also "ready"?
  slowloris   500 silent sockets on the metrics port, then 3 scrapes (5 s timeout each)
  long-echo   class_name of 3,000 characters: INVALID_ARGUMENT, or another code?
  garbage     a body that is not a GenerateRequest: its code and message
  class-id    classes renamed "9".."0": which class does class_id 7 draw?
  defaults    sampling_defaults.temperature -5 in config.json: does the daemon start?
  help        does --help list the flags (--max_queue)?
  drain       a stream whose client stopped reading, SIGTERM with --grace-seconds 2:
              seconds from the signal to the exit
  threads     --max-threads 8 and 32 concurrent streams (AR, so that they overlap): how many
              end OK, and with which codes the others end
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc

from imagegen.v1 import imagegen_pb2, imagegen_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")


class Daemon:
    def __init__(self, server, flags=(), models=MODELS, listen="127.0.0.1:0"):
        self.dir = tempfile.mkdtemp(prefix="imagegen-probe-")
        self.log = open(os.path.join(self.dir, "server.log"), "w")
        ports = os.path.join(self.dir, "ports")
        self.proc = subprocess.Popen(
            [server, "--listen", listen, "--metrics-listen", "127.0.0.1:0", "--port-file", ports,
             "--models-dir", models, *flags], stdout=self.log, stderr=subprocess.STDOUT)
        self.port = self.mport = 0
        for _ in range(600):
            if os.path.exists(ports) and open(ports).read().strip():
                self.port, self.mport = map(int, open(ports).read().split()[:2])
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)

    def ready(self, limit=60):
        if not self.port:
            return False
        end = time.time() + limit
        ch = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        stub = imagegen_pb2_grpc.ImageGenerationStub(ch)
        while time.time() < end:
            try:
                stub.ListModels(imagegen_pb2.ListModelsRequest(), timeout=2)
                return True
            except grpc.RpcError:
                if self.proc.poll() is not None:
                    return False
                time.sleep(0.1)
        return False

    def stub(self, options=()):
        return imagegen_pb2_grpc.ImageGenerationStub(
            grpc.insecure_channel(f"127.0.0.1:{self.port}", options=list(options)))

    def output(self):
        self.log.flush()
        return open(os.path.join(self.dir, "server.log")).read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def code_of(fn):
    try:
        fn()
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


def probe_reuseport(server):
    a = Daemon(server)
    a.ready()
    b = Daemon(server, listen=f"127.0.0.1:{a.port}")
    time.sleep(1)
    alive = b.proc.poll() is None
    verdict = "second daemon also running (shares the port)" if alive else \
        f"second daemon refused (exit {b.proc.returncode})"
    a.stop()
    b.stop()
    return verdict


def probe_slowloris(server):
    d = Daemon(server)
    d.ready()
    socks = []
    for _ in range(500):
        try:  # a server with a short listen backlog leaves some connects hanging
            s = socket.create_connection(("127.0.0.1", d.mport), timeout=1)
            s.sendall(b"GET /metr")
            socks.append(s)
        except OSError:
            pass
    ok = 0
    for _ in range(3):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{d.mport}/metrics", timeout=5).read()
            ok += 1
        except Exception:  # noqa: BLE001 - a timeout is the finding
            pass
    for s in socks:
        s.close()
    d.stop()
    return f"{ok} of 3 scrapes answered within 5 s beside {len(socks)} silent sockets"


def probe_long_echo(server):
    d = Daemon(server)
    d.ready()
    code, msg = code_of(lambda: d.stub().Generate(
        imagegen_pb2.GenerateRequest(class_name="x" * 3000, seed=1), timeout=30))
    d.stop()
    return f"{code}, message {len(msg)} characters: {msg[:90]!r}"


def probe_garbage(server):
    d = Daemon(server)
    d.ready()
    ch = grpc.insecure_channel(f"127.0.0.1:{d.port}")
    call = ch.unary_unary("/imagegen.v1.ImageGeneration/Generate",
                          request_serializer=None, response_deserializer=None)
    code, msg = code_of(lambda: call(b"\xff\xff\xff\xff", timeout=30))
    d.stop()
    return f"{code}: {msg[:90]!r}"


def model_copy(edit):
    root = tempfile.mkdtemp(prefix="imagegen-probe-models-")
    for m in ("fmnist-vq", "fmnist-draft"):
        os.symlink(os.path.join(MODELS, m), os.path.join(root, m))
    os.mkdir(os.path.join(root, "fmnist-gpt"))
    os.symlink(os.path.join(MODELS, "fmnist-gpt", "model.safetensors"),
               os.path.join(root, "fmnist-gpt", "model.safetensors"))
    cfg = json.load(open(os.path.join(MODELS, "fmnist-gpt", "config.json")))
    edit(cfg)
    json.dump(cfg, open(os.path.join(root, "fmnist-gpt", "config.json"), "w"))
    return root


def probe_class_id(server):
    root = model_copy(lambda c: c.update(class_names=[str(9 - i) for i in range(10)]))
    d = Daemon(server, models=root)
    d.ready()
    r = d.stub().Generate(imagegen_pb2.GenerateRequest(class_id=7, seed=1, method="ar"),
                          timeout=120)
    d.stop()
    shutil.rmtree(root)
    return f"class_id 7 drew class {r.stats.class_id}"


def probe_defaults(server):
    root = model_copy(lambda c: c["sampling_defaults"].update(temperature=-5))
    d = Daemon(server, models=root)
    ready = d.ready(limit=20)
    if ready:
        code, msg = code_of(lambda: d.stub().Generate(
            imagegen_pb2.GenerateRequest(class_id=1, seed=1), timeout=30))
        verdict = f"daemon started; a default request: {code} {msg[:70]!r}"
    else:
        lines = [x for x in d.output().splitlines() if "temperature" in x]
        verdict = f"daemon refused to start: {lines[-1][:120] if lines else d.output()[-120:]!r}"
    d.stop()
    shutil.rmtree(root)
    return verdict


def probe_help(server):
    out = subprocess.run([server, "--help"], capture_output=True, text=True).stdout
    return f"--max_queue {'listed' if '--max_queue' in out else 'not listed'} by --help"


def probe_drain(server):
    d = Daemon(server, flags=["--grace-seconds", "2"])
    d.ready()
    stub = d.stub([("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)])
    req = imagegen_pb2.GenerateRequest(class_id=1, seed=1, method="ar", preview_every=1)
    req.output.scale = 16
    it = stub.GenerateStream(req)  # never read
    time.sleep(5)
    t0 = time.time()
    d.proc.terminate()
    d.proc.wait(timeout=60)
    took = time.time() - t0
    it.cancel()
    d.stop()
    return f"exit {d.proc.returncode} {took:.1f} s after SIGTERM (grace 2 s)"


def probe_threads(server):
    d = Daemon(server, flags=["--max-threads", "8"])
    d.ready()
    codes = {}
    lock = threading.Lock()

    def one(i):
        stub = d.stub()

        def run():
            for _ in stub.GenerateStream(
                    imagegen_pb2.GenerateRequest(class_id=i % 10, seed=i, method="ar"),
                    timeout=600):
                pass

        code, msg = code_of(run)
        with lock:
            key = code if code == "OK" else f"{code} '{msg[:40]}'"
            codes[key] = codes.get(key, 0) + 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d.stop()
    return "32 streams with --max-threads 8: " + ", ".join(f"{k} {v}" for k, v in codes.items())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    probes = {"reuseport": probe_reuseport, "slowloris": probe_slowloris,
              "long-echo": probe_long_echo, "garbage": probe_garbage,
              "class-id": probe_class_id, "defaults": probe_defaults, "help": probe_help,
              "drain": probe_drain, "threads": probe_threads}
    for name, fn in probes.items():
        if args.only and name not in args.only.split(","):
            continue
        try:
            print(f"{name:10s} {fn(args.server)}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:10s} probe failed: {e!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
