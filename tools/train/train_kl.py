"""Train the bundled KL autoencoder for MAR on Fashion-MNIST: 28x28 grey -> 14x14 x 4 latent.

LDM AutoencoderKL structure at a small width: encoder (conv_in, down levels, mid res/attn/res,
norm_out, conv_out to 2 z_channels) and quant_conv give the posterior mean and log-variance; a
reparameterised sample goes through post_quant_conv and the decoder, which is mar_ref.KLDecoder
(the module and tensor names the C++ KlDecoder reads). Loss: L1 + L2 on pixels plus a small KL
term; no GAN, no perceptual loss. Inputs and outputs use common.to_unit's [-1, 1] convention.

latent_scale = 1 / std of the posterior means over the training set, as MAR's 0.2325 for kl16.
model.safetensors holds the decoder side only (post_quant_conv.* and decoder.*), so
mar_ref.kl_from_dir loads it with strict=True; the encoder (for tooling) and the scaled latents of
the train and test sets (posterior means x latent_scale, [N, 4, 14, 14]) go to
$IMAGEGEN_TRAIN_DIR for train_mar.py.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from common import MODELS, WORK, Log, fashion_mnist, seed_all, to_unit  # noqa: E402
from imagegen_ref import save_model_dir, to_uint8  # noqa: E402
from mar_ref import KLAttn, KLConfig, KLDecoder, KLResBlock, group_norm, swish  # noqa: E402


class KLDownsample(nn.Module):
    """LDM's downsample: pad right and bottom by one, 3x3 conv with stride 2."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 2, 0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class KLEncoderNet(nn.Module):
    """conv_in; per level num_res_blocks res blocks and (but the last) a downsample; mid
    (res, attn, res); norm_out, swish, conv_out to 2 * z_channels (mean | logvar)."""

    def __init__(self, cfg: KLConfig, in_ch: int = 1):
        super().__init__()
        g = cfg.num_groups
        self.conv_in = nn.Conv2d(in_ch, cfg.ch, 3, 1, 1)
        c = cfg.ch
        self.down = nn.ModuleList()
        for lvl, m in enumerate(cfg.ch_mult):
            lv = nn.Module()
            blocks = []
            for _ in range(cfg.num_res_blocks):
                blocks.append(KLResBlock(c, cfg.ch * m, g))
                c = cfg.ch * m
            lv.block = nn.ModuleList(blocks)
            if lvl != len(cfg.ch_mult) - 1:
                lv.downsample = KLDownsample(c)
            self.down.append(lv)
        self.mid = nn.Module()
        self.mid.block_1 = KLResBlock(c, c, g)
        self.mid.attn_1 = KLAttn(c, g)
        self.mid.block_2 = KLResBlock(c, c, g)
        self.norm_out = group_norm(c, g)
        self.conv_out = nn.Conv2d(c, 2 * cfg.z_channels, 3, 1, 1)

    def forward(self, x):
        h = self.conv_in(x)
        for lvl, lv in enumerate(self.down):
            for blk in lv.block:
                h = blk(h)
            if lvl != len(self.down) - 1:
                h = lv.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(swish(self.norm_out(h)))


class KLAutoencoder(KLDecoder):
    """KLDecoder (post_quant_conv, decoder) plus the encoder side."""

    def __init__(self, cfg: KLConfig):
        super().__init__(cfg)
        self.encoder = KLEncoderNet(cfg)
        self.quant_conv = nn.Conv2d(2 * cfg.z_channels, 2 * cfg.embed_dim, 1)

    def posterior(self, x):
        mean, logvar = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--kl-weight", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(MODELS, "fmnist-kl"))
    args = ap.parse_args()
    seed_all(args.seed)
    torch.set_num_threads(1)

    cfg = KLConfig(embed_dim=4, z_channels=4, ch=16, ch_mult=[1, 2], num_res_blocks=2, out_ch=1,
                   resolution=28, num_groups=8, latent_scale=1.0)
    model = KLAutoencoder(cfg)
    xtr, _ = fashion_mnist("train")
    xte, _ = fashion_mnist("t10k")
    xtr, xte = to_unit(xtr), to_unit(xte)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    log = Log(os.path.join(args.out, "train_log.jsonl"))
    n_dec = sum(p.numel() for k, p in model.state_dict().items()
                if k.startswith(("decoder.", "post_quant_conv.")))
    log(params=sum(p.numel() for p in model.parameters()), decoder_params=n_dec,
        kl_weight=args.kl_weight, **cfg.to_json())
    g = torch.Generator().manual_seed(args.seed)
    warm = min(100, args.steps // 10)
    for step in range(args.steps):
        c = math.cos(math.pi * step / args.steps)
        lr = args.lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + c)
        for pg in opt.param_groups:
            pg["lr"] = lr
        idx = torch.randint(0, xtr.size(0), (args.batch,), generator=g)
        x = xtr[idx]
        mean, logvar = model.posterior(x)
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=g)
        rec = model.decode_latent(z)
        loss_rec = F.l1_loss(rec, x) + F.mse_loss(rec, x)
        # KL(q(z|x) || N(0, I)), averaged over latent elements
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        loss = loss_rec + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log(step=step + 1, loss=round(loss.item(), 5), rec=round(loss_rec.item(), 5),
                kl=round(kl.item(), 4), post_std=round(torch.exp(0.5 * logvar).mean().item(), 4),
                lr=round(lr, 6))

    model.eval()
    with torch.no_grad():
        def means(x):
            return torch.cat([model.posterior(x[i:i + 500])[0] for i in range(0, x.size(0), 500)])
        mtr, mte = means(xtr), means(xte)
        se = 0.0
        for i in range(0, xte.size(0), 500):
            rec = model.decode_latent(mte[i:i + 500])
            # PSNR on the uint8 images a user sees (the engine's conversion)
            se += (to_uint8(rec).float() - to_uint8(xte[i:i + 500]).float()).pow(2).sum().item()
        psnr_te = 10 * math.log10(255.0 ** 2 / (se / xte.numel()))
        _, logvar = model.posterior(xtr[:2000])
    scale = 1.0 / mtr.std().item()
    mean_post_std = torch.exp(0.5 * logvar).mean().item()
    log(final=True, psnr_test_db=round(psnr_te, 3), latent_std=round(1.0 / scale, 5),
        latent_scale=round(scale, 5), posterior_std_mean=round(mean_post_std, 5))
    cfg.latent_scale = round(scale, 5)
    os.makedirs(WORK, exist_ok=True)
    torch.save({"train": mtr * cfg.latent_scale, "test": mte * cfg.latent_scale,
                "latent_scale": cfg.latent_scale}, os.path.join(WORK, "kl_latents.pt"))
    sd = model.state_dict()
    enc = {k: v.contiguous() for k, v in sd.items() if k.startswith(("encoder.", "quant_conv."))}
    save_file(enc, os.path.join(WORK, "kl_encoder.safetensors"))
    config = {**cfg.to_json(),
              "trained_on": "fashion-mnist train (60k), tools/train/train_kl.py",
              "psnr_test_db": round(psnr_te, 3)}
    save_model_dir(args.out, config, {k: v for k, v in sd.items()
                                      if k.startswith(("decoder.", "post_quant_conv."))})


if __name__ == "__main__":
    main()
