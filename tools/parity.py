"""Writes reference inputs and outputs of the Python models (tools/imagegen_ref.py) for the C++
parity tests (tests/parity_test.cc):

  gpt_bundled.safetensors   the bundled target GPT: labels, prefixes, logits of a full forward
  gptb-random/              a randomly initialised GPT with GPT-B's shape and LlamaGen names
  gptb_random.safetensors   its reference logits
  vq_bundled.safetensors    the bundled VQ decoder: ids -> image
  vq16-random/ + vq16_random.safetensors   a random VQ with the official VQ-16 layout
  mar-small-random/, kl-small-random/   a small random MAR (16x16 tokens of 16 channels) and KL
                            decoder (latent 16x16 -> 64x64), both written by tools/convert_mar.py
                            from fake official checkpoints (tools/mar_ref.py)
  janus-small-random/, janus-small-vq/   a small random Janus-Pro-layout generation model and its
                            VQ-16 decoder, written by tools/convert_janus.py from a fake official
                            checkpoint (tools/janus_ref.py)
  janus_small.safetensors   its reference image logits (two prompts of different lengths, one
                            with the unconditional row's pad ids) and, for the first, the logits
                            of the wrong variant (LlamaGen's interleaved RoPE)
  mar_small.safetensors     their reference values: forward_mae (enc_*), the DiffLoss net
                            (head_*), the respaced DDPM sampler with and without CFG (samp_*,
                            samp1_*), the MAR loop (loop_*) and the KL decoder (kl_*)

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
import convert_janus  # noqa: E402
import convert_mar  # noqa: E402
import janus_ref  # noqa: E402
import mar_ref  # noqa: E402


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

    janus_references(args.out)
    mar_references(args.out)
    print("parity references written to", args.out)


def janus_references(out: str):
    """A small random Janus-Pro-layout model converted from a fake official checkpoint, and its
    reference logits (conventions in tools/janus_ref.py)."""
    import shutil
    c = janus_ref.SMALL
    vq = VQModel(VQConfig(image_size=c["image_size"])).eval()
    randomise(vq, 8)
    hf = os.path.join(out, "janus-small-hf")
    sd = janus_ref.write_fake_checkpoint(hf, c, 7, dict(vq.state_dict()))
    convert_janus.main([hf, os.path.join(out, "janus-small-random"),
                        os.path.join(out, "janus-small-vq"), "--max-prompt-len", "32",
                        "--image-size", str(c["image_size"]), "--dtype", "float32",
                        "--pad-id", "3"])
    shutil.rmtree(hf)
    g = torch.Generator().manual_seed(9)
    n = (c["image_size"] // 16) ** 2 - 1  # image tokens fed (the last one never is)
    prompt_a = torch.randint(0, c["vocab_size"], (1, 7), generator=g)
    pad = 3
    prompt_b = torch.full((1, 12), pad)  # as Janus builds the unconditional row: BOS, pads, last
    prompt_b[0, 0], prompt_b[0, -1] = 1, 2
    image_a = torch.randint(0, c["image_token_size"], (1, n), generator=g)
    image_b = torch.randint(0, c["image_token_size"], (1, n), generator=g)
    save_file({
        "prompt_a": prompt_a[0], "image_a": image_a[0],
        "logits_a": janus_ref.forward(sd, c, prompt_a, image_a)[0].contiguous(),
        "wrong_a": janus_ref.forward(sd, c, prompt_a, image_a, "interleaved")[0].contiguous(),
        "prompt_b": prompt_b[0], "image_b": image_b[0],
        "logits_b": janus_ref.forward(sd, c, prompt_b, image_b)[0].contiguous(),
    }, os.path.join(out, "janus_small.safetensors"))


MAR_SMALL = dict(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16, class_num=10,
                 buffer_size=64, encoder_embed_dim=64, encoder_depth=2, encoder_num_heads=4,
                 decoder_embed_dim=64, decoder_depth=2, decoder_num_heads=4, mlp_ratio=4.0,
                 diffloss_d=2, diffloss_w=128, num_sampling_steps="100", vae="kl-small-random")
KL_SMALL = dict(embed_dim=16, z_channels=16, ch=32, ch_mult=[1, 2, 2], num_res_blocks=1, out_ch=3,
                resolution=64, num_groups=8, latent_scale=0.2325)


def mar_references(out: str):
    """A small random MAR + KL decoder, converted from fake official checkpoints, and their
    reference values (mar_small.safetensors; conventions in tools/mar_ref.py)."""
    import argparse
    mar = mar_ref.MAR(mar_ref.MARConfig(**MAR_SMALL)).eval()
    mar_ref.randomise_mar(mar, 6)
    sd = dict(mar.state_dict())
    fake_args = argparse.Namespace(model="mar_base", **{k: MAR_SMALL[k] for k in convert_mar.FROM_ARGS},
                                   diffloss_d=2, diffloss_w=128, cfg=3.0)
    # as MAR's save_model writes it: the EMA weights are the ones to convert
    torch.save({"model": {k: torch.zeros_like(v) for k, v in sd.items()}, "model_ema": sd,
                "epoch": 0, "args": fake_args}, os.path.join(out, "checkpoint-last.pth"))
    names = os.path.join(out, "mar_small_classes.txt")
    with open(names, "w") as f:
        f.write("".join(f"class {i}\n" for i in range(MAR_SMALL["class_num"])))
    convert_mar.main(["mar", os.path.join(out, "checkpoint-last.pth"),
                      os.path.join(out, "mar-small-random"), "--preset", "mar_base",
                      "--dims", "64,2,4", "--diffloss-d", "2", "--diffloss-w", "128",
                      "--vae", "kl-small-random", "--class-names", names, "--num-iter", "8",
                      "--cfg-scale", "3.0", "--cfg-schedule", "linear"])
    os.remove(os.path.join(out, "checkpoint-last.pth"))
    os.remove(names)

    kl = mar_ref.KLDecoder(mar_ref.KLConfig(**KL_SMALL)).eval()
    mar_ref.randomise_kl(kl, 7)
    ksd = dict(kl.state_dict())
    ksd["encoder.conv_in.weight"] = torch.zeros(32, 3, 3, 3)   # dropped by the converter
    ksd["quant_conv.weight"] = torch.zeros(32, 32, 1, 1)
    torch.save({"model": ksd}, os.path.join(out, "kl16.ckpt"))
    convert_mar.main(["kl", os.path.join(out, "kl16.ckpt"), os.path.join(out, "kl-small-random"),
                      "--ch", "32", "--ch-mult", "1,2,2", "--num-res-blocks", "1",
                      "--resolution", "64", "--num-groups", "8"])
    os.remove(os.path.join(out, "kl16.ckpt"))

    # references from the converted directories (strict loads)
    mar = mar_ref.mar_from_dir(os.path.join(out, "mar-small-random"))
    kl = mar_ref.kl_from_dir(os.path.join(out, "kl-small-random"))
    c = mar.cfg
    s, ch, dd = c.seq_len, c.token_embed_dim, c.decoder_embed_dim
    steps = mar.diffusion.num_steps
    g = torch.Generator().manual_seed(8)
    r = {}
    with torch.no_grad():
        r["enc_tokens"] = torch.randn(2, s, ch, generator=g)
        mask = torch.ones(2, s)
        for b in range(2):  # 100 known tokens per row, at different positions
            mask[b, torch.randperm(s, generator=g)[:100]] = 0
        r["enc_mask"] = mask
        r["enc_labels"] = torch.tensor([3, c.class_num])
        r["enc_z"] = mar.forward_mae(r["enc_tokens"], mask, r["enc_labels"])

        n = 8
        r["head_x"] = torch.randn(n, ch, generator=g)
        r["head_t"] = torch.cat([torch.tensor([0, 999]),
                                 torch.randint(0, 1000, (n - 2,), generator=g)])
        r["head_c"] = torch.randn(n, dd, generator=g)
        r["head_out"] = mar.head(r["head_x"], r["head_t"], r["head_c"])

        r["samp_zc"] = torch.randn(n, dd, generator=g)
        r["samp_zu"] = torch.randn(n, dd, generator=g)
        r["samp_xT"] = torch.randn(n, ch, generator=g)
        r["samp_eps"] = torch.randn(n, steps, ch, generator=g)
        r["samp_cfg"] = torch.tensor(3.0)
        r["samp_temperature"] = torch.tensor(0.9)
        args = (r["samp_zc"], r["samp_zu"], r["samp_xT"], r["samp_eps"], 0.9, 3.0)
        for k, v in mar.sample_head(*args).items():
            r["samp_" + k] = v
        r["samp_x0_fn"] = mar.sample_head(*args, final_noise=True)["x0"]
        one = mar.sample_head(r["samp_zc"], None, r["samp_xT"], r["samp_eps"], 1.0, 1.0)
        for k, v in one.items():
            r["samp1_" + k] = v

        r["loop_labels"] = torch.tensor([3, 7])
        r["loop_orders"] = torch.stack([torch.randperm(s, generator=g) for _ in range(2)])
        r["loop_xT"] = torch.randn(2, s, ch, generator=g)
        r["loop_eps"] = torch.randn(2, s, steps, ch, generator=g)
        r["loop_num_iter"] = torch.tensor(8)
        r["loop_cfg"] = torch.tensor(3.0)
        r["loop_temperature"] = torch.tensor(1.0)
        r["loop_linear"] = torch.tensor(1)
        r["loop_tokens"] = mar.sample_tokens(r["loop_labels"], 8, 3.0, "linear", 1.0,
                                             r["loop_orders"], r["loop_xT"], r["loop_eps"])

        r["kl_tokens"] = kl.cfg.latent_scale * torch.randn(2, s, ch, generator=g)
        r["kl_image"] = kl.decode(r["kl_tokens"], c.patch_size)
    save_file({k: v.clone().contiguous() for k, v in r.items()},
              os.path.join(out, "mar_small.safetensors"))


if __name__ == "__main__":
    main()
