"""Reference PyTorch model for MAR (masked autoregressive generation with a diffusion head over
continuous tokens) and the KL-16 autoencoder decoder that turns its tokens into pixels.

Written from shared/docs/models.md section 3 and algorithms.md section 6; plain torch, no
timm. Tensor names are MAR's and the LDM AutoencoderKL's, so a checkpoint converted by
tools/convert_mar.py loads here with strict=True and in the C++ engine alike. This file is the
Python side of the MAR parity tests (tools/parity.py).

Noise is always passed in from outside (x_T and the per-step eps), so the C++ engine and this
reference can be compared step for step, and a draft and a target model can share trajectories
(continuous speculative decoding).
"""
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-6
GN_EPS = 1e-6
TRAIN_STEPS = 1000

# ----------------------------------------------------------------------------- config


def default_sampling() -> dict:
    return {"num_iter": 64, "cfg_scale": 1.0, "cfg_schedule": "linear", "temperature": 1.0}


@dataclass
class MARConfig:
    type: str = "mar"
    img_size: int = 256
    vae_stride: int = 16
    patch_size: int = 1
    vae_embed_dim: int = 16
    class_num: int = 1000
    buffer_size: int = 64
    encoder_embed_dim: int = 1024
    encoder_depth: int = 16
    encoder_num_heads: int = 16
    decoder_embed_dim: int = 1024
    decoder_depth: int = 16
    decoder_num_heads: int = 16
    mlp_ratio: float = 4.0
    diffloss_d: int = 3
    diffloss_w: int = 1024
    num_sampling_steps: str = "100"
    vae: str = "kl16"
    draft_model: Optional[str] = None
    class_names: List[str] = field(default_factory=list)
    sampling_defaults: dict = field(default_factory=default_sampling)

    @property
    def seq_h(self) -> int:
        return self.img_size // self.vae_stride // self.patch_size

    @property
    def seq_len(self) -> int:
        return self.seq_h * self.seq_h

    @property
    def token_embed_dim(self) -> int:
        return self.vae_embed_dim * self.patch_size ** 2

    def to_json(self) -> dict:
        d = asdict(self)
        if d["draft_model"] is None:
            del d["draft_model"]
        d["mlp_ratio"] = float(d["mlp_ratio"])
        d["num_sampling_steps"] = str(d["num_sampling_steps"])
        return d

    @staticmethod
    def from_json(d: dict) -> "MARConfig":
        if d.get("type", "mar") != "mar":
            raise ValueError(f"config type {d.get('type')!r} is not 'mar'")
        known = {f for f in MARConfig.__dataclass_fields__}
        cfg = MARConfig(**{k: v for k, v in d.items() if k in known})
        cfg.num_sampling_steps = str(cfg.num_sampling_steps)
        cfg.mlp_ratio = float(cfg.mlp_ratio)
        return cfg


# ----------------------------------------------------------------------------- transformer


