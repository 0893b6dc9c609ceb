"""Train a bundled MAR (masked autoregressive model with a DiffLoss head) on the KL latents of
Fashion-MNIST.

  train_mar.py --preset target   -> models/fmnist-mar/
  train_mar.py --preset draft    -> models/fmnist-mar-draft/

The model is tools/mar_ref.MAR (MAR's module and tensor names). Training follows MAR:
- tokens: the KL posterior means x latent_scale (train_kl.py caches them in $IMAGEGEN_TRAIN_DIR),
  patchified channel-major inside a patch (the inverse of mar_ref.unpatchify);
- MAE-style masking: a random order per image and one mask rate per batch from a normal
  (mean 1, std 0.25) truncated to [mask_ratio_min 0.7, 1]; ceil(seq_len * rate) tokens masked;
- class dropout 0.1: the condition becomes the null class (fake_latent) for CFG;
- DiffLoss on the masked tokens, each repeated diffusion_batch_mul = 4 times with its own t and
  noise: the 1000-step cosine schedule, eps prediction and the LEARNED_RANGE variance trained as
  IDDPM/DiT do, loss = mse(eps) + vb, where vb is the KL of the true posterior q(x_{t-1}|x_t,x_0)
  from the model's Gaussian with the eps prediction detached (the decoder NLL at t = 0), in bits;
- AdamW (betas 0.9/0.95, weight decay 0.02), warmup + cosine LR, grad clip 3, and an EMA of the
  weights, which is what is saved (MAR evaluates its EMA weights).
Initialisation as MAR: xavier-uniform linears, 0.02-normal embeddings/positions/mask token, the
DiffLoss adaLN modulations and final layer zeroed. Departures for a ~35-minute CPU budget: EMA
decay 0.999 (MAR: 0.9999 over 400 epochs) with a warmup, no attention/projection dropout, and the
head evaluated on the masked rows only (MAR evaluates all rows and masks the loss: same gradient).

Tokens: the 14x14x4 latent in 2x2 patches, i.e. 7x7 = 49 tokens of 16 channels (as MAR's kl16
tokens). 14x14 tokens of 4 channels cost 5.6x more per training image on this CPU (4x the head
rows and a 4x longer sequence): about 200 steps of 64 images in the target's budget.

num_sampling_steps: the respacing must not keep t = 999. With the cosine schedule
alpha_bar(999) = 2.4e-9, so the reverse step from 999 multiplies the head's eps error by about 316
("100" keeps 999 and 989): an eps error of 0.01 there makes the samples diverge (to |x| ~ 1e3),
and a small head trained for minutes reaches about 0.03-0.05 at t = 999. (MAR's heads, trained
400 epochs, are precise enough there.) The bundled spec is IDDPM's "ddimN" written in the section
syntax the engine parses: N sections of one step each, i.e. timesteps 0, 1000/N, ..., 1000 -
1000/N; its first step (from 990 for N = 100) amplifies eps errors by about 1.6. Sampling starts
from x_T ~ N(0, I) at that step, whose true marginal holds only sqrt(alpha_bar) = 0.014 (N = 100)
of the signal.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from common import (CLASS_NAMES, MODELS, WORK, Log, adamw, fashion_mnist, seed_all,  # noqa: E402
                    set_warmup_cosine_lr)
from imagegen_ref import load_config, save_model_dir  # noqa: E402
from mar_ref import MAR, MARConfig  # noqa: E402

PRESETS = {
    # enc = dec width, depth each, heads, DiffLoss depth x width, steps, EMA decay, sampling
    # defaults (from a sweep with eval_mar.py --per-class 20 --seed 5000 on the target: num_iter
    # 8/16/32, cfg 2-7 linear or constant, temperature 0.8-1.0, 25/50/100 diffusion steps)
    "target": dict(name="fmnist-mar", dim=128, depth=4, heads=4, diffloss_d=2, diffloss_w=192,
                   steps=2000, ema=0.999, draft_model="fmnist-mar-draft",
                   sampling={"num_iter": 16, "cfg_scale": 5.0, "cfg_schedule": "linear",
                             "temperature": 0.9}),
    "draft": dict(name="fmnist-mar-draft", dim=48, depth=1, heads=2, diffloss_d=2, diffloss_w=64,
                  steps=3000, ema=0.999, draft_model=None,
                  sampling={"num_iter": 16, "cfg_scale": 5.0, "cfg_schedule": "linear",
                            "temperature": 0.9}),
}
SAMPLING_STEPS = 50  # see num_sampling_steps in the docstring
MASK_RATIO_MIN = 0.7
LABEL_DROP = 0.1
DIFFUSION_BATCH_MUL = 4
T = 1000


# ----------------------------------------------------------------------------- diffusion loss


def respacing_without_last(n: int) -> str:
    """n sections of one step each: timesteps 0, 1000/n, ... (IDDPM's "ddim<n>"), never 999."""
    return ",".join(["1"] * n)


class CosineTables:
    """The 1000-step cosine schedule's float64 tables for training (q_sample, the posterior)."""

    def __init__(self, total: int = T):
        def abar(s):
            return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = torch.tensor([min(1 - abar((i + 1) / total) / abar(i / total), 0.999)
                              for i in range(total)], dtype=torch.float64)
        acp = torch.cumprod(1.0 - betas, 0)
        acp_prev = torch.cat([torch.ones(1, dtype=torch.float64), acp[:-1]])
        post_var = betas * (1.0 - acp_prev) / (1.0 - acp)
        self.sqrt_acp = acp.sqrt()
        self.sqrt_1macp = (1.0 - acp).sqrt()
        self.sqrt_recip = (1.0 / acp).sqrt()
        self.sqrt_recipm1 = (1.0 / acp - 1.0).sqrt()
        self.coef1 = betas * acp_prev.sqrt() / (1.0 - acp)
        self.coef2 = (1.0 - acp_prev) * (1.0 - betas).sqrt() / (1.0 - acp)
        self.min_log = torch.log(torch.cat([post_var[1:2], post_var[1:]]))  # clipped at t = 0
        self.max_log = torch.log(betas)

    def at(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return getattr(self, name)[t].float()[:, None]


def normal_kl(m1, lv1, m2, lv2):
    return 0.5 * (-1.0 + lv2 - lv1 + torch.exp(lv1 - lv2) + (m1 - m2) ** 2 * torch.exp(-lv2))


def approx_std_normal_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_loglik(x, mean, log_scale):
    """log P(x) of a Gaussian integrated over the bin x +- 1/255 (open-ended below -0.999 and
    above 0.999), the t = 0 term of the IDDPM VLB."""
    c = x - mean
    inv = torch.exp(-log_scale)
    cdf_plus = approx_std_normal_cdf(inv * (c + 1.0 / 255.0))
    cdf_min = approx_std_normal_cdf(inv * (c - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_1m_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus,
                       torch.where(x > 0.999, log_1m_cdf_min, log_delta))


def diffusion_loss(model: MAR, tab: CosineTables, x0, cond, g: torch.Generator):
    """x0 [N, C] target tokens, cond [N, Dd]. Returns (loss, mse, vb), means over N."""
    n, ch = x0.shape
    t = torch.randint(0, T, (n,), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    xt = tab.at("sqrt_acp", t) * x0 + tab.at("sqrt_1macp", t) * noise
    out = model.head(xt, t, cond)
    eps, v = out[:, :ch], out[:, ch:]
    mse = (noise - eps).pow(2).mean(1)
    # the VLB term trains only the variance: the mean comes from the detached eps
    frac = (v + 1) / 2
    min_log, max_log = tab.at("min_log", t), tab.at("max_log", t)
    logvar = frac * max_log + (1 - frac) * min_log
    x0_pred = tab.at("sqrt_recip", t) * xt - tab.at("sqrt_recipm1", t) * eps.detach()
    mean = tab.at("coef1", t) * x0_pred + tab.at("coef2", t) * xt
    true_mean = tab.at("coef1", t) * x0 + tab.at("coef2", t) * xt
    kl = normal_kl(true_mean, min_log, mean, logvar).mean(1) / math.log(2.0)
    nll = -discretized_gaussian_loglik(x0, mean, 0.5 * logvar).mean(1) / math.log(2.0)
    vb = torch.where(t == 0, nll, kl)
    return (mse + vb).mean(), mse.mean(), vb.mean()


# ----------------------------------------------------------------------------- MAR training


def patchify(lat: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)(W/p), C p p], channel-major inside a patch."""
    b, c, h, w = lat.shape
    x = lat.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def init_mar(model: MAR, g: torch.Generator):
    """MAR's initialisation (its initialize_weights and SimpleMLPAdaLN's), with a generator."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("diffloss."):
                continue
            if name in ("class_emb.weight", "fake_latent", "mask_token") or "pos_embed" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                bound = math.sqrt(6.0 / (mod.in_features + mod.out_features))
                mod.weight.copy_((torch.rand(mod.weight.shape, generator=g) * 2 - 1) * bound)
                mod.bias.zero_()
            elif isinstance(mod, nn.LayerNorm) and mod.weight is not None:
                mod.weight.fill_(1.0)
                mod.bias.zero_()
        net = model.diffloss.net
        for lin in (net.time_embed.mlp[0], net.time_embed.mlp[2]):
            lin.weight.copy_(0.02 * torch.randn(lin.weight.shape, generator=g))
        for blk in net.res_blocks:
            blk.adaLN_modulation[1].weight.zero_()
            blk.adaLN_modulation[1].bias.zero_()
        for lin in (net.final_layer.adaLN_modulation[1], net.final_layer.linear):
            lin.weight.zero_()
            lin.bias.zero_()


def mask_rate(g: torch.Generator, lo_rate: float = MASK_RATIO_MIN) -> float:
    """N(1, 0.25) truncated to [lo_rate, 1], by inverting the CDF."""
    lo = torch.special.ndtr(torch.tensor((lo_rate - 1.0) / 0.25, dtype=torch.float64))
    hi = 0.5
    u = torch.rand(1, generator=g, dtype=torch.float64)
    return float(1.0 + 0.25 * torch.special.ndtri(lo + u * (hi - lo)))


def train_step(model: MAR, tab: CosineTables, tokens, labels, g: torch.Generator,
               mask_ratio_min: float = MASK_RATIO_MIN):
    cfg = model.cfg
    b, s, _ = tokens.shape
    orders = torch.argsort(torch.rand(b, s, generator=g), dim=1)
    n_mask = int(math.ceil(s * mask_rate(g, mask_ratio_min)))
    mask = torch.zeros(b, s)
    mask.scatter_(1, orders[:, :n_mask], 1.0)
    drop = torch.rand(b, generator=g) < LABEL_DROP
    labels = torch.where(drop, torch.full_like(labels, cfg.class_num), labels)
    z = model.forward_mae(tokens, mask, labels)
    # the loss is over masked tokens only: evaluate the head on those
    sel = mask.bool()
    x0 = tokens[sel].repeat(DIFFUSION_BATCH_MUL, 1)
    cond = z[sel].repeat(DIFFUSION_BATCH_MUL, 1)
    return diffusion_loss(model, tab, x0, cond, g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=PRESETS, default="target")
    ap.add_argument("--steps", type=int, default=0, help="0: the preset's")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patch", type=int, default=2, help="patch size on the 14x14 latent")
    ap.add_argument("--buffer", type=int, default=16)
    ap.add_argument("--sampling-steps", type=int, default=SAMPLING_STEPS,
                    help="diffusion steps of the sampler (respacing_without_last)")
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--out", default="")
    ap.add_argument("--mask-ratio-min", type=float, default=MASK_RATIO_MIN)
    ap.add_argument("--bench", type=int, default=0, help="time this many steps and exit")
    ap.add_argument("--size", default="", help="override the preset: dim,depth,heads,head_d,head_w")
    args = ap.parse_args()
    seed_all(args.seed)
    torch.set_num_threads(1)
    pr = dict(PRESETS[args.preset])
    if args.size:
        pr.update(zip(["dim", "depth", "heads", "diffloss_d", "diffloss_w"],
                      (int(v) for v in args.size.split(","))))
    steps = args.steps or pr["steps"]

    kl_dir = os.path.join(MODELS, "fmnist-kl")
    kl = load_config(kl_dir)
    lat_size = kl["resolution"] // 2 ** (len(kl["ch_mult"]) - 1)
    cfg = MARConfig(img_size=kl["resolution"], vae_stride=kl["resolution"] // lat_size,
                    patch_size=args.patch, vae_embed_dim=kl["embed_dim"], class_num=10,
                    buffer_size=args.buffer, encoder_embed_dim=pr["dim"],
                    encoder_depth=pr["depth"], encoder_num_heads=pr["heads"],
                    decoder_embed_dim=pr["dim"], decoder_depth=pr["depth"],
                    decoder_num_heads=pr["heads"], mlp_ratio=4.0, diffloss_d=pr["diffloss_d"],
                    diffloss_w=pr["diffloss_w"],
                    num_sampling_steps=respacing_without_last(args.sampling_steps),
                    vae="fmnist-kl", draft_model=pr["draft_model"], class_names=CLASS_NAMES,
                    sampling_defaults=pr["sampling"])
    g = torch.Generator().manual_seed(args.seed)
    model = MAR(cfg)
    init_mar(model, g)
    tab = CosineTables()

    if args.bench:
        import time
        tokens = torch.randn(args.batch, cfg.seq_len, cfg.token_embed_dim)
        labels = torch.randint(0, 10, (args.batch,), generator=g)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for i in range(args.bench + 1):
            if i == 1:
                t0 = time.time()
            loss, _, _ = train_step(model, tab, tokens, labels, g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        dt = (time.time() - t0) / args.bench
        print(f"params {sum(p.numel() for p in model.parameters())} seq {cfg.seq_len} "
              f"s/step {dt:.3f} samples/s {args.batch / dt:.1f}")
        return

    lat = torch.load(os.path.join(WORK, "kl_latents.pt"))
    assert abs(lat["latent_scale"] - kl["latent_scale"]) < 1e-9, "latents of another KL"
    ttr = patchify(lat["train"], args.patch)
    tte = patchify(lat["test"], args.patch)
    _, ytr = fashion_mnist("train")
    _, yte = fashion_mnist("t10k")

    decay = [p for n, p in model.named_parameters()
             if p.dim() >= 2 and "pos_embed" not in n and n not in ("mask_token", "fake_latent")]
    no_decay = [p for n, p in model.named_parameters()
                if not (p.dim() >= 2 and "pos_embed" not in n
                        and n not in ("mask_token", "fake_latent"))]
    opt = adamw(decay, no_decay, args.lr, 0.02)
    ema = copy.deepcopy(model)
    for p in ema.parameters():
        p.requires_grad_(False)
    out = args.out or os.path.join(MODELS, pr["name"])
    log = Log(os.path.join(out, "train_log.jsonl"))
    log(params=sum(p.numel() for p in model.parameters()), seq_len=cfg.seq_len,
        token_dim=cfg.token_embed_dim, steps=steps, batch=args.batch, lr=args.lr,
        ema=pr["ema"], **{k: v for k, v in cfg.to_json().items()
                          if k not in ("class_names", "sampling_defaults")})
    warm = min(200, steps // 10)
    model.train()
    acc = [0.0, 0.0, 0.0]
    for step in range(steps):
        lr = set_warmup_cosine_lr(opt, step, steps, args.lr, warm)
        idx = torch.randint(0, ttr.size(0), (args.batch,), generator=g)
        loss, mse, vb = train_step(model, tab, ttr[idx], ytr[idx], g, args.mask_ratio_min)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
        opt.step()
        # EMA, with a warmup of the decay so the early average is not the random init
        d = min(pr["ema"], (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.mul_(d).add_(pm, alpha=1 - d)
        for i, v in enumerate((loss, mse, vb)):
            acc[i] += v.item()
        if (step + 1) % 50 == 0:
            log(step=step + 1, loss=round(acc[0] / 50, 4), mse=round(acc[1] / 50, 4),
                vb=round(acc[2] / 50, 4), lr=round(lr, 6))
            acc = [0.0, 0.0, 0.0]

    # held-out losses of the EMA and the raw weights on 2,000 test images (fixed masks, t, noise)
    def test_loss(m):
        m.eval()
        gt = torch.Generator().manual_seed(12345)
        tot = [0.0, 0.0, 0.0]
        with torch.no_grad():
            for i in range(0, 2000, 100):
                r = train_step(m, tab, tte[i:i + 100], yte[i:i + 100], gt)
                for j in range(3):
                    tot[j] += r[j].item() / 20
        return [round(v, 4) for v in tot]
    tot, raw = test_loss(ema), test_loss(model)
    log(final=True, test_loss=tot[0], test_mse=tot[1], test_vb=tot[2], raw_test_loss=raw[0])
    config = {**cfg.to_json(),
              "trained_on": f"fashion-mnist train (fmnist-kl latents), tools/train/train_mar.py "
                            f"--preset {args.preset}",
              "test_loss": tot[0]}
    save_model_dir(out, config, ema.state_dict())


if __name__ == "__main__":
    main()
