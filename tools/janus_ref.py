"""A plain-PyTorch reference of Janus-Pro's image-generation path, for the C++ parity test.

What it computes, from a state dict in the official Janus layout (deepseek-ai/Janus,
janus/models/modeling_vlm.py and generation_inference.py):

  inputs   prompt ids -> language_model.model.embed_tokens; image ids ->
           gen_aligner(gen_embed(id)) (Linear, GELU, Linear)
  LM       transformers' LlamaModel as Janus builds it from its language_config: RMSNorm in
           fp32 (weight * normalised.to(dtype)), 1-D rotate-half RoPE on q and k with positions
           0.. over the whole sequence (prompt then image tokens), causal attention, SwiGLU
           (down(silu(gate(x)) * up(x))), no biases, a final RMSNorm
  logits   gen_head: output_mlp_projector, GELU (exact), vision_head

transformers is not a dependency of this project, so the LLaMA layers are written out here from
their definition; `rope="interleaved"` applies LlamaGen's pairing (2j, 2j + 1) instead of the
halves (j, j + hd/2), the wrong variant the parity test must tell apart.

Also writes fake official checkpoints (random weights, official key names and config.json,
including parts of the understanding tower the converter must skip) for tools/convert_janus.py.
"""
import json
import math
import os

import torch
import torch.nn.functional as F

# A small Janus-shaped model: the parity test's. The image side is the official one (VQ-16:
# 16,384 codes of 8 dimensions), at a 64x64 image (4x4 tokens).
SMALL = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_hidden_layers=2,
             vocab_size=300, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=512, image_token_size=16384, image_token_embed=48,
             code_dim=8, image_size=64)

# Janus-Pro-1B's language model (DeepSeek-LLM 1.5B; config.json of deepseek-ai/Janus-Pro-1B).
PRO_1B = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
              num_hidden_layers=24, vocab_size=102400, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=16384, image_token_size=16384, image_token_embed=2048,
              code_dim=8, image_size=384)


def official_config(c: dict) -> dict:
    """config.json as the Janus-Pro checkpoints ship it (the parts the converter reads)."""
    return {
        "model_type": "multi_modality",
        "language_config": {k: c[k] for k in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
            "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")}
        | {"num_key_value_heads": c["num_attention_heads"], "torch_dtype": "bfloat16"},
        "gen_aligner_config": {"cls": "MlpProjector", "model_type": "gen_aligner",
                               "params": {"depth": 2, "input_dim": c["code_dim"],
                                          "n_embed": c["hidden_size"],
                                          "projector_type": "mlp_gelu"}},
        "gen_head_config": {"cls": "vision_head", "model_type": "gen_head",
                            "params": {"image_token_embed": c["image_token_embed"],
                                       "image_token_size": c["image_token_size"],
                                       "n_embed": c["hidden_size"]}},
        "gen_vision_config": {"cls": "VQ-16", "model_type": "gen_vision",
                              "params": {"image_token_size": c["image_token_size"],
                                         "n_embed": c["code_dim"]}},
        "vision_config": {"cls": "CLIPVisionTower", "model_type": "vision", "params": {}},
        "aligner_config": {"cls": "MlpProjector", "model_type": "aligner", "params": {}},
    }


