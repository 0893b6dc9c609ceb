"""Reference PyTorch models for imagegen: the LlamaGen class-conditional GPT, the LlamaGen
VQ decoder (and an encoder/quantiser for training), and the small Fashion-MNIST classifier.

This file is the Python side of the C++ parity tests (tools/parity.py) and is what the
training scripts in tools/train/ train. It follows shared/docs/models.md: tensor names are
LlamaGen's, so a converted official checkpoint loads here and in the C++ engine alike.
"""
import json
import math
import os
from dataclasses import dataclass, field, asdict
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------- GPT


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class GPTConfig:
    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    vocab_size: int = 16384
    num_classes: int = 1000
    block_size: int = 256          # number of image tokens (grid * grid)
    cls_token_num: int = 1
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    class_dropout_prob: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier:  # None or 0: unused
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    @property
    def grid(self) -> int:
        g = int(round(math.sqrt(self.block_size)))
        assert g * g == self.block_size
        return g


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_table_2d(grid: int, head_dim: int, base: float, cls_token_num: int) -> torch.Tensor:
    """[cls + grid^2, head_dim/2, 2] (cos, sin) in float32 as LlamaGen computes it; class rows
    are zeros (models.md 1.4)."""
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    ang = torch.outer(torch.arange(grid, dtype=torch.float32), freqs)  # [g, half/2]
    full = torch.cat([ang[:, None, :].expand(-1, grid, -1), ang[None, :, :].expand(grid, -1, -1)],
                     dim=-1)
    table = torch.stack([torch.cos(full), torch.sin(full)], dim=-1).reshape(grid * grid, half, 2)
    return torch.cat([torch.zeros(cls_token_num, half, 2), table], dim=0)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, hd]; table [S, hd/2, 2]; interleaved pairs (2j, 2j+1)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    t = table.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * t[..., 0] - xs[..., 1] * t[..., 1],
                       xs[..., 1] * t[..., 0] + xs[..., 0] * t[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, table, mask=None):
        b, s, d = x.shape
        q, k, v = self.wqkv(x).split([d, d, d], dim=-1)
        q = apply_rope(q.view(b, s, self.n_head, self.head_dim), table)
        k = apply_rope(k.view(b, s, self.n_head, self.head_dim), table)
        v = v.view(b, s, self.n_head, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(o.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.ffn_hidden
        self.w1 = nn.Linear(cfg.dim, h, bias=False)
        self.w3 = nn.Linear(cfg.dim, h, bias=False)
        self.w2 = nn.Linear(h, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, table, mask=None):
        h = x + self.attention(self.attention_norm(x), table, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class LabelEmbedder(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        extra = 1 if cfg.class_dropout_prob > 0 else 0
        self.embedding_table = nn.Embedding(cfg.num_classes + extra, cfg.dim)
        self.num_classes = cfg.num_classes
        self.dropout_prob = cfg.class_dropout_prob

    def forward(self, labels, train: bool):
        if train and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class GPT(nn.Module):
    """LlamaGen c2i GPT. forward(labels, tokens) returns logits for every image token."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.cls_embedding = LabelEmbedder(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis", rope_table_2d(cfg.grid, cfg.head_dim, cfg.rope_base, cfg.cls_token_num),
            persistent=False)
        self.apply(self._init)
        nn.init.zeros_(self.output.weight)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, labels, tokens, train: bool = False):
        """labels [B]; tokens [B, n] with n <= block_size. Feeds class + tokens[:, :-1]... the
        prefix of length n (class then tokens[:, :n-1]) and returns logits [B, n, V] where
        logits[:, i] predicts image token i."""
        cond = self.cls_embedding(labels, train)[:, None, :]
        x = torch.cat([cond, self.tok_embeddings(tokens[:, :-1])], dim=1)
        table = self.freqs_cis[: x.size(1)]
        for layer in self.layers:
            x = layer(x, table)
        return self.output(self.norm(x)).float()

    def forward_sequence(self, labels, prefix):
        """labels [B]; prefix [B, m] image tokens (m may be 0). Feeds class + all of prefix and
        returns logits [B, m+1, V] (position p predicts image token p)."""
        cond = self.cls_embedding(labels, False)[:, None, :]
        x = torch.cat([cond, self.tok_embeddings(prefix)], dim=1)
        table = self.freqs_cis[: x.size(1)]
        for layer in self.layers:
            x = layer(x, table)
        return self.output(self.norm(x)).float()


# ----------------------------------------------------------------------------- VQ


@dataclass
class VQConfig:
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    z_channels: int = 256
    ch: int = 128
    ch_mult: List[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    in_channels: int = 3
    out_channels: int = 3
    num_groups: int = 32
    image_size: int = 256

    @property
    def grid(self) -> int:
        return self.image_size // (2 ** (len(self.ch_mult) - 1))


def norm(c, groups):
    return nn.GroupNorm(groups, c, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout, groups):
        super().__init__()
        self.norm1, self.conv1 = norm(cin, groups), nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2, self.conv2 = norm(cout, groups), nn.Conv2d(cout, cout, 3, 1, 1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)
        self.cin, self.cout = cin, cout

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        if self.cin != self.cout:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    def __init__(self, c, groups):
        super().__init__()
        self.norm = norm(c, groups)
        self.q, self.k, self.v = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.norm(x)
        q = self.q(y).reshape(b, c, h * w).transpose(1, 2)
        k = self.k(y).reshape(b, c, h * w)
        v = self.v(y).reshape(b, c, h * w)
        a = torch.softmax(torch.bmm(q, k) * (c ** -0.5), dim=2)       # [b, hw(q), hw(k)]
        o = torch.bmm(v, a.transpose(1, 2)).reshape(b, c, h, w)
        return x + self.proj_out(o)


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 2, 0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        g = cfg.num_groups
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, 3, 1, 1)
        mult = [1] + list(cfg.ch_mult)
        self.conv_blocks = nn.ModuleList()
        n = len(cfg.ch_mult)
        for i in range(n):
            blk = nn.Module()
            cin, cout = cfg.ch * mult[i], cfg.ch * mult[i + 1]
            blk.res = nn.ModuleList()
            blk.attn = nn.ModuleList()
            for _ in range(cfg.num_res_blocks):
                blk.res.append(ResnetBlock(cin, cout, g))
                cin = cout
                if i == n - 1:
                    blk.attn.append(AttnBlock(cout, g))
            if i != n - 1:
                blk.downsample = Downsample(cout)
            self.conv_blocks.append(blk)
        c = cfg.ch * cfg.ch_mult[-1]
        self.mid = nn.ModuleList([ResnetBlock(c, c, g), AttnBlock(c, g), ResnetBlock(c, c, g)])
        self.norm_out = norm(c, g)
        self.conv_out = nn.Conv2d(c, cfg.z_channels, 3, 1, 1)

    def forward(self, x):
        h = self.conv_in(x)
        for i, blk in enumerate(self.conv_blocks):
            for j, r in enumerate(blk.res):
                h = r(h)
                if len(blk.attn) > 0:
                    h = blk.attn[j](h)
            if hasattr(blk, "downsample"):
                h = blk.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """LlamaGen VQ-16 decoder structure; conv_blocks lowest resolution first, attention
    blocks only at the lowest-resolution level (models.md section 2)."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        g = cfg.num_groups
        n = len(cfg.ch_mult)
        c = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, c, 3, 1, 1)
        self.mid = nn.ModuleList([ResnetBlock(c, c, g), AttnBlock(c, g), ResnetBlock(c, c, g)])
        self.conv_blocks = nn.ModuleList()
        for i in range(n):
            blk = nn.Module()
            cout = cfg.ch * cfg.ch_mult[n - 1 - i]
            blk.res = nn.ModuleList()
            blk.attn = nn.ModuleList()
            for _ in range(cfg.num_res_blocks + 1):
                blk.res.append(ResnetBlock(c, cout, g))
                c = cout
                if i == 0:
                    blk.attn.append(AttnBlock(c, g))
            if i != n - 1:
                blk.upsample = Upsample(c)
            self.conv_blocks.append(blk)
        self.norm_out = norm(c, g)
        self.conv_out = nn.Conv2d(c, cfg.out_channels, 3, 1, 1)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for blk in self.conv_blocks:
            for j, r in enumerate(blk.res):
                h = r(h)
                if len(blk.attn) > 0:
                    h = blk.attn[j](h)
            if hasattr(blk, "upsample"):
                h = blk.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_embed_dim)
        nn.init.uniform_(self.embedding.weight, -1.0 / cfg.codebook_size, 1.0 / cfg.codebook_size)
        self.l2 = cfg.codebook_l2_norm

    def codebook(self):
        w = self.embedding.weight
        return F.normalize(w, p=2, dim=-1) if self.l2 else w

    def forward(self, z):
        """z [B, C, h, w] -> (quantised with straight-through, ids [B, h*w], losses)."""
        b, c, h, w = z.shape
        zf = z.permute(0, 2, 3, 1).reshape(-1, c)
        if self.l2:
            zf = F.normalize(zf, p=2, dim=-1)
        cb = self.codebook()
        d = zf.pow(2).sum(1, keepdim=True) - 2 * zf @ cb.t() + cb.pow(2).sum(1)[None]
        ids = d.argmin(1)
        zq = cb[ids]
        commit = F.mse_loss(zf, zq.detach())
        vq = F.mse_loss(zq, zf.detach())
        zq = zf + (zq - zf).detach()
        zq = zq.view(b, h, w, c).permute(0, 3, 1, 2)
        return zq, ids.view(b, h * w), vq, commit, zf


class VQModel(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.z_channels, 1)

    def encode(self, x):
        return self.quantize(self.quant_conv(self.encoder(x)))

    def decode_code(self, ids):
        """ids [B, grid*grid] -> image [B, out_channels, H, W] in about [-1, 1]."""
        g = self.cfg.grid
        z = self.quantize.codebook()[ids].view(ids.size(0), g, g, -1).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(z))

    def forward(self, x):
        zq, ids, vq, commit, _ = self.encode(x)
        return self.decoder(self.post_quant_conv(zq)), ids, vq, commit


def to_uint8(img: torch.Tensor) -> torch.Tensor:
    """LlamaGen's eval conversion: clamp(127.5 x + 128, 0, 255), truncated to uint8."""
    return torch.clamp(127.5 * img + 128.0, 0, 255).to(torch.uint8)


# ----------------------------------------------------------------------------- classifier


class Classifier(nn.Module):
    """Small CNN for 28x28 grey images; features() is the penultimate layer used for the
    Frechet distance. Input: uint8-valued float image scaled to [0, 1]."""

    def __init__(self, width: int = 32, feat: int = 64, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, 1, 1)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1)
        self.conv3 = nn.Conv2d(width, 2 * width, 3, 1, 1)
        self.conv4 = nn.Conv2d(2 * width, 2 * width, 3, 1, 1)
        self.fc1 = nn.Linear(2 * width * 7 * 7, feat)
        self.fc2 = nn.Linear(feat, num_classes)

    def features(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        x = F.max_pool2d(F.relu(self.conv4(x)), 2)
        return F.relu(self.fc1(x.flatten(1)))

    def forward(self, x):
        return self.fc2(self.features(x))


def frechet_distance(mu1, s1, mu2, s2) -> float:
    """|mu1-mu2|^2 + tr(s1 + s2 - 2 (s1^1/2 s2 s1^1/2)^1/2), in float64."""
    mu1, s1, mu2, s2 = (torch.as_tensor(t, dtype=torch.float64) for t in (mu1, s1, mu2, s2))
    ev, evec = torch.linalg.eigh(s1)
    r1 = evec @ torch.diag(ev.clamp_min(0).sqrt()) @ evec.t()
    m = r1 @ s2 @ r1
    tr_sqrt = torch.linalg.eigvalsh((m + m.t()) / 2).clamp_min(0).sqrt().sum()
    return float((mu1 - mu2).pow(2).sum() + torch.trace(s1) + torch.trace(s2) - 2 * tr_sqrt)


# ----------------------------------------------------------------------------- I/O


def save_model_dir(path: str, config: dict, tensors: dict):
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))


def load_tensors(path: str) -> dict:
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def load_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


GPT_KEYS = ["dim", "n_layer", "n_head", "vocab_size", "num_classes", "block_size",
            "cls_token_num", "multiple_of", "ffn_dim_multiplier", "rope_base", "norm_eps",
            "class_dropout_prob"]
VQ_KEYS = ["codebook_size", "codebook_embed_dim", "codebook_l2_norm", "z_channels", "ch",
           "ch_mult", "num_res_blocks", "in_channels", "out_channels", "num_groups", "image_size"]


def gpt_from_dir(path: str) -> GPT:
    c = load_config(path)
    m = GPT(GPTConfig(**{k: c[k] for k in GPT_KEYS if k in c}))
    m.load_state_dict(load_tensors(path), strict=True)
    return m.eval()


def vq_from_dir(path: str) -> VQModel:
    c = load_config(path)
    m = VQModel(VQConfig(**{k: c[k] for k in VQ_KEYS if k in c}))
    sd = load_tensors(path)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith("encoder.") or k.startswith("quant_conv.") for k in missing), missing
    return m.eval()
