#!/usr/bin/env python3
"""A short imagegen client in Python: list the models, stream images, save them.

Stubs come from the proto with Debian's python3-grpc-tools (the build does this into
<build>/python; by hand:
    python3 -m grpc_tools.protoc -I proto --python_out OUT --grpc_python_out OUT \
        proto/imagegen/v1/imagegen.proto
then put OUT on PYTHONPATH). Runs with Debian's python3-grpcio.

    PYTHONPATH=build/release/python python3 client/python/example_client.py \
        --target 127.0.0.1:50051 --class-name sneaker --method scd-mc --out sneaker.png
    ... --model janus-pro-1b --prompt "a red bag on a table" --out bag.png   (text-to-image)
    ... --model fmnist-t2i --prompt "a bag" --negative-prompt "a dark bag" --n 4 --seed 1 \
        --out bag.png   (bag_0.png .. bag_3.png, seeds 1 .. 4)
    ... --tls-ca ca.pem [--tls-cert client.pem --tls-key client.key] [--token ...]
        (a daemon with --tls-cert; mutual TLS when it has --tls-client-ca)
"""
import argparse
import os
import sys

import grpc

from imagegen.v1 import imagegen_pb2, imagegen_pb2_grpc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--model", default="", help="default: the server's first model")
    ap.add_argument("--class-name", default="sneaker")
    ap.add_argument("--prompt", help="text-to-image models: the prompt (instead of a class)")
    ap.add_argument("--negative-prompt", default="",
                    help="text-to-image models: what the image should not be (needs guidance)")
    ap.add_argument("--method", default="")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--cfg-interval", type=int,
                    help="LlamaGen's cfg_interval: guide only image tokens 0..N+1")
    ap.add_argument("--n", type=int, default=1, help="images (seeds seed, seed + 1, ...)")
    ap.add_argument("--token", help="bearer token, if the server wants one")
    ap.add_argument("--tls-ca", help="PEM CA bundle that signed the server's certificate (TLS; "
                    "any --tls-* flag turns TLS on, and without this one the system's roots check "
                    "the server)")
    ap.add_argument("--tls-cert", help="PEM client certificate chain (mutual TLS)")
    ap.add_argument("--tls-key", help="PEM private key of --tls-cert")
    ap.add_argument("--tls-server-name", help="the name to check the server's certificate for "
                    "(default: the host of --target)")
    ap.add_argument("--out", default="image.png")
    args = ap.parse_args()

    try:
        run(args)
    except grpc.RpcError as e:  # the status, and the field a BadRequest names
        sys.exit(f"{e.code().name}: {e.details()}")


def channel_for(args):
    """A plaintext channel, or a TLS one when any --tls-* flag is given."""
    if not (args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name):
        return grpc.insecure_channel(args.target)
    if bool(args.tls_cert) != bool(args.tls_key):
        sys.exit("--tls-cert and --tls-key go together")

    def read(flag, path):
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            sys.exit(f"{flag}: {e}")

    creds = grpc.ssl_channel_credentials(root_certificates=read("--tls-ca", args.tls_ca),
                                         private_key=read("--tls-key", args.tls_key),
                                         certificate_chain=read("--tls-cert", args.tls_cert))
    options = ([("grpc.ssl_target_name_override", args.tls_server_name)]
               if args.tls_server_name else [])
    return grpc.secure_channel(args.target, creds, options=options)


def run(args):
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else []
    with channel_for(args) as channel:
        stub = imagegen_pb2_grpc.ImageGenerationStub(channel)
        models = stub.ListModels(imagegen_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
        names = [m.name for m in models.models]
        if args.model and args.model not in names:
            sys.exit(f"--model: the server serves no model {args.model!r} "
                     f"(it serves: {', '.join(names)})")
        model = models.models[names.index(args.model) if args.model else 0]
        if model.prompted:
            print(f"model {model.name}: {model.grid}x{model.grid} tokens, text-to-image "
                  f"(prompts of at most {model.max_prompt_len} tokens)")
        else:
            print(f"model {model.name}: {model.grid}x{model.grid} tokens, "
                  f"classes {', '.join(c.name for c in model.classes)}")

        request = imagegen_pb2.GenerateRequest(model=model.name, method=args.method, n=args.n,
                                               negative_prompt=args.negative_prompt)
        if args.prompt is not None or model.prompted:
            request.prompt = args.prompt or "a dark ankle boot"
        else:
            request.class_name = args.class_name
        if args.seed is not None:
            request.seed = args.seed
        if args.cfg_interval is not None:
            request.cfg_interval = args.cfg_interval
        # With n > 1 the images' messages interleave; each names its image's index.
        grids = [[None] * (model.grid * model.grid) for _ in range(max(args.n, 1))]
        finals = {}
        call = stub.GenerateStream(request, metadata=metadata, timeout=120)
        # The server's id for the call (its log line names it): the response's first header.
        request_id = dict(call.initial_metadata()).get("x-request-id", "")
        if request_id:
            print(f"request id {request_id}")
        for message in call:
            if message.HasField("step"):
                step = message.step
                # A continuous-token model (MAR) streams positions without token ids.
                for position, token in zip(step.positions, step.tokens):
                    grids[step.index][position] = token
                print(f"image {step.index} step {step.step:3d}: {step.committed:3d}/{step.total} "
                      f"tokens, NFE {step.nfe}")
            else:
                finals[message.final.index] = message.final
        if len(finals) != len(grids):
            sys.exit(f"the stream ended with {len(finals)} of {len(grids)} images")
        stem, ext = os.path.splitext(args.out)
        for index, final in sorted(finals.items()):
            if not model.continuous and list(final.tokens) != grids[index]:
                sys.exit(f"image {index}: the streamed tokens do not reassemble into its grid")
            out = args.out if len(grids) == 1 else f"{stem}_{index}{ext}"
            with open(out, "wb") as f:
                f.write(final.image_png)
            s = final.stats
            print(f"image {index}: seed {s.seed}, method {s.method}: NFE {s.nfe}, step "
                  f"compression {s.step_compression:.2f}x, acceptance {s.acceptance_rate:.2f}, "
                  f"prefill forwards {s.prefill_forwards} -> {out}")


if __name__ == "__main__":
    main()
