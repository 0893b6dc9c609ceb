"""Converts an official Janus-Pro checkpoint (a Hugging Face repository directory:
config.json, model*.safetensors or pytorch_model*.bin, tokenizer.json) into two imagegen model
directories: the generation model ("type": "janus-gen") and its VQ-16 image decoder.

  language_model.model.*   -> tok_embeddings, layers.N.{attention.wqkv (q, k, v stacked),
                              attention.wo, attention_norm, ffn_norm, feed_forward.w1 (gate),
                              w2 (down), w3 (up)}, norm
  gen_embed, gen_aligner.*, gen_head.*   -> kept under their names
  gen_vision_model.*       -> the VQ directory (through tools/convert_llamagen.py)
  language_model.lm_head, vision_model.*, aligner.*   -> skipped (text output, understanding)

Anything else is an error, so that a checkpoint of another layout is not half converted.
Weights keep the checkpoint's dtype unless --dtype float32.

usage: convert_janus.py HF_DIR OUT_DIR VQ_OUT_DIR [--max-prompt-len N] [--image-size 384]
"""
import argparse
import glob
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convert_llamagen  # noqa: E402

SKIPPED = ("language_model.lm_head.", "vision_model.", "aligner.")
# Janus's prompt: the "deepseek" conversation template with an empty system prompt and an empty
# assistant turn (janus/utils/conversation.py, SeparatorStyle.DeepSeek), then the image-start
# tag (generation_inference.py). The tokenizer's post-processor adds the BOS.
PROMPT_TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:<begin_of_image>"
PAD_TAG = "<\uff5c\u2581pad\u2581\uff5c>"


def load_tensors(hf_dir: str) -> dict:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    sd = {}
    if files:
        from safetensors.torch import load_file
        for f in files:
            sd.update(load_file(f))
        return sd
    files = sorted(glob.glob(os.path.join(hf_dir, "pytorch_model*.bin")))
    if not files:
        raise SystemExit(f"{hf_dir}: no *.safetensors or pytorch_model*.bin")
    for f in files:
        sd.update(torch.load(f, map_location="cpu", weights_only=True))
    return sd


