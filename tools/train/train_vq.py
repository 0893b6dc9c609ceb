"""Train the bundled VQ tokenizer on Fashion-MNIST: 28x28 grey -> 14x14 tokens, 512 codes.

LlamaGen VQ structure (tools/imagegen_ref.py) at a small width. Loss: L1 + L2 on pixels,
codebook + 0.25 commitment (l2-normalised codes as in LlamaGen), and dead-code restarts so the
codebook is used. Writes models/fmnist-vq/ and the token grids of the train and test sets to
$IMAGEGEN_TRAIN_DIR for the GPT scripts.
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F

from common import MODELS, WORK, Log, fashion_mnist, seed_all, to_unit
from imagegen_ref import VQConfig, VQModel, save_model_dir, to_uint8
from dataclasses import asdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(MODELS, "fmnist-vq"))
    args = ap.parse_args()
    seed_all(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    cfg = VQConfig(codebook_size=512, codebook_embed_dim=8, codebook_l2_norm=True, z_channels=32,
                   ch=16, ch_mult=[1, 2], num_res_blocks=1, in_channels=1, out_channels=1,
                   num_groups=8, image_size=28)
    model = VQModel(cfg)
    xtr, _ = fashion_mnist("train")
    xte, _ = fashion_mnist("t10k")
    xtr, xte = to_unit(xtr), to_unit(xte)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    log = Log(os.path.join(args.out, "train_log.jsonl"))
    g = torch.Generator().manual_seed(args.seed)
    usage = torch.zeros(cfg.codebook_size)
    for step in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for pg in opt.param_groups:
            pg["lr"] = lr
        idx = torch.randint(0, xtr.size(0), (args.batch,), generator=g)
        x = xtr[idx]
        zq, ids, vq, commit, zf = model.encode(x)
        rec = model.decoder(model.post_quant_conv(zq))
        loss_rec = F.l1_loss(rec, x) + F.mse_loss(rec, x)
        loss = loss_rec + vq + 0.25 * commit
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        usage += torch.bincount(ids.flatten(), minlength=cfg.codebook_size).float()
        if (step + 1) % 100 == 0 and step < args.steps * 0.8:
            # Restart codes unused in the last 100 steps at random encoder outputs.
            dead = (usage == 0).nonzero().flatten()
            if len(dead) > 0:
                pick = torch.randint(0, zf.size(0), (len(dead),), generator=g)
                with torch.no_grad():
                    model.quantize.embedding.weight[dead] = zf.detach()[pick]
            log(step=step + 1, loss=round(loss.item(), 5), rec=round(loss_rec.item(), 5),
                lr=round(lr, 6), dead_restarted=int(len(dead)))
            usage.zero_()
        elif (step + 1) % 100 == 0:
            log(step=step + 1, loss=round(loss.item(), 5), rec=round(loss_rec.item(), 5),
                lr=round(lr, 6))

    model.eval()
    with torch.no_grad():
        def tokens_and_psnr(x):
            ids_all, se = [], 0.0
            for i in range(0, x.size(0), 1000):
                zq, ids, *_ = model.encode(x[i:i + 1000])
                rec = model.decoder(model.post_quant_conv(zq))
                # PSNR on the uint8 images a user sees.
                a = to_uint8(rec).float()
                b = to_uint8(x[i:i + 1000]).float()
                se += (a - b).pow(2).sum().item()
                ids_all.append(ids)
            mse = se / x.numel()
            return torch.cat(ids_all), 10 * math.log10(255.0 ** 2 / mse)
        ids_tr, psnr_tr = tokens_and_psnr(xtr)
        ids_te, psnr_te = tokens_and_psnr(xte)
    used = int((torch.bincount(ids_tr.flatten(), minlength=cfg.codebook_size) > 0).sum())
    log(final=True, psnr_test_db=round(psnr_te, 3), psnr_train_db=round(psnr_tr, 3),
        codes_used=used)
    os.makedirs(WORK, exist_ok=True)
    torch.save({"train": ids_tr.to(torch.int16), "test": ids_te.to(torch.int16)},
               os.path.join(WORK, "tokens.pt"))
    config = {"type": "llamagen-vq", **asdict(cfg),
              "trained_on": "fashion-mnist train (60k), tools/train/train_vq.py",
              "psnr_test_db": round(psnr_te, 3), "codes_used": used}
    save_model_dir(args.out, config, model.state_dict())


if __name__ == "__main__":
    main()
