"""Writes reference inputs and outputs of the Python models (tools/imagegen_ref.py) for the C++
parity tests (tests/parity_test.cc):

  gpt_bundled.safetensors   the bundled target GPT: labels, prefixes, logits of a full forward
  gptb-random/              a randomly initialised GPT with GPT-B's shape and LlamaGen names
  gptb_random.safetensors   its reference logits
  vq_bundled.safetensors    the bundled VQ decoder: ids -> image
  vq16-random/ + vq16_random.safetensors   a random VQ with the official VQ-16 layout

usage: parity.py --out DIR [--models models/]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from imagegen_ref import GPT, GPTConfig, VQConfig, VQModel, gpt_from_dir, vq_from_dir  # noqa
from safetensors.torch import save_file
import convert_llamagen  # noqa: E402


def randomise(model: torch.nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g) if p.dim() > 1 else
                        0.05 * torch.randn(p.shape, generator=g))


def gpt_reference(model: GPT, seed: int, prefix_len: int):
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([1 % cfg.num_classes, cfg.num_classes])  # a class and the null class
    prefix = torch.randint(0, cfg.vocab_size, (2, prefix_len), generator=g)
    with torch.no_grad():
        logits = model.forward_sequence(labels, prefix)
    return {"labels": labels, "prefix": prefix, "logits": logits.contiguous()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "models"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(2)

    bundled = gpt_from_dir(os.path.join(args.models, "fmnist-gpt"))
    save_file(gpt_reference(bundled, 1, bundled.cfg.block_size - 1),
              os.path.join(args.out, "gpt_bundled.safetensors"))

    cfg_b = GPTConfig(dim=768, n_layer=12, n_head=12, vocab_size=16384, num_classes=1000,
                      block_size=256)
    gpt_b = GPT(cfg_b).eval()
    randomise(gpt_b, 2)
    # Saved the way LlamaGen's DDP training saves (weights under "model", with a stale
    # freqs_cis), then converted with tools/convert_llamagen.py: the C++ side loads the result.
    sd = dict(gpt_b.state_dict())
    sd["freqs_cis"] = torch.zeros(3)
    torch.save({"model": sd, "steps": 0}, os.path.join(args.out, "c2i_B_256.pt"))
    convert_llamagen.main(["gpt", os.path.join(args.out, "c2i_B_256.pt"),
                           os.path.join(args.out, "gptb-random"), "--preset", "GPT-B",
                           "--image-size", "256"])
    os.remove(os.path.join(args.out, "c2i_B_256.pt"))
    # A converted model is readable by a daemon running as another user (save_file writes 0600).
    umask = os.umask(0)
    os.umask(umask)
    mode = os.stat(os.path.join(args.out, "gptb-random", "model.safetensors")).st_mode & 0o777
    if mode != 0o666 & ~umask:
        raise SystemExit(f"convert_llamagen wrote mode {mode:o}, expected {0o666 & ~umask:o}")
    save_file(gpt_reference(gpt_b, 3, 24), os.path.join(args.out, "gptb_random.safetensors"))
    del gpt_b

    vq = vq_from_dir(os.path.join(args.models, "fmnist-vq"))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, vq.cfg.codebook_size, (3, vq.cfg.grid ** 2), generator=g)
    with torch.no_grad():
        img = vq.decode_code(ids)
    save_file({"ids": ids, "image": img.contiguous()}, os.path.join(args.out, "vq_bundled.safetensors"))

    # The official VQ-16 layout (ch 128, ch_mult 1,1,2,2,4, z 256, 32 groups) at a 4x4 grid.
    cfg16 = VQConfig(image_size=64)
    vq16 = VQModel(cfg16).eval()
    randomise(vq16, 5)
    sd = dict(vq16.state_dict())
    sd["quantize.codebook_used"] = torch.zeros(65536)
    torch.save({"model": sd}, os.path.join(args.out, "vq_ds16_c2i.pt"))
    convert_llamagen.main(["vq", os.path.join(args.out, "vq_ds16_c2i.pt"),
                           os.path.join(args.out, "vq16-random"), "--image-size", "64"])
    os.remove(os.path.join(args.out, "vq_ds16_c2i.pt"))
    ids = torch.randint(0, cfg16.codebook_size, (2, cfg16.grid ** 2), generator=g)
    with torch.no_grad():
        img = vq16.decode_code(ids)
    save_file({"ids": ids, "image": img.contiguous()}, os.path.join(args.out, "vq16_random.safetensors"))
    print("parity references written to", args.out)


if __name__ == "__main__":
    main()