class Attention(nn.Module):
    """Fused qkv (with bias), bidirectional softmax attention, output projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        assert dim % heads == 0
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x):
        b, n, d = x.shape
        hd = d // self.heads
        # output channels of qkv are [q | k | v], each split into heads of hd channels
        qkv = self.qkv(x).view(b, n, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        # softmax(q k^T / sqrt(hd)) v, no mask
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.proj(o)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # exact erf GELU


class Block(nn.Module):
    """Pre-LN transformer block: x += attn(norm1(x)); x += mlp(norm2(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


# ----------------------------------------------------------------------------- DiffLoss head


def timestep_sinusoid(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """[cos | sin] of t * exp(-ln(1e4) * i / (dim/2)), i < dim/2, in float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    ang = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)


class TimeEmbed(nn.Module):
    def __init__(self, width: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t):
        return self.mlp(timestep_sinusoid(t, self.freq_dim).to(self.mlp[0].weight.dtype))


class AdaResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=LN_EPS)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x, y):
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        h = self.in_ln(x) * (1 + scale) + shift
        return x + gate * self.mlp(h)


class AdaFinal(nn.Module):
    def __init__(self, width: int, out: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(width, eps=LN_EPS, elementwise_affine=False)
        self.linear = nn.Linear(width, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x, y):
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class DiffHeadNet(nn.Module):
    """The SimpleMLPAdaLN noise predictor: (x [N,C], t [N] original timestep, c [N,Dd]) ->
    [N, 2C] = (eps | variance interpolation)."""

    def __init__(self, channels: int, width: int, depth: int, cond_dim: int):
        super().__init__()
        self.channels = channels
        self.time_embed = TimeEmbed(width)
        self.cond_embed = nn.Linear(cond_dim, width)
        self.input_proj = nn.Linear(channels, width)
        self.res_blocks = nn.ModuleList([AdaResBlock(width) for _ in range(depth)])
        self.final_layer = AdaFinal(width, 2 * channels)

    def forward(self, x, t, c):
        y = self.time_embed(t) + self.cond_embed(c)
        h = self.input_proj(x)
        for blk in self.res_blocks:
            h = blk(h, y)
        return self.final_layer(h, y)


class DiffLossHead(nn.Module):
    """Holds the net under the name `net` so the keys read `diffloss.net.*`."""

    def __init__(self, channels: int, width: int, depth: int, cond_dim: int):
        super().__init__()
        self.net = DiffHeadNet(channels, width, depth, cond_dim)


# ----------------------------------------------------------------------------- diffusion


def spaced_timesteps(total: int, spec: str) -> List[int]:
    """The kept timesteps for a respacing spec such as "100" or "25,25,50" (sections of equal
    size, each strided evenly with rounding; "ddimN" = a fixed integer stride)."""
    spec = str(spec)
    if spec.startswith("ddim"):
        want = int(spec[4:])
        for stride in range(1, total):
            if len(range(0, total, stride)) == want:
                return list(range(0, total, stride))
        raise ValueError(f"cannot take {want} steps from {total} with an integer stride")
    counts = [int(s) for s in spec.split(",")]
    base, extra = divmod(total, len(counts))
    kept, start = [], 0
    for i, n in enumerate(counts):
        size = base + (1 if i < extra else 0)
        if size < n:
            raise ValueError(f"cannot take {n} steps from a section of {size}")
        stride = 1 if n <= 1 else (size - 1) / (n - 1)
        pos = 0.0
        for _ in range(n):
            kept.append(start + round(pos))
            pos += stride
        start += size
    return sorted(set(kept))


class SpacedCosineDiffusion:
    """Cosine-schedule DDPM (1000 training steps) respaced to `spec`, LEARNED_RANGE variance,
    eps prediction, no clipping. Tables are computed in float64 and used as float32."""

    def __init__(self, spec: str = "100", total: int = TRAIN_STEPS):
        def abar(s):
            return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = [min(1 - abar((i + 1) / total) / abar(i / total), 0.999) for i in range(total)]
        acp, run = [], 1.0
        for b in betas:
            run *= 1.0 - b
            acp.append(run)
        self.timestep_map = spaced_timesteps(total, spec)
        kept = set(self.timestep_map)
        sb, last = [], 1.0
        for i, a in enumerate(acp):
            if i in kept:
                sb.append(1.0 - a / last)
                last = a
        # the spaced process, rebuilt from its own betas (as a fresh diffusion would be)
        n = len(sb)
        alphas = [1.0 - b for b in sb]
        cp, run = [], 1.0
        for a in alphas:
            run *= a
            cp.append(run)
        cp_prev = [1.0] + cp[:-1]
        post_var = [sb[i] * (1.0 - cp_prev[i]) / (1.0 - cp[i]) for i in range(n)]
        post_logvar = [math.log(post_var[1] if i == 0 else post_var[i]) for i in range(n)]
        t64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        self.num_steps = n
        self.betas = t64(sb)
        self.alphas_cumprod = t64(cp)
        tab = {
            "sqrt_recip": [math.sqrt(1.0 / cp[i]) for i in range(n)],
            "sqrt_recipm1": [math.sqrt(1.0 / cp[i] - 1.0) for i in range(n)],
            "coef1": [sb[i] * math.sqrt(cp_prev[i]) / (1.0 - cp[i]) for i in range(n)],
            "coef2": [(1.0 - cp_prev[i]) * math.sqrt(alphas[i]) / (1.0 - cp[i]) for i in range(n)],
            "min_log": post_logvar,
            "max_log": [math.log(b) for b in sb],
        }
        self.f32 = {k: t64(v).float() for k, v in tab.items()}  # the float32 the sampler uses

    def step_tables(self, i: int):
        return {k: v[i] for k, v in self.f32.items()}


# ----------------------------------------------------------------------------- MAR


class MAR(nn.Module):
    def __init__(self, cfg: MARConfig):
        super().__init__()
        self.cfg = cfg
        de, dd, c = cfg.encoder_embed_dim, cfg.decoder_embed_dim, cfg.token_embed_dim
        total = cfg.seq_len + cfg.buffer_size
        self.class_emb = nn.Embedding(cfg.class_num, de)
        self.fake_latent = nn.Parameter(torch.zeros(1, de))
        self.z_proj = nn.Linear(c, de)
        self.z_proj_ln = nn.LayerNorm(de, eps=LN_EPS)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, total, de))
        self.encoder_blocks = nn.ModuleList(
            [Block(de, cfg.encoder_num_heads, cfg.mlp_ratio) for _ in range(cfg.encoder_depth)])
        self.encoder_norm = nn.LayerNorm(de, eps=LN_EPS)
        self.decoder_embed = nn.Linear(de, dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dd))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, total, dd))
        self.decoder_blocks = nn.ModuleList(
            [Block(dd, cfg.decoder_num_heads, cfg.mlp_ratio) for _ in range(cfg.decoder_depth)])
        self.decoder_norm = nn.LayerNorm(dd, eps=LN_EPS)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, cfg.seq_len, dd))
        self.diffloss = DiffLossHead(c, cfg.diffloss_w, cfg.diffloss_d, dd)
        self.diffusion = SpacedCosineDiffusion(cfg.num_sampling_steps)

    # -- transformer

    def class_embedding(self, labels: torch.Tensor) -> torch.Tensor:
        """labels [B] int64; label == class_num selects the null condition fake_latent."""
        null = labels == self.cfg.class_num
        emb = self.class_emb(torch.where(null, torch.zeros_like(labels), labels))
        return torch.where(null[:, None], self.fake_latent.expand_as(emb), emb)

    def forward_mae(self, tokens, mask, labels):
        """tokens [B,S,C]; mask [B,S] float, 1 = unknown; labels [B]. Every row must have the
        same number of known tokens. Returns the diffusion conditions z [B,S,Dd]."""
        cfg = self.cfg
        b, s, _ = tokens.shape
        nb = cfg.buffer_size
        keep = torch.cat([torch.ones(b, nb, dtype=torch.bool, device=mask.device),
                          mask == 0], dim=1)                                     # [B, nb+S]
        counts = keep.sum(1)
        if not bool((counts == counts[0]).all()):
            raise ValueError("forward_mae: rows have different numbers of known tokens")
        x = self.z_proj(tokens)
        cls = self.class_embedding(labels)[:, None, :].expand(b, nb, x.size(-1))
        x = torch.cat([cls, x], dim=1)
        x = self.z_proj_ln(x + self.encoder_pos_embed_learned)
        x = x[keep].view(b, -1, x.size(-1))                  # buffer + known tokens, in order
        for blk in self.encoder_blocks:
            x = blk(x)
        x = self.encoder_norm(x)

        x = self.decoder_embed(x)
        full = self.mask_token.expand(b, nb + s, x.size(-1)).clone()
        full[keep] = x.reshape(-1, x.size(-1))
        x = full + self.decoder_pos_embed_learned
        for blk in self.decoder_blocks:
            x = blk(x)
        x = self.decoder_norm(x)
        return x[:, nb:] + self.diffusion_pos_embed_learned

    # -- diffusion head

    def head(self, x, t_orig, c):
        """x [N,C], t_orig [N] int64 (original 0..999 timestep), c [N,Dd] -> [N, 2C]."""
        return self.diffloss.net(x, t_orig, c)

    def sample_head(self, z_cond, z_uncond, x_T, eps, temperature: float, cfg: float,
                    final_noise: bool = False) -> dict:
        """Reverse diffusion for N tokens with external noise.

        z_cond [N,Dd]; z_uncond [N,Dd] or None (no guidance); x_T [N,C]; eps [N,S,C] where
        eps[:, i] is the noise added at spaced index i (i runs S-1 .. 0; eps[:, 0] only with
        final_noise). With guidance the uncond condition is evaluated at the cond x, eps is
        eps_u + cfg * (eps_c - eps_u) and the variance channels are the cond row's.
        Returns x0, mean0 (the i = 0 posterior mean), std0 = exp(0.5 logvar_0) * temperature
        and acc_logstd = sum over i >= 1 of (0.5 logvar_i + log temperature), all [N,C]."""
        d = self.diffusion
        n, ch = x_T.shape
        assert eps.shape == (n, d.num_steps, ch), (eps.shape, d.num_steps)
        guided = z_uncond is not None
        cond = torch.cat([z_cond, z_uncond], 0) if guided else z_cond
        log_temp = math.log(temperature)
        x = x_T
        acc = torch.zeros(n, ch, dtype=x_T.dtype, device=x_T.device)
        mean = logvar = None
        for i in range(d.num_steps - 1, -1, -1):
            tab = d.step_tables(i)
            t = torch.full((cond.size(0),), d.timestep_map[i], dtype=torch.int64,
                           device=x_T.device)
            out = self.head(torch.cat([x, x], 0) if guided else x, t, cond)
            e, v = out[:n, :ch], out[:n, ch:]
            if guided:
                e_u = out[n:, :ch]
                e = e_u + cfg * (e - e_u)
            frac = (v + 1) / 2
            logvar = frac * tab["max_log"] + (1 - frac) * tab["min_log"]
            x0 = tab["sqrt_recip"] * x - tab["sqrt_recipm1"] * e
            mean = tab["coef1"] * x0 + tab["coef2"] * x
            if i > 0:
                x = mean + torch.exp(0.5 * logvar) * eps[:, i] * temperature
                acc = acc + (0.5 * logvar + log_temp)
        std0 = torch.exp(0.5 * logvar) * temperature
        x_out = mean + std0 * eps[:, 0] if final_noise else mean
        return {"x0": x_out, "mean0": mean, "std0": std0, "acc_logstd": acc}

    # -- the MAR loop

    @staticmethod
    def cfg_for_step(cfg: float, schedule: str, mask_len: int, seq_len: int) -> float:
        """The guidance scale of one step, computed in float32 as MAR does (Muse's linear
        schedule in the number of tokens known after the step)."""
        if schedule == "constant":
            return float(cfg)
        if schedule != "linear":
            raise ValueError(f"unknown cfg schedule {schedule!r}")
        ml = torch.tensor([float(mask_len)], dtype=torch.float32)
        return float((1 + (cfg - 1) * (seq_len - ml) / seq_len)[0])

    @staticmethod
    def mask_len_for_step(step: int, num_iter: int, seq_len: int, unknown: int) -> int:
        """How many tokens stay unknown after step `step` (0-based)."""
        ratio = math.cos(math.pi / 2.0 * (step + 1) / num_iter)
        return int(max(1, min(unknown - 1, math.floor(seq_len * ratio))))

    def sample_tokens(self, labels, num_iter: int, cfg: float, cfg_schedule: str,
                      temperature: float, orders, x_T, eps, final_noise: bool = False):
        """labels [B]; orders [B,S] int64 permutations; x_T [B,S,C]; eps [B,S,steps,C]; the
        token at position j of row b uses x_T[b, j] and eps[b, j]. Returns tokens [B,S,C]."""
        c = self.cfg
        b, s = orders.shape
        ch = c.token_embed_dim
        tokens = torch.zeros(b, s, ch, dtype=x_T.dtype, device=x_T.device)
        mask = torch.ones(b, s, device=x_T.device)
        guided = cfg != 1.0
        null = torch.full_like(labels, c.class_num)
        for step in range(num_iter):
            if guided:
                z = self.forward_mae(torch.cat([tokens, tokens]), torch.cat([mask, mask]),
                                     torch.cat([labels, null]))
            else:
                z = self.forward_mae(tokens, mask, labels)
            unknown = int(mask[0].sum().item())
            mask_len = self.mask_len_for_step(step, num_iter, s, unknown)
            mask_next = torch.zeros_like(mask)
            mask_next.scatter_(1, orders[:, :mask_len], 1.0)
            if step >= num_iter - 1:
                to_pred = mask.bool()
            else:
                to_pred = mask.bool() ^ mask_next.bool()
            mask = mask_next
            cfg_iter = self.cfg_for_step(cfg, cfg_schedule, mask_len, s)
            zc = z[:b][to_pred]
            zu = z[b:][to_pred] if guided else None
            out = self.sample_head(zc, zu, x_T[to_pred], eps[to_pred], temperature, cfg_iter,
                                   final_noise)
            tokens = tokens.clone()
            tokens[to_pred] = out["x0"]
        return tokens

    def unpatchify(self, tokens):
        return unpatchify(tokens, self.cfg.patch_size, self.cfg.vae_embed_dim)


def unpatchify(tokens: torch.Tensor, patch_size: int, channels: int) -> torch.Tensor:
    """[B, h*w, channels*p*p] (channel-major inside a patch) -> [B, channels, h*p, w*p]."""
    b, s, _ = tokens.shape
    h = int(round(math.sqrt(s)))
    assert h * h == s
    p = patch_size
    x = tokens.reshape(b, h, h, channels, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels, h * p, h * p)


# ----------------------------------------------------------------------------- KL decoder


@dataclass
class KLConfig:
    type: str = "kl-autoencoder"
    embed_dim: int = 16
    z_channels: int = 16
    ch: int = 128
    ch_mult: List[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    out_ch: int = 3
    resolution: int = 256
    num_groups: int = 32
    latent_scale: float = 0.2325

    @property
    def latent_size(self) -> int:
        return self.resolution // 2 ** (len(self.ch_mult) - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ch_mult"] = list(d["ch_mult"])
        return d

    @staticmethod
    def from_json(d: dict) -> "KLConfig":
        if d.get("type", "kl-autoencoder") != "kl-autoencoder":
            raise ValueError(f"config type {d.get('type')!r} is not 'kl-autoencoder'")
        known = {f for f in KLConfig.__dataclass_fields__}
        return KLConfig(**{k: v for k, v in d.items() if k in known})


def swish(x):
    return x * torch.sigmoid(x)  # as the LDM code writes it (F.silu rounds differently)


def group_norm(c: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, c, eps=GN_EPS, affine=True)


class KLResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.norm1 = group_norm(cin, groups)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2 = group_norm(cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.shortcut = cin != cout
        if self.shortcut:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        return (self.nin_shortcut(x) if self.shortcut else x) + h


class KLAttn(nn.Module):
    def __init__(self, c: int, groups: int):
        super().__init__()
        self.norm = group_norm(c, groups)
        self.q = nn.Conv2d(c, c, 1)
        self.k = nn.Conv2d(c, c, 1)
        self.v = nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.norm(x)
        q = self.q(y).flatten(2).transpose(1, 2)                     # [b, hw, c]
        k = self.k(y).flatten(2)                                     # [b, c, hw]
        v = self.v(y).flatten(2)                                     # [b, c, hw]
        a = torch.softmax(torch.bmm(q, k) * c ** -0.5, dim=-1)       # [b, hw_q, hw_k]
        o = torch.bmm(v, a.transpose(1, 2)).view(b, c, h, w)
        return x + self.proj_out(o)


class KLUpsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class KLDecoderNet(nn.Module):
    """The LDM decoder: conv_in, mid (res, attn, res), then the levels from the lowest
    resolution (up.{n-1}) to the highest (up.0), each with num_res_blocks + 1 res blocks and,
    except level 0, an upsample; then norm_out, swish, conv_out."""

    def __init__(self, cfg: KLConfig):
        super().__init__()
        g, n = cfg.num_groups, len(cfg.ch_mult)
        c = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, c, 3, 1, 1)
        self.mid = nn.Module()
        self.mid.block_1 = KLResBlock(c, c, g)
        self.mid.attn_1 = KLAttn(c, g)
        self.mid.block_2 = KLResBlock(c, c, g)
        levels = [None] * n
        for lvl in reversed(range(n)):
            up = nn.Module()
            cout = cfg.ch * cfg.ch_mult[lvl]
            blocks = []
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(KLResBlock(c, cout, g))
                c = cout
            up.block = nn.ModuleList(blocks)
            if lvl != 0:
                up.upsample = KLUpsample(c)
            levels[lvl] = up
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(c, g)
        self.conv_out = nn.Conv2d(c, cfg.out_ch, 3, 1, 1)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for lvl in reversed(range(len(self.up))):
            for blk in self.up[lvl].block:
                h = blk(h)
            if lvl != 0:
                h = self.up[lvl].upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class KLDecoder(nn.Module):
    def __init__(self, cfg: KLConfig):
        super().__init__()
        self.cfg = cfg
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)
        self.decoder = KLDecoderNet(cfg)

    def decode_latent(self, z):
        """z [B, embed_dim, h, w] (unscaled latent) -> image [B, out_ch, H, W]."""
        return self.decoder(self.post_quant_conv(z))

    def decode(self, tokens, patch_size: int = 1):
        """MAR tokens [B,S,C] -> image in about [-1, 1]: unpatchify, divide by latent_scale."""
        z = unpatchify(tokens, patch_size, self.cfg.embed_dim)
        return self.decode_latent(z / self.cfg.latent_scale)


def to_uint8(img: torch.Tensor) -> torch.Tensor:
    """MAR's conversion: y = (x + 1) / 2, then round(clip(y * 255, 0, 255)) (round half to
    even, as numpy). Returns [B, H, W, C] uint8 RGB."""
    y = (img.float() + 1) / 2
    v = torch.round(torch.clamp(y * 255, 0, 255)).to(torch.uint8)
    return v.permute(0, 2, 3, 1).contiguous()


# ----------------------------------------------------------------------------- random weights


def randomise_mar(model: MAR, seed: int):
    """Non-trivial random weights with a fixed generator: norms near 1, embeddings and
    positional tables ~0.02 N(0,1), linears ~N(0, 1/fan_in) (so activations keep their scale),
    biases small. The head's output layer is damped so the variance channels stay in range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if ("norm" in name or "_ln" in name) and name.endswith("weight"):
                p.copy_(1 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.02 * r)
            elif p.dim() == 2 and "class_emb" not in name and name != "fake_latent":
                p.copy_(r / math.sqrt(p.shape[1]))
            else:
                p.copy_(0.02 * r if "pos_embed" in name or name == "mask_token" else 0.5 * r)
        _structure_head(model.diffloss.net, g)


def _structure_head(net: DiffHeadNet, g: torch.Generator, bias: float = 100.0,
                    wobble: float = 0.01):
    """Random weights alone make a useless denoiser: MAR's cosine schedule ends at
    alpha_bar ~ 2.4e-9, so the first reverse step multiplies (x - eps_pred) by ~300 and an eps
    prediction unrelated to x sends the samples to ~1e4. So build a head that predicts
    eps ~= x (what a trained head does at high noise) plus small random t- and c-dependent
    terms, through the real architecture: input_proj copies +x and -x into 2C channels and puts
    large constant +-bias on the others, so the final LayerNorm's mean is 0 and its std is
    nearly independent of x (relative error ~ |x|^2 / (W bias^2)); the final linear undoes the
    std. The res blocks and the adaLN modulations add `wobble`-sized perturbations; the variance
    channels are random and O(0.3)."""
    ch, w = net.channels, net.input_proj.weight.shape[0]
    assert w >= 2 * ch + 2 and (w - 2 * ch) % 2 == 0, "head width too small to structure"
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    nb = w - 2 * ch
    net.input_proj.weight.zero_()
    net.input_proj.weight[:ch].copy_(torch.eye(ch))
    net.input_proj.weight[ch:2 * ch].copy_(-torch.eye(ch))
    net.input_proj.bias.zero_()
    net.input_proj.bias[2 * ch:].copy_(bias * torch.tensor([1.0, -1.0]).repeat(nb // 2))
    std = bias * math.sqrt(nb / w)
    for blk in net.res_blocks:
        mod = blk.adaLN_modulation[1]           # rows: shift | scale | gate
        mod.weight[2 * w:].mul_(wobble)
        mod.bias[2 * w:].mul_(wobble)
    fin = net.final_layer.adaLN_modulation[1]   # rows: shift | scale; the shift is scaled by std
    fin.weight[:w].mul_(wobble / std)
    fin.bias[:w].mul_(wobble / std)
    fin.weight[w:].mul_(wobble)
    fin.bias[w:].mul_(wobble)
    lin = net.final_layer.linear
    lin.weight[:ch].copy_(wobble / math.sqrt(w) * rnd(ch, w))
    lin.weight[:ch, :ch].add_(std * torch.eye(ch))
    lin.bias[:ch].copy_(wobble * rnd(ch))
    lin.weight[ch:].copy_(0.3 / math.sqrt(w) * rnd(ch, w))
    lin.bias[ch:].copy_(0.1 * rnd(ch))


def randomise_kl(model: KLDecoder, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.02 * r)
            else:
                fan_in = p[0].numel()
                p.copy_(r / math.sqrt(fan_in))


# ----------------------------------------------------------------------------- I/O


def _load_dir(path: str):
    from imagegen_ref import load_config, load_tensors
    return load_config(path), load_tensors(path)


def mar_from_dir(path: str) -> MAR:
    c, sd = _load_dir(path)
    m = MAR(MARConfig.from_json(c))
    m.load_state_dict(sd, strict=True)
    return m.eval()


def kl_from_dir(path: str) -> KLDecoder:
    c, sd = _load_dir(path)
    m = KLDecoder(KLConfig.from_json(c))
    m.load_state_dict(sd, strict=True)
    return m.eval()
