"""Train the bundled Fashion-MNIST classifier used to score generated images, and store the
reference statistics of real test images: accuracy and the mean/covariance of the penultimate
features (for the Frechet distance), so that scoring needs no dataset at run time."""
import argparse
import os

import torch
import torch.nn.functional as F

from common import CLASS_NAMES, MODELS, Log, fashion_mnist, seed_all
from imagegen_ref import Classifier, frechet_distance, save_model_dir


def unit(x):
    return x.float()[:, None] / 255.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(MODELS, "fmnist-classifier"))
    args = ap.parse_args()
    seed_all(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    xtr, ytr = fashion_mnist("train")
    xte, yte = fashion_mnist("t10k")
    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    log = Log(os.path.join(args.out, "train_log.jsonl"))
    g = torch.Generator().manual_seed(args.seed)
    n = xtr.size(0)
    steps = args.epochs * (n // args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps)
    step = 0
    for ep in range(args.epochs):
        perm = torch.randperm(n, generator=g)
        model.train()
        for i in range(0, n - args.batch + 1, args.batch):
            b = perm[i:i + args.batch]
            x = unit(xtr[b])
            # light augmentation: random horizontal flip (Fashion-MNIST items are symmetric)
            flip = torch.rand(x.size(0), generator=g) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
            loss = F.cross_entropy(model(x), ytr[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                log(epoch=ep, step=step, loss=round(loss.item(), 4))
    model.eval()
    with torch.no_grad():
        def feats_logits(x):
            fs, ls = [], []
            for i in range(0, x.size(0), 1000):
                f = model.features(unit(x[i:i + 1000]))
                fs.append(f)
                ls.append(model.fc2(f))
            return torch.cat(fs).double(), torch.cat(ls)
        fte, lte = feats_logits(xte)
        acc = (lte.argmax(1) == yte).float().mean().item()
        ftr, _ = feats_logits(xtr[:10000])
    mu, cov = fte.mean(0), torch.cov(fte.t())
    fd_train = frechet_distance(ftr.mean(0), torch.cov(ftr.t()), mu, cov)
    log(final=True, test_accuracy=round(acc, 4), fd_train10k_vs_test=round(fd_train, 4))
    tensors = dict(model.state_dict())
    tensors["reference.test_feature_mean"] = mu
    tensors["reference.test_feature_cov"] = cov
    config = {"type": "fmnist-classifier", "width": 32, "features": 64, "num_classes": 10,
              "class_names": CLASS_NAMES, "input": "uint8 grey 28x28 scaled to [0,1]",
              "test_accuracy": round(acc, 4), "fd_train10k_vs_test": round(fd_train, 4)}
    save_model_dir(args.out, config, tensors)


if __name__ == "__main__":
    main()
