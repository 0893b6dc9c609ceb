"""Train a bundled LlamaGen c2i GPT on the VQ token grids of Fashion-MNIST.

  train_gpt.py --name fmnist-gpt   (target)   train_gpt.py --name fmnist-draft --draft (draft)

Next-token cross-entropy with class dropout 0.1 (the null class, for CFG), AdamW, cosine LR.
Needs $IMAGEGEN_TRAIN_DIR/tokens.pt from train_vq.py.
"""
import argparse
import os
from dataclasses import asdict

import torch
import torch.nn.functional as F

from common import (CLASS_NAMES, MODELS, WORK, Log, adamw, fashion_mnist, seed_all,
                    set_warmup_cosine_lr)
from imagegen_ref import GPT, GPTConfig, load_config, save_model_dir

PRESETS = {
    # name: (dim, n_layer, n_head)
    "target": (192, 6, 6),
    "draft": (96, 2, 3),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="fmnist-gpt")
    ap.add_argument("--preset", choices=PRESETS, default="target")
    ap.add_argument("--steps", type=int, default=1100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    seed_all(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    vq_cfg = load_config(os.path.join(MODELS, "fmnist-vq"))
    grid = vq_cfg["image_size"] // (2 ** (len(vq_cfg["ch_mult"]) - 1))
    dim, n_layer, n_head = PRESETS[args.preset]
    cfg = GPTConfig(dim=dim, n_layer=n_layer, n_head=n_head, vocab_size=vq_cfg["codebook_size"],
                    num_classes=10, block_size=grid * grid, multiple_of=64,
                    class_dropout_prob=0.1)
    model = GPT(cfg)
    toks = torch.load(os.path.join(WORK, "tokens.pt"))
    ttr, tte = toks["train"].long(), toks["test"].long()
    _, ytr = fashion_mnist("train")
    _, yte = fashion_mnist("t10k")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = adamw(decay, no_decay, args.lr, 0.05)
    out = os.path.join(MODELS, args.name)
    log = Log(os.path.join(out, "train_log.jsonl"))
    log(params=sum(p.numel() for p in model.parameters()), **{k: v for k, v in asdict(cfg).items()})
    g = torch.Generator().manual_seed(args.seed)
    warm = min(200, args.steps // 10)
    model.train()
    for step in range(args.steps):
        lr = set_warmup_cosine_lr(opt, step, args.steps, args.lr, warm)
        idx = torch.randint(0, ttr.size(0), (args.batch,), generator=g)
        x, y = ttr[idx], ytr[idx]
        logits = model(y, x, train=True)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), x.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            log(step=step + 1, loss=round(loss.item(), 4), lr=round(lr, 6))

    model.eval()
    with torch.no_grad():
        tot = 0.0
        for i in range(0, 2000, 250):
            lg = model(yte[i:i + 250], tte[i:i + 250])
            tot += F.cross_entropy(lg.reshape(-1, cfg.vocab_size), tte[i:i + 250].reshape(-1),
                                   reduction="sum").item()
        test_nll = tot / (2000 * cfg.block_size)
    log(final=True, test_nll_per_token=round(test_nll, 4))
    config = {"type": "llamagen-gpt", **asdict(cfg), "tokenizer": "fmnist-vq",
              "class_names": CLASS_NAMES,
              "sampling_defaults": {"cfg_scale": 2.0, "temperature": 1.0, "top_k": 0,
                                    "top_p": 1.0},
              "trained_on": f"fashion-mnist train, tools/train/train_gpt.py --preset {args.preset}",
              "test_nll_per_token": round(test_nll, 4)}
    del config["ffn_dim_multiplier"]
    save_model_dir(out, config, model.state_dict())


if __name__ == "__main__":
    main()
