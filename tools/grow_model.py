"""Write a larger twin of a LlamaGen c2i model: the same image distribution at the cost of a
bigger model, to measure on a CPU what speculation does for a model of that size.

The speed of speculative decoding depends on two things: how many tokens a window commits (the
model's distribution) and how a step's time grows with the tokens in it (the model's size and
the device). The bundled model is small (11 MB of fp32 weights, held in the CPU's caches), so on
a CPU a step of 16 tokens costs several times a step of one; a GPT-B-sized model's step reads
390 MB of weights whatever its tokens, and one of 8 tokens costs 1.4-1.5x one of 1 (on the dev
VM: docs/results-serving.md, "The model's size"). No trained model of that size fits
this repository, and random weights draw no images, so the twin keeps the source's weights and
adds only zeros, which change no logit by more than rounding:

- --ffn-multiplier F widens every feed-forward block to LlamaGen's hidden size with
  ffn_dim_multiplier F: w1 and w3 get zero rows, w2 zero columns. The new hidden units are
  silu(0) * 0 = 0 and meet zero columns of w2, so each output is the same sum plus exact zeros;
  only the BLAS's blocking of the longer sum (another order of the same real terms) can move a
  logit by a few units in the last place.
- --extra-layers N appends N blocks whose projections are all zero: attention's queries, keys
  and values are 0, its output projection 0, the feed-forward 0, so each adds exactly 0 to the
  residual stream (x + 0 = x). They read their weights and attend over their own KV cache as a
  deeper model's layers do.

The twin's forward does the work of a model of its size (the same bytes of weights read, the same
multiply-adds in its linear layers, attention in every layer); its tokens are the source's, but
for the rare draw whose uniform lands within rounding of a boundary. It is a benchmark model, not
a model to serve: its config says what it is ("twin_of").

  /opt/imagegen/venv/bin/python tools/grow_model.py models/fmnist-gpt /tmp/twins/fmnist-gpt-b \
      --ffn-multiplier 4 --extra-layers 67     # 388 MB, GPT-B's weight bytes
  /opt/imagegen/venv/bin/python tools/grow_model.py models/fmnist-gpt /tmp/twins/fmnist-gpt-l \
      --ffn-multiplier 55 --extra-layers 14    # 1.3 GB, GPT-L's

(A GPT-B-sized twin from --ffn-multiplier 55 alone, 6 blocks of 28,160 hidden units, is
possible too, but its feed-forward's weight panels outgrow a core's L2 in the few-row kernel
and its steps grow with their tokens far faster than GPT-B's.)

The output directory must sit in a models directory that also holds the source's tokenizer (and
draft model, for sd), which the config names; bench/model_size_twins.sh links them.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file


def ffn_hidden(dim, multiple_of, multiplier):
    """LlamaGen's FeedForward hidden size (engine: GptConfig::ffn_hidden)."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier > 0:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="model directory (config.json, model.safetensors)")
    ap.add_argument("out", help="output model directory (created)")
    ap.add_argument("--ffn-multiplier", type=float, default=0,
                    help="LlamaGen's ffn_dim_multiplier for the twin (0: the source's width)")
    ap.add_argument("--extra-layers", type=int, default=0, help="zero blocks appended")
    args = ap.parse_args()
    with open(os.path.join(args.src, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("type") != "llamagen-gpt":
        sys.exit(f"{args.src}: type {cfg.get('type')!r}, not llamagen-gpt")
    if args.extra_layers < 0 or args.ffn_multiplier < 0 or args.ffn_multiplier > 64:
        sys.exit("--extra-layers must be >= 0 and --ffn-multiplier in [0, 64]")
    sd = load_file(os.path.join(args.src, "model.safetensors"))
    dim, n_layer = cfg["dim"], cfg["n_layer"]
    mult_of = cfg.get("multiple_of", 256)
    old_h = ffn_hidden(dim, mult_of, cfg.get("ffn_dim_multiplier") or 0)
    new_mult = args.ffn_multiplier or (cfg.get("ffn_dim_multiplier") or 0)
    new_h = ffn_hidden(dim, mult_of, new_mult)
    if new_h < old_h:
        sys.exit(f"--ffn-multiplier {args.ffn_multiplier} gives {new_h} hidden units, fewer "
                 f"than the source's {old_h}")
    if sd["layers.0.feed_forward.w1.weight"].shape != (old_h, dim):
        sys.exit(f"layers.0.feed_forward.w1.weight is {tuple(sd['layers.0.feed_forward.w1.weight'].shape)}"
                 f", not ({old_h}, {dim}) as the config says")
    out = {}
    for name, t in sd.items():
        t = t.contiguous()
        if name.endswith(("feed_forward.w1.weight", "feed_forward.w3.weight")):
            t = torch.cat([t, t.new_zeros(new_h - old_h, dim)], 0)
        elif name.endswith("feed_forward.w2.weight"):
            t = torch.cat([t, t.new_zeros(dim, new_h - old_h)], 1)
        out[name] = t
    template = {n[len("layers.0."):]: out[n] for n in out if n.startswith("layers.0.")}
    for i in range(n_layer, n_layer + args.extra_layers):
        for suffix, t in template.items():
            # Zero projections; the norms' weights as ones (any value gives zero projections).
            out[f"layers.{i}.{suffix}"] = (torch.ones_like(t) if suffix.endswith("norm.weight")
                                          else torch.zeros_like(t))
    cfg = dict(cfg)
    cfg["n_layer"] = n_layer + args.extra_layers
    if new_mult:
        cfg["ffn_dim_multiplier"] = new_mult
    cfg["twin_of"] = {
        "model": os.path.basename(os.path.normpath(args.src)),
        "how": "tools/grow_model.py: the source's weights, feed-forward widened with zeros to "
               f"{new_h} hidden units, {args.extra_layers} zero blocks appended; a benchmark "
               "model with the source's distribution at a larger model's cost",
    }
    os.makedirs(args.out, exist_ok=True)
    save_file(out, os.path.join(args.out, "model.safetensors"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    total = sum(t.numel() * t.element_size() for t in out.values())
    print(f"{args.out}: {cfg['n_layer']} layers, {new_h} hidden units, {total / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
