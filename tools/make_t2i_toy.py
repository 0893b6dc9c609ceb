#!/usr/bin/env python3
"""A random text-to-image model for the end-to-end tests: the Janus-Pro layout ("janus-gen",
as tools/convert_janus.py writes it) at toy size, drawing the bundled fmnist-vq's 512 codes on
its 14x14 grid, with a byte-level BPE tokenizer.json in DeepSeek-LLM's layout (Janus's chat
template tokens, the BOS template) trained by the `tokenizers` package (tools/tokenizer_ref.py).

  tools/make_t2i_toy.py --out DIR [--models models/] [--name toy-t2i] [--dim 32 --layers 2
      --heads 4 --ffn 64 --max-prompt 64]

Writes DIR/NAME/{config.json, model.safetensors, tokenizer.json}, links DIR/fmnist-vq to the
bundled decoder, and DIR/NAME.expected.json: a prompt and the ids `tokenizers` gives for it
inside the template (the server must send the engine the same ids). The size flags make a
larger one for benchmarks (bench/prefill_bench_main.cc).
"""
import argparse
import json
import os
import random
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer_ref  # noqa: E402
from convert_janus import PAD_TAG, PROMPT_TEMPLATE  # noqa: E402

CODE_DIM, VOCAB, GRID = 8, 512, 14
PROMPT = "a dark ankle boot, seen from the side"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "models"))
    ap.add_argument("--name", default="toy-t2i")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=64)
    args = ap.parse_args()
    DIM, LAYERS, HEADS, FFN, HEAD_HIDDEN = args.dim, args.layers, args.heads, args.ffn, args.dim
    MAX_PROMPT = args.max_prompt
    out = os.path.join(args.out, args.name)
    os.makedirs(out, exist_ok=True)
    tok = tokenizer_ref.build("deepseek", random.Random(5))
    tok.save(os.path.join(out, "tokenizer.json"))
    text_vocab = tok.get_vocab_size()

    g = torch.Generator().manual_seed(17)

    def w(*shape, std=0.3 * (32 / DIM) ** 0.5):  # 0.3 at the test's width, scaled with it
        return (std * torch.randn(shape, generator=g)).contiguous()

    t = {"tok_embeddings.weight": w(text_vocab, DIM, std=1.0),
         "gen_embed.weight": w(VOCAB, CODE_DIM, std=1.0),
         "gen_aligner.layers.0.weight": w(DIM, CODE_DIM), "gen_aligner.layers.0.bias": w(DIM),
         "gen_aligner.layers.2.weight": w(DIM, DIM), "gen_aligner.layers.2.bias": w(DIM),
         "norm.weight": 1 + w(DIM, std=0.1),
         "gen_head.output_mlp_projector.weight": w(HEAD_HIDDEN, DIM),
         "gen_head.output_mlp_projector.bias": w(HEAD_HIDDEN),
         "gen_head.vision_head.weight": w(VOCAB, HEAD_HIDDEN),
         "gen_head.vision_head.bias": w(VOCAB)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        t[p + "attention_norm.weight"] = 1 + w(DIM, std=0.1)
        t[p + "attention.wqkv.weight"] = w(3 * DIM, DIM)
        t[p + "attention.wo.weight"] = w(DIM, DIM)
        t[p + "ffn_norm.weight"] = 1 + w(DIM, std=0.1)
        t[p + "feed_forward.w1.weight"] = w(FFN, DIM)
        t[p + "feed_forward.w2.weight"] = w(DIM, FFN)
        t[p + "feed_forward.w3.weight"] = w(FFN, DIM)
    save_file(t, os.path.join(out, "model.safetensors"))
    config = {"type": "janus-gen", "dim": DIM, "n_layer": LAYERS, "n_head": HEADS,
              "intermediate_size": FFN, "text_vocab_size": text_vocab, "vocab_size": VOCAB,
              "block_size": GRID * GRID, "max_prompt_len": MAX_PROMPT, "gen_embed_dim": CODE_DIM,
              "head_hidden": HEAD_HIDDEN, "tokenizer": "fmnist-vq",
              "text_tokenizer": "tokenizer.json", "pad_id": tok.token_to_id(PAD_TAG),
              "prompt_template": PROMPT_TEMPLATE,
              "sampling_defaults": {"cfg_scale": 5.0, "temperature": 1.0, "top_k": 0,
                                    "top_p": 1.0},
              "note": "random weights: a test fixture (tools/make_t2i_toy.py)"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    vq = os.path.join(args.out, "fmnist-vq")
    if not os.path.lexists(vq):
        os.symlink(os.path.abspath(os.path.join(args.models, "fmnist-vq")), vq)
    ids = tok.encode(PROMPT_TEMPLATE.replace("{prompt}", PROMPT)).ids
    with open(os.path.join(args.out, args.name + ".expected.json"), "w") as f:
        json.dump({"prompt": PROMPT, "ids": ids}, f)
    print(f"{args.name} written to {out}: text vocabulary {text_vocab}, prompt of {len(ids)} tokens")


if __name__ == "__main__":
    main()