def random_state_dict(c: dict, seed: int, dtype=torch.float32) -> dict:
    """The generation path's tensors under their official names, random (normal, std 0.02
    unless noted; biases std 0.05; norms 1 + 0.1 noise), plus a stand-in for the parts generation never uses
    (the text head, the understanding tower)."""
    g = torch.Generator().manual_seed(seed)
    d, h, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    n_img, e, hh = c["image_token_size"], c["code_dim"], c["image_token_embed"]

    def w(*shape, std=0.02):
        return (std * torch.randn(shape, generator=g)).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn((n,), generator=g)).to(dtype)

    lm = "language_model.model."
    sd = {lm + "embed_tokens.weight": w(v, d), lm + "norm.weight": norm(d),
          "language_model.lm_head.weight": w(v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"{lm}layers.{i}."
        # q and k larger than the rest: sharp attention, where the position encoding matters
        for n, std in (("q", 0.15), ("k", 0.15), ("v", 0.02), ("o", 0.02)):
            sd[p + f"self_attn.{n}_proj.weight"] = w(d, d, std=std)
        sd[p + "mlp.gate_proj.weight"] = w(h, d)
        sd[p + "mlp.up_proj.weight"] = w(h, d)
        sd[p + "mlp.down_proj.weight"] = w(d, h)
        sd[p + "input_layernorm.weight"] = norm(d)
        sd[p + "post_attention_layernorm.weight"] = norm(d)
    sd["gen_embed.weight"] = w(n_img, e, std=1.0)
    sd["gen_aligner.layers.0.weight"] = w(d, e, std=0.3)
    sd["gen_aligner.layers.0.bias"] = w(d, std=0.05)
    sd["gen_aligner.layers.2.weight"] = w(d, d, std=0.1)
    sd["gen_aligner.layers.2.bias"] = w(d, std=0.05)
    sd["gen_head.output_mlp_projector.weight"] = w(hh, d, std=0.1)
    sd["gen_head.output_mlp_projector.bias"] = w(hh, std=0.05)
    sd["gen_head.vision_head.weight"] = w(n_img, hh, std=0.1)
    sd["gen_head.vision_head.bias"] = w(n_img, std=0.05)
    sd["vision_model.vision_tower.patch_embed.proj.weight"] = w(8, 3, 2, 2)
    sd["aligner.layers.0.weight"] = w(d, 8)
    return sd


def rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x, positions, theta, style):
    """x [B, H, T, hd]; positions [T]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    ang = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
    if style == "half":
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin
    if style == "interleaved":  # LlamaGen's pairs (2j, 2j + 1): wrong for Janus
        xs = x.float().reshape(*x.shape[:-1], hd // 2, 2)
        c, s = ang.cos(), ang.sin()
        out = torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], -1)
        return out.flatten(-2).to(x.dtype)
    raise ValueError(style)


@torch.no_grad()
def forward(sd: dict, c: dict, prompt: torch.Tensor, image: torch.Tensor, rope_style="half"):
    """Image logits at every position of prompt ++ image: [B, P + n, image_token_size]."""
    lm = "language_model.model."
    d, nh = c["hidden_size"], c["num_attention_heads"]
    hd = d // nh
    x_text = F.embedding(prompt, sd[lm + "embed_tokens.weight"])
    x_img = F.linear(F.gelu(F.linear(F.embedding(image, sd["gen_embed.weight"]),
                                     sd["gen_aligner.layers.0.weight"],
                                     sd["gen_aligner.layers.0.bias"])),
                     sd["gen_aligner.layers.2.weight"], sd["gen_aligner.layers.2.bias"])
    x = torch.cat([x_text, x_img], 1)
    b, t, _ = x.shape
    pos = torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(c["num_hidden_layers"]):
        p = f"{lm}layers.{i}."
        h = rms_norm(x, sd[p + "input_layernorm.weight"], c["rms_norm_eps"])
        q, k, v = (F.linear(h, sd[p + f"self_attn.{n}_proj.weight"]).view(b, t, nh, hd)
                   .transpose(1, 2) for n in ("q", "k", "v"))
        q, k = rope(q, pos, c["rope_theta"], rope_style), rope(k, pos, c["rope_theta"], rope_style)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        o = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + F.linear(o, sd[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
        x = x + F.linear(F.silu(F.linear(h, sd[p + "mlp.gate_proj.weight"])) *
                         F.linear(h, sd[p + "mlp.up_proj.weight"]), sd[p + "mlp.down_proj.weight"])
    h = rms_norm(x, sd[lm + "norm.weight"], c["rms_norm_eps"])
    h = F.gelu(F.linear(h, sd["gen_head.output_mlp_projector.weight"],
                        sd["gen_head.output_mlp_projector.bias"]))
    return F.linear(h, sd["gen_head.vision_head.weight"], sd["gen_head.vision_head.bias"])


def write_fake_checkpoint(out_dir: str, c: dict, seed: int, vq_state_dict: dict,
                          dtype=torch.float32) -> dict:
    """A directory as a Janus-Pro repository on the Hub looks: config.json and
    model.safetensors (language_model.*, gen_*, gen_vision_model.*, understanding tower)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    sd = random_state_dict(c, seed, dtype)
    full = dict(sd)
    for k, v in vq_state_dict.items():
        full["gen_vision_model." + k] = v.to(dtype).contiguous()
    save_file(full, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(official_config(c), f, indent=2)
    return sd
