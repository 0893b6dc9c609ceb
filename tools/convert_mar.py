"""Convert official MAR checkpoints into imagegen model directories (config.json +
model.safetensors, float32, tensor names unchanged; shared/docs/models.md section 3).

  # a MAR checkpoint (checkpoint-last.pth: {model, model_ema, ..., args}); the EMA weights are
  # the ones used for inference. DiffLoss depth x width default to the README's per preset
  # (base 6x1024, large 8x1280, huge 12x1536).
  python tools/convert_mar.py mar pretrained_models/mar/mar_base/checkpoint-last.pth \
      models/mar-base --preset mar_base --vae kl16
  # the KL-16 autoencoder (kl16.ckpt, weights under "model"): only the decoder is kept
  python tools/convert_mar.py kl pretrained_models/vae/kl16.ckpt models/kl16

The checkpoint's `args` (an argparse.Namespace) is read when present: img_size, vae_stride,
patch_size, vae_embed_dim, class_num, buffer_size and num_sampling_steps come from it, and the
preset and DiffLoss size given here must agree with it. Checkpoints are read with
torch.load(weights_only=True), allowing argparse.Namespace; --trust-pickle falls back to a full
unpickle for files that need more (only for files you trust).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mar_ref import MAR, KLConfig, KLDecoder, MARConfig  # noqa: E402
from convert_llamagen import write  # noqa: E402

PRESETS = {  # MAR models/mar.py presets, README DiffLoss sizes and eval cfg (linear schedule)
    "mar_base": dict(dim=768, depth=12, heads=12, diffloss_d=6, diffloss_w=1024, cfg=2.9),
    "mar_large": dict(dim=1024, depth=16, heads=16, diffloss_d=8, diffloss_w=1280, cfg=3.0),
    "mar_huge": dict(dim=1280, depth=20, heads=16, diffloss_d=12, diffloss_w=1536, cfg=3.2),
}
FROM_ARGS = ["img_size", "vae_stride", "patch_size", "vae_embed_dim", "class_num", "buffer_size",
             "num_sampling_steps"]


def load_checkpoint(path: str, trust_pickle: bool) -> dict:
    import argparse as _argparse
    try:
        with torch.serialization.safe_globals([_argparse.Namespace]):
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 (any unpickling refusal)
        if not trust_pickle:
            raise SystemExit(f"{path}: torch.load(weights_only=True) refused it ({e}); if you "
                             "trust the file, run again with --trust-pickle")
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(ckpt, dict):
        raise SystemExit(f"{path}: not a checkpoint dict")
    return ckpt


def clean(sd: dict, keep=None) -> dict:
    out = {}
    for k, v in sd.items():
        if k.startswith("module."):
            k = k[len("module."):]
        if keep is not None and not keep(k):
            continue
        if not torch.is_tensor(v):
            raise SystemExit(f"state_dict entry {k} is not a tensor")
        out[k] = (v.detach().float() if v.is_floating_point() else v.detach()).contiguous()
    return out


def check_shapes(model: torch.nn.Module, sd: dict, what: str):
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in sd.items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    if missing or extra or wrong:
        msg = [f"{what}: the checkpoint does not match the configuration"]
        if missing:
            msg.append(f"  missing ({len(missing)}): {missing[:6]}")
        if extra:
            msg.append(f"  unexpected ({len(extra)}): {extra[:6]}")
        for k in wrong[:6]:
            msg.append(f"  {k}: checkpoint {have[k]}, expected {want[k]}")
        raise SystemExit("\n".join(msg))


def read_class_names(path: str, n: int) -> list:
    with open(path) as f:
        names = [ln.strip() for ln in f if ln.strip()]
    if len(names) != n:
        raise SystemExit(f"{path}: {len(names)} class names, the model has {n} classes")
    return names


def convert_mar(args):
    ckpt = load_checkpoint(args.checkpoint, args.trust_pickle)
    key = args.weights
    if key not in ckpt or ckpt[key] is None:
        raise SystemExit(f"{args.checkpoint}: no '{key}' entry (keys: {sorted(ckpt)}); "
                         "pass --weights model to convert the non-EMA weights")
    sd = clean(ckpt[key])
    p = dict(PRESETS[args.preset])
    if args.dims:
        try:
            p["dim"], p["depth"], p["heads"] = (int(v) for v in args.dims.split(","))
        except ValueError:
            raise SystemExit("--dims wants DIM,DEPTH,HEADS")
    d = args.diffloss_d if args.diffloss_d is not None else p["diffloss_d"]
    w = args.diffloss_w if args.diffloss_w is not None else p["diffloss_w"]
    fields = dict(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16, class_num=1000,
                  buffer_size=64, num_sampling_steps="100")
    ns = ckpt.get("args")
    if ns is not None:
        nsd = vars(ns) if hasattr(ns, "__dict__") else dict(ns)
        for k in FROM_ARGS:
            if k in nsd and nsd[k] is not None:
                fields[k] = nsd[k]
        if "model" in nsd and nsd["model"] != args.preset and not args.dims:
            raise SystemExit(f"the checkpoint was trained as {nsd['model']}, not {args.preset}")
        for k, v in (("diffloss_d", d), ("diffloss_w", w)):
            if k in nsd and nsd[k] != v:
                raise SystemExit(f"the checkpoint's args say {k}={nsd[k]}, not {v}")
    if args.class_num is not None:
        fields["class_num"] = args.class_num
    cfg = MARConfig(encoder_embed_dim=p["dim"], encoder_depth=p["depth"],
                    encoder_num_heads=p["heads"], decoder_embed_dim=p["dim"],
                    decoder_depth=p["depth"], decoder_num_heads=p["heads"], mlp_ratio=4.0,
                    diffloss_d=d, diffloss_w=w, vae=args.vae, draft_model=args.draft_model,
                    **fields)
    cfg.num_sampling_steps = str(cfg.num_sampling_steps)
    cfg.class_names = read_class_names(args.class_names, cfg.class_num) if args.class_names else []
    cfg.sampling_defaults = {
        "num_iter": args.num_iter,
        "cfg_scale": args.cfg_scale if args.cfg_scale is not None else p["cfg"],
        "cfg_schedule": args.cfg_schedule,
        "temperature": args.temperature,
    }
    with torch.device("meta"):
        model = MAR(cfg)
    check_shapes(model, sd, "mar")
    write(args.out_dir, cfg.to_json(), sd)


def convert_kl(args):
    ckpt = load_checkpoint(args.checkpoint, args.trust_pickle)
    sd = ckpt.get("model", ckpt.get("state_dict", ckpt))
    if not isinstance(sd, dict):
        raise SystemExit(f"{args.checkpoint}: no 'model' state_dict")
    sd = clean(sd, keep=lambda k: k.startswith("decoder.") or k.startswith("post_quant_conv."))
    if "post_quant_conv.weight" not in sd:
        raise SystemExit(f"{args.checkpoint}: no post_quant_conv.weight: not a KL autoencoder")
    emb = sd["post_quant_conv.weight"].shape[1]
    zc = sd["post_quant_conv.weight"].shape[0]
    out_ch = sd["decoder.conv_out.weight"].shape[0] if "decoder.conv_out.weight" in sd else 3
    cfg = KLConfig(embed_dim=emb, z_channels=zc, ch=args.ch,
                   ch_mult=[int(v) for v in args.ch_mult.split(",")],
                   num_res_blocks=args.num_res_blocks, out_ch=out_ch, resolution=args.resolution,
                   num_groups=args.num_groups, latent_scale=args.latent_scale)
    with torch.device("meta"):
        model = KLDecoder(cfg)
    check_shapes(model, sd, "kl")
    write(args.out_dir, cfg.to_json(), sd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("kind", choices=["mar", "kl"])
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--trust-pickle", action="store_true",
                    help="allow a full unpickle when weights_only loading refuses the file")
    g = ap.add_argument_group("mar")
    g.add_argument("--preset", choices=sorted(PRESETS), default="mar_base")
    g.add_argument("--diffloss-d", type=int, default=None, help="default: the preset's")
    g.add_argument("--diffloss-w", type=int, default=None, help="default: the preset's")
    g.add_argument("--dims", default=None,
                   help="DIM,DEPTH,HEADS overriding the preset's transformer (tests)")
    g.add_argument("--class-num", type=int, default=None, help="default: args, else 1000")
    g.add_argument("--weights", choices=["model_ema", "model"], default="model_ema")
    g.add_argument("--vae", default="kl16", help="KL model directory name beside this one")
    g.add_argument("--draft-model", default=None, help="a draft MAR's directory name")
    g.add_argument("--class-names", default=None, help="a file with one class name a line")
    g.add_argument("--num-iter", type=int, default=256)
    g.add_argument("--cfg-scale", type=float, default=None, help="default: the preset's eval cfg")
    g.add_argument("--cfg-schedule", choices=["linear", "constant"], default="linear")
    g.add_argument("--temperature", type=float, default=1.0)
    k = ap.add_argument_group("kl")
    k.add_argument("--ch", type=int, default=128)
    k.add_argument("--ch-mult", default="1,1,2,2,4")
    k.add_argument("--num-res-blocks", type=int, default=2)
    k.add_argument("--resolution", type=int, default=256)
    k.add_argument("--num-groups", type=int, default=32)
    k.add_argument("--latent-scale", type=float, default=0.2325)
    args = ap.parse_args(argv)
    if args.kind == "mar":
        convert_mar(args)
    else:
        convert_kl(args)


if __name__ == "__main__":
    main()
