#!/usr/bin/env python3
"""Opens N GenerateStream calls that ask for a preview every step and never read them (a
client that stopped reading), holds them for --seconds, then cancels them. For
bench/preview_isolation.sh. Needs the generated stubs on PYTHONPATH (<build>/python)."""
import argparse
import time

import grpc

from imagegen.v1 import imagegen_pb2, imagegen_pb2_grpc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--method", default="ar")
    args = ap.parse_args()
    # A small HTTP/2 window and no BDP probing: the server's writes block as soon as about
    # 1 KiB is unread, as they would for a client that stops reading.
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    channels, calls = [], []
    for i in range(args.streams):
        ch = grpc.insecure_channel(args.target, options=options)
        stub = imagegen_pb2_grpc.ImageGenerationStub(ch)
        req = imagegen_pb2.GenerateRequest(class_id=i % 10, seed=1000 + i, method=args.method,
                                           preview_every=1)
        req.output.scale = args.scale
        calls.append(stub.GenerateStream(req))  # an iterator, never advanced
        channels.append(ch)
    time.sleep(args.seconds)
    for c in calls:
        c.cancel()
    for ch in channels:
        ch.close()


if __name__ == "__main__":
    main()