def pad_id(tokenizer_json: str):
    with open(tokenizer_json, encoding="utf-8") as f:
        tok = json.load(f)
    for t in tok.get("added_tokens", []):
        if t.get("content") == PAD_TAG:
            return t["id"]
    vocab = tok.get("model", {}).get("vocab", {})
    return vocab.get(PAD_TAG)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("out_dir")
    ap.add_argument("vq_out_dir")
    ap.add_argument("--max-prompt-len", type=int, default=256,
                    help="longest prompt in tokens, template included (sizes the KV cache)")
    ap.add_argument("--image-size", type=int, default=384)
    ap.add_argument("--dtype", choices=["keep", "float32"], default="keep")
    ap.add_argument("--pad-id", type=int,
                    help="the pad token's id, when the checkpoint has no tokenizer.json to find "
                         "it in (the unconditional row needs it for guidance)")
    args = ap.parse_args(argv)

    with open(os.path.join(args.hf_dir, "config.json")) as f:
        hf = json.load(f)
    try:
        lc = hf["language_config"]
        head = hf["gen_head_config"]["params"]
        aligner = hf["gen_aligner_config"]["params"]
        vision = hf["gen_vision_config"]["params"]
    except KeyError as e:
        raise SystemExit(f"{args.hf_dir}/config.json: no {e} (not a Janus checkpoint)")
    if aligner.get("projector_type") != "mlp_gelu" or aligner.get("depth") != 2:
        raise SystemExit("gen_aligner_config: only projector_type mlp_gelu with depth 2 exists "
                         "in the Janus-Pro checkpoints")
    d, n_layer = lc["hidden_size"], lc["num_hidden_layers"]
    n_head = lc["num_attention_heads"]
    if lc.get("num_key_value_heads", n_head) != n_head:
        raise SystemExit("language_config: grouped-query attention is not supported")
    if lc.get("rope_scaling"):
        raise SystemExit("language_config: rope_scaling is not supported")

    src = load_tensors(args.hf_dir)
    cast = (lambda t: t.float().contiguous()) if args.dtype == "float32" else \
        (lambda t: t.contiguous())
    out, vq, used = {}, {}, set()

    def take(name):
        used.add(name)
        return src[name]

    lm = "language_model.model."
    out["tok_embeddings.weight"] = cast(take(lm + "embed_tokens.weight"))
    out["norm.weight"] = cast(take(lm + "norm.weight"))
    for i in range(n_layer):
        p, q = f"{lm}layers.{i}.", f"layers.{i}."
        out[q + "attention.wqkv.weight"] = cast(torch.cat(
            [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")], 0))
        out[q + "attention.wo.weight"] = cast(take(p + "self_attn.o_proj.weight"))
        out[q + "attention_norm.weight"] = cast(take(p + "input_layernorm.weight"))
        out[q + "ffn_norm.weight"] = cast(take(p + "post_attention_layernorm.weight"))
        out[q + "feed_forward.w1.weight"] = cast(take(p + "mlp.gate_proj.weight"))
        out[q + "feed_forward.w3.weight"] = cast(take(p + "mlp.up_proj.weight"))
        out[q + "feed_forward.w2.weight"] = cast(take(p + "mlp.down_proj.weight"))
    for name in ("gen_embed.weight", "gen_aligner.layers.0.weight", "gen_aligner.layers.0.bias",
                 "gen_aligner.layers.2.weight", "gen_aligner.layers.2.bias",
                 "gen_head.output_mlp_projector.weight", "gen_head.output_mlp_projector.bias",
                 "gen_head.vision_head.weight", "gen_head.vision_head.bias"):
        out[name] = cast(take(name))
    for k, v in src.items():
        if k.startswith("gen_vision_model."):
            vq[k[len("gen_vision_model."):]] = v.float()
            used.add(k)
    unknown = [k for k in src if k not in used and not k.startswith(SKIPPED)]
    if unknown:
        raise SystemExit(f"{args.hf_dir}: tensors of no known part: {unknown[:5]} "
                         f"({len(unknown)} in all)")
    if not vq:
        raise SystemExit(f"{args.hf_dir}: no gen_vision_model.* tensors (the VQ-16 decoder)")
    del src

    grid = args.image_size // 16
    config = {
        "type": "janus-gen", "dim": d, "n_layer": n_layer, "n_head": n_head,
        "intermediate_size": lc["intermediate_size"], "text_vocab_size": lc["vocab_size"],
        "vocab_size": head["image_token_size"], "block_size": grid * grid,
        "max_prompt_len": args.max_prompt_len, "gen_embed_dim": vision["n_embed"],
        "head_hidden": head["image_token_embed"], "rope_base": lc.get("rope_theta", 10000.0),
        "norm_eps": lc.get("rms_norm_eps", 1e-6),
        "tokenizer": os.path.basename(os.path.normpath(args.vq_out_dir)),
        "prompt_template": PROMPT_TEMPLATE,
        "sampling_defaults": {"cfg_scale": 5.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "converted_from": os.path.basename(os.path.normpath(args.hf_dir)),
    }
    if args.pad_id is not None:
        config["pad_id"] = args.pad_id
    tok = os.path.join(args.hf_dir, "tokenizer.json")
    if os.path.exists(tok):
        pid = pad_id(tok)
        if pid is not None and args.pad_id is None:
            config["pad_id"] = pid
    # The engine refuses default guidance (cfg_scale 5) without a pad id, at load: checked
    # before anything is written.
    if config.get("pad_id", -1) < 0:
        raise SystemExit("convert_janus: no pad token found (no tokenizer.json with "
                         f"{PAD_TAG!r}): pass --pad-id, a text token id")
    if os.path.exists(tok):
        os.makedirs(args.out_dir, exist_ok=True)
        shutil.copyfile(tok, os.path.join(args.out_dir, "tokenizer.json"))
        config["text_tokenizer"] = "tokenizer.json"
    convert_llamagen.write(args.out_dir, config, out)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vq.pt")
        torch.save({"model": vq}, path)
        convert_llamagen.main(["vq", path, args.vq_out_dir, "--image-size", str(args.image_size)])


if __name__ == "__main__":
    main()
