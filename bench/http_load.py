#!/usr/bin/env python3
"""Closed-loop load on the HTTP API (POST /v1/images/generations), the twin of `imagegen load`
for gRPC: --concurrency clients each send a request on their own keep-alive connection, wait
for the image and send the next, for --duration seconds; classes cycle through the model's
classes. Prints the same summary lines as `imagegen load` (images/s; latency p50/p90/p99/max).
Standard library only (http.client), so that the client's own cost is small and known.

  bench/http_load.py --url http://127.0.0.1:8000 --method scd-mc --concurrency 16 --duration 20
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--method", default="")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--duration", type=float, default=10)
    args = ap.parse_args()
    url = urllib.parse.urlparse(args.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())["data"]
    classes = models[0]["imagegen"]["classes"]
    conn.close()

    lock = threading.Lock()
    latencies, errors = [], {}
    counter = [0]
    t0 = time.monotonic()
    stop = t0 + args.duration

    def client():
        c = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        while time.monotonic() < stop:
            with lock:
                i = counter[0]
                counter[0] += 1
            body = json.dumps({"prompt": classes[i % len(classes)], "method": args.method,
                               "seed": i})
            s0 = time.monotonic()
            c.request("POST", "/v1/images/generations", body,
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            took = time.monotonic() - s0
            with lock:
                if r.status == 200 and json.loads(data)["data"]:
                    latencies.append(took)
                else:
                    errors[r.status] = errors.get(r.status, 0) + 1
        c.close()

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    latencies.sort()

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else 0

    print(f"{len(latencies)} images in {wall:.1f} s: {len(latencies) / wall:.2f} images/s")
    print(f"latency s: p50 {pct(0.5):.3f}  p90 {pct(0.9):.3f}  p99 {pct(0.99):.3f}  "
          f"max {pct(1.0):.3f}")
    if errors:
        print(f"errors: {errors}")


if __name__ == "__main__":
    main()
