"""Convert an official LlamaGen checkpoint (.pt) into an imagegen model directory
(config.json + model.safetensors). Tensor names are kept as they are; only the container
changes (shared/docs/models.md 1.8 and 2).

  # class-conditional GPT, e.g. c2i_B_256.pt (DDP, weights under "model") or c2i_XXL_384.pt
  # (FSDP, bare state_dict):
  python tools/convert_llamagen.py gpt c2i_L_384.pt models/llamagen-l-384 \
      --preset GPT-L --image-size 384 --tokenizer llamagen-vq16
  # the VQ-16 tokenizer:
  python tools/convert_llamagen.py vq vq_ds16_c2i.pt models/llamagen-vq16 --image-size 384

The image size sets the GPT's block_size ((size/16)^2 tokens) and the VQ's output size.
"""
import argparse
import json
import os
import sys
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from imagegen_ref import GPTConfig, VQConfig  # noqa: E402

GPT_PRESETS = {  # LlamaGen autoregressive/models/gpt.py size presets
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
}

IMAGENET_NOTE = "ImageNet-1k class ids 0..999; 1000 is the null class"


def load_state_dict(path: str) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict):
        raise SystemExit(f"{path}: not a checkpoint dict")
    for key in ("model", "module", "state_dict"):
        if key in ckpt and isinstance(ckpt[key], dict):
            ckpt = ckpt[key]
            break
    bad = [k for k, v in ckpt.items() if not torch.is_tensor(v)]
    if bad:
        raise SystemExit(f"{path}: no 'model'/'module'/'state_dict' entry and non-tensor keys "
                         f"{bad[:5]}: not a LlamaGen checkpoint")
    return ckpt


def clean(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k.startswith("module."):
            k = k[len("module."):]
        if k == "freqs_cis" or ".kv_cache." in k or k == "quantize.codebook_used":
            continue
        out[k] = v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
    return out


def write(out_dir: str, config: dict, sd: dict):
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    path = os.path.join(out_dir, "model.safetensors")
    save_file(sd, path)
    # safetensors writes 0600; a daemon running as another user (the image's, a pod's) must read
    # it, so give it the mode open() would have given it under this process's umask.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    print(f"wrote {len(sd)} tensors to {out_dir}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("kind", choices=["gpt", "vq"])
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--preset", choices=sorted(GPT_PRESETS), default="GPT-B")
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--downsample", type=int, default=16)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--tokenizer", default="llamagen-vq16", help="VQ model directory name")
    ap.add_argument("--cfg-scale", type=float, default=4.0)
    ap.add_argument("--top-k", type=int, default=2000)
    args = ap.parse_args(argv)
    if args.image_size % args.downsample != 0:
        raise SystemExit("--image-size must be a multiple of --downsample")
    sd = clean(load_state_dict(args.checkpoint))
    grid = args.image_size // args.downsample
    if args.kind == "gpt":
        cfg = GPTConfig(**GPT_PRESETS[args.preset], vocab_size=args.vocab_size,
                        num_classes=args.num_classes, block_size=grid * grid)
        config = {"type": "llamagen-gpt", **asdict(cfg), "tokenizer": args.tokenizer,
                  "sampling_defaults": {"cfg_scale": args.cfg_scale, "temperature": 1.0,
                                        "top_k": args.top_k, "top_p": 1.0},
                  "converted_from": os.path.basename(args.checkpoint), "classes": IMAGENET_NOTE}
        del config["ffn_dim_multiplier"]
    else:
        cfg = VQConfig(image_size=args.image_size)
        config = {"type": "llamagen-vq", **asdict(cfg),
                  "converted_from": os.path.basename(args.checkpoint)}
    write(args.out_dir, config, sd)


if __name__ == "__main__":
    main()
