"""Sample N images per class from a bundled MAR with the Python reference (tools/mar_ref.py),
decode them with its KL decoder and score them with the bundled classifier: class accuracy and
the Frechet distance of the classifier's penultimate features to those of the Fashion-MNIST test
set (the statistics stored with the classifier), as bench/eval_main.cc does for the GPT.

  eval_mar.py --model fmnist-mar --per-class 100            (the sampling_defaults of the model)
  eval_mar.py --model fmnist-mar-draft --num-iter 16 --cfg 3 --temperature 1 --per-class 20

Image k of class c uses seed + c * per_class + k: a torch.Generator seeded with it draws the
order (argsort of uniforms over the tokens), x_T [S, C] and the per-step noise [S, steps, C], in
that order. Pixels are converted to uint8 as the engine does (imagegen_ref.to_uint8:
clamp(127.5 x + 128) truncated) and fed to the classifier as uint8 / 255. One thread.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from common import MODELS  # noqa: E402
from imagegen_ref import (Classifier, frechet_distance, load_config, load_tensors,  # noqa: E402
                         to_uint8)
from mar_ref import SpacedCosineDiffusion, kl_from_dir, mar_from_dir  # noqa: E402


def model_dir(name: str) -> str:
    return name if os.path.isdir(name) else os.path.join(MODELS, name)


def load_classifier(path: str):
    cfg = load_config(path)
    net = Classifier(cfg["width"], cfg["features"], cfg["num_classes"])
    sd = load_tensors(path)
    ref = (sd.pop("reference.test_feature_mean"), sd.pop("reference.test_feature_cov"))
    net.load_state_dict(sd, strict=True)
    return net.eval(), ref, cfg


def image_noise(seed: int, seq_len: int, steps: int, ch: int):
    g = torch.Generator().manual_seed(seed)
    order = torch.argsort(torch.rand(seq_len, generator=g))
    x_t = torch.randn(seq_len, ch, generator=g)
    eps = torch.randn(seq_len, steps, ch, generator=g)
    return order, x_t, eps


def sample_images(mar, kl, labels, seeds, num_iter, cfg, schedule, temperature):
    """labels [B], seeds list of B ints -> uint8 images [B, 28, 28]."""
    c = mar.cfg
    noise = [image_noise(s, c.seq_len, mar.diffusion.num_steps, c.token_embed_dim) for s in seeds]
    orders = torch.stack([n[0] for n in noise])
    x_t = torch.stack([n[1] for n in noise])
    eps = torch.stack([n[2] for n in noise])
    with torch.no_grad():
        tokens = mar.sample_tokens(labels, num_iter, cfg, schedule, temperature, orders, x_t, eps)
        img = kl.decode(tokens, c.patch_size)
    return to_uint8(img)[:, 0]


def evaluate(mar, kl, clf, ref, per_class, seed, num_iter, cfg, schedule, temperature,
             batch=100, verbose=True):
    n_cls = mar.cfg.class_num
    jobs = [(c, seed + c * per_class + k) for c in range(n_cls) for k in range(per_class)]
    imgs, t0 = [], time.time()
    for i in range(0, len(jobs), batch):
        chunk = jobs[i:i + batch]
        labels = torch.tensor([j[0] for j in chunk])
        imgs.append(sample_images(mar, kl, labels, [j[1] for j in chunk], num_iter, cfg,
                                  schedule, temperature))
    secs = time.time() - t0
    imgs = torch.cat(imgs)
    y = torch.tensor([j[0] for j in jobs])
    with torch.no_grad():
        feats = clf.features(imgs.float().div(255.0)[:, None])
        pred = clf.fc2(feats).argmax(1)
    acc = (pred == y).float().mean().item()
    per = [(pred[y == c] == c).float().mean().item() for c in range(n_cls)]
    f = feats.double()
    fd = frechet_distance(f.mean(0), torch.cov(f.t()), ref[0], ref[1])
    res = {"images": len(jobs), "accuracy": round(acc, 4), "fd": round(fd, 3),
           "per_class": [round(p, 2) for p in per], "s_per_image": round(secs / len(jobs), 4),
           "num_iter": num_iter, "cfg": cfg, "cfg_schedule": schedule,
           "temperature": temperature, "diffusion_steps": mar.diffusion.num_steps,
           "first_t": mar.diffusion.timestep_map[-1],
           "seed": seed}
    if verbose:
        print(json.dumps(res), flush=True)
    return res, imgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fmnist-mar")
    ap.add_argument("--classifier", default="fmnist-classifier")
    ap.add_argument("--num-iter", type=int, default=0, help="0: the model's sampling_defaults")
    ap.add_argument("--cfg", type=float, default=None)
    ap.add_argument("--cfg-schedule", default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--num-sampling-steps", default=None, help="respacing spec override")
    ap.add_argument("--sampling-steps", type=int, default=0,
                    help="override: N one-step sections (timesteps 0, 1000/N, ...), as bundled")
    ap.add_argument("--per-class", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--grid-out", default="", help="PNG of up to 10 images per class")
    args = ap.parse_args()
    torch.set_num_threads(1)

    mdir = model_dir(args.model)
    mar = mar_from_dir(mdir)
    if args.sampling_steps:
        args.num_sampling_steps = ",".join(["1"] * args.sampling_steps)
    if args.num_sampling_steps:
        mar.cfg.num_sampling_steps = str(args.num_sampling_steps)
        mar.diffusion = SpacedCosineDiffusion(mar.cfg.num_sampling_steps)
    kl = kl_from_dir(model_dir(mar.cfg.vae))
    clf, ref, _ = load_classifier(model_dir(args.classifier))
    sd = mar.cfg.sampling_defaults
    num_iter = args.num_iter or sd["num_iter"]
    cfg = sd["cfg_scale"] if args.cfg is None else args.cfg
    sched = args.cfg_schedule or sd["cfg_schedule"]
    temp = sd["temperature"] if args.temperature is None else args.temperature
    print(f"{mdir}: {args.per_class} per class, num_iter {num_iter} cfg {cfg} ({sched}) "
          f"temperature {temp}, {mar.diffusion.num_steps} diffusion steps (t from "
          f"{mar.diffusion.timestep_map[-1]}), seeds from "
          f"{args.seed}", flush=True)
    _, imgs = evaluate(mar, kl, clf, ref, args.per_class, args.seed, num_iter, cfg, sched, temp,
                       args.batch)
    if args.grid_out:
        from PIL import Image
        cols = min(args.per_class, 10)
        rows = [torch.cat([imgs[c * args.per_class + k] for k in range(cols)], 1)
                for c in range(mar.cfg.class_num)]
        Image.fromarray(torch.cat(rows, 0).numpy()).save(args.grid_out)


if __name__ == "__main__":
    main()
