#!/usr/bin/env python3
"""A short imagegen client in Python: list the models, stream one image, save it.

Stubs come from the proto with Debian's python3-grpc-tools (the build does this into
<build>/python; by hand:
    python3 -m grpc_tools.protoc -I proto --python_out OUT --grpc_python_out OUT \
        proto/imagegen/v1/imagegen.proto
then put OUT on PYTHONPATH). Runs with Debian's python3-grpcio.

    PYTHONPATH=build/release/python python3 client/python/example_client.py \
        --target 127.0.0.1:50051 --class-name sneaker --method scd-mc --out sneaker.png
    ... --model janus-pro-1b --prompt "a red bag on a table" --out bag.png   (text-to-image)
"""
import argparse
import sys

import grpc

from imagegen.v1 import imagegen_pb2, imagegen_pb2_grpc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--model", default="", help="default: the server's first model")
    ap.add_argument("--class-name", default="sneaker")
    ap.add_argument("--prompt", help="text-to-image models: the prompt (instead of a class)")
    ap.add_argument("--method", default="")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--token", help="bearer token, if the server wants one")
    ap.add_argument("--out", default="image.png")
    args = ap.parse_args()

    metadata = [("authorization", f"Bearer {args.token}")] if args.token else []
    with grpc.insecure_channel(args.target) as channel:
        stub = imagegen_pb2_grpc.ImageGenerationStub(channel)
        models = stub.ListModels(imagegen_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
        model = next((m for m in models.models if m.name == args.model), models.models[0])
        if model.prompted:
            print(f"model {model.name}: {model.grid}x{model.grid} tokens, text-to-image "
                  f"(prompts of at most {model.max_prompt_len} tokens)")
        else:
            print(f"model {model.name}: {model.grid}x{model.grid} tokens, "
                  f"classes {', '.join(c.name for c in model.classes)}")

        request = imagegen_pb2.GenerateRequest(model=model.name, method=args.method)
        if args.prompt is not None or model.prompted:
            request.prompt = args.prompt or "a dark ankle boot"
        else:
            request.class_name = args.class_name
        if args.seed is not None:
            request.seed = args.seed
        grid = [None] * (model.grid * model.grid)
        final = None
        for message in stub.GenerateStream(request, metadata=metadata, timeout=120):
            if message.HasField("step"):
                step = message.step
                for position, token in zip(step.positions, step.tokens):
                    grid[position] = token
                print(f"step {step.step:3d}: {step.committed:3d}/{step.total} tokens, "
                      f"NFE {step.nfe}")
            else:
                final = message.final
        if final is None:
            sys.exit("stream ended without an image")
        if list(final.tokens) != grid:
            sys.exit("the streamed tokens do not reassemble into the final grid")
        with open(args.out, "wb") as f:
            f.write(final.image_png)
        s = final.stats
        print(f"seed {s.seed}, method {s.method}: NFE {s.nfe}, step compression "
              f"{s.step_compression:.2f}x, acceptance {s.acceptance_rate:.2f} -> {args.out}")


if __name__ == "__main__":
    main()
