#!/usr/bin/env python3
"""Writes a fake official Janus-Pro checkpoint directory (random weights, the official key names
and config.json, a VQ-16 decoder) for tools/convert_janus.py: the layout and sizes of a real
one without the download. Presets: small (the parity test's) and pro-1b (Janus-Pro-1B's
language model with its text head, gen_head and gen_aligner: 1.69 billion parameters, 3.4 GB in
bf16).

  tools/fake_janus.py --preset pro-1b --out DIR [--image-size 384] [--dtype bfloat16]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import janus_ref  # noqa: E402
from imagegen_ref import VQConfig, VQModel  # noqa: E402

PRESETS = {"small": janus_ref.SMALL, "pro-1b": janus_ref.PRO_1B}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--out", required=True)
    ap.add_argument("--image-size", type=int, default=384)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    vq = VQModel(VQConfig(image_size=args.image_size)).eval()
    c = dict(PRESETS[args.preset], image_size=args.image_size)
    sd = janus_ref.write_fake_checkpoint(args.out, c, args.seed, dict(vq.state_dict()),
                                         getattr(torch, args.dtype))
    n = sum(t.numel() for t in sd.values())
    print(f"{args.out}: {n / 1e9:.2f} billion parameters in the generation path and stand-ins, "
          f"plus the VQ")


if __name__ == "__main__":
    main()
