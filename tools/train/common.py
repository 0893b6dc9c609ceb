"""Shared helpers for the training scripts: Fashion-MNIST from Debian's dataset-fashion-mnist,
seeding, logging."""
import gzip
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tools/

DATA_DIR = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
REPO = os.path.dirname(os.path.dirname(HERE))
MODELS = os.path.join(REPO, "models")
WORK = os.environ.get("IMAGEGEN_TRAIN_DIR", "/tmp/imagegen-train")

CLASS_NAMES = ["t-shirt", "trouser", "pullover", "dress", "coat",
               "sandal", "shirt", "sneaker", "bag", "ankle-boot"]


def read_idx(path: str) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist(split: str):
    """(images uint8 [N, 28, 28], labels int64 [N]) for split 'train' or 't10k'."""
    x = read_idx(os.path.join(DATA_DIR, f"{split}-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(DATA_DIR, f"{split}-labels-idx1-ubyte.gz"))
    return torch.from_numpy(x.copy()), torch.from_numpy(y.astype(np.int64))


def to_unit(x_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 28, 28] -> float [N, 1, 28, 28] in [-1, 1], the inverse of imagegen's
    uint8 conversion clamp(127.5 x + 128) with truncation (pixel centre at v + 0.5)."""
    return ((x_uint8.float() + 0.5 - 128.0) / 127.5)[:, None]


def adamw(decay, no_decay, lr: float, weight_decay: float):
    """AdamW (betas 0.9, 0.95) with weight decay on `decay` only (the GPT-style training)."""
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def set_warmup_cosine_lr(opt, step: int, steps: int, base_lr: float, warm: int) -> float:
    """Linear warm-up over `warm` steps times a cosine decay to 0 at `steps`; sets and returns
    the learning rate of `step`."""
    lr = base_lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
    for pg in opt.param_groups:
        pg["lr"] = lr
    return lr


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Log:
    """Prints and appends JSON lines to a log next to the model (committed with it)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.f = open(path, "w")
        self.t0 = time.time()

    def __call__(self, **kw):
        kw["t"] = round(time.time() - self.t0, 1)
        line = json.dumps(kw)
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()
