"""Train the bundled text-to-image model, fmnist-t2i: the Janus-Pro generation layout ("janus-gen")
at toy size, drawing the bundled fmnist-vq's codes from a caption.

  train_t2i.py [--steps 2000 --batch 64]      (about 35 minutes on 2 cores)
  train_t2i.py --eval-only                     (re-measure the committed model)

Captions carry more than the class. For each training image two attributes are measured:
brightness (the mean grey level of its object pixels, those above 20) and size (how many object
pixels), and each is ranked within the image's class: the lowest third is "dark" / "small", the
highest third "light" / "large", the middle third gets no word. A caption names the class and each
applicable word with probability 0.7 ("a small dark bag", "a photo of a light coat", "an ankle
boot"). 10% of the prompts are replaced by Janus's unconditional prompt (inner tokens set to the
pad id, tools/convert_janus.py), so classifier-free guidance works as Janus's own.

The text tokenizer is a byte-level BPE in DeepSeek-LLM's layout (tools/tokenizer_ref.py: its split
regexes, the chat template's special tokens, a BOS post-processor), trained here on the captions
plus tokenizer_ref's mixed corpus, saved as tokenizer.json; the prompt is the chat template
<|User|>: {caption}\\n\\n<|Assistant|>:<begin_of_image>, tokenized as the server does.

The model (names as tools/convert_janus.py writes them, so the engine loads it directly): token
embeddings for the prompt, gen_aligner(gen_embed(id)) for image tokens, LLaMA blocks (RMSNorm,
rotate-half 1-D RoPE over prompt then image positions, SwiGLU, no biases), gen_head (Linear,
GELU, Linear). At the end the script checks that its forward equals tools/janus_ref.py's (the
reference the engine is parity-tested against) on the trained weights, then measures what the
issue asks: class accuracy of prompts naming each class (the bundled classifier), and attribute
adherence (the measured brightness and size of images whose prompt names it vs its opposite),
and writes a sample grid to docs/img/fmnist_t2i_samples.png.
"""
import argparse
import json
import os
import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import (CLASS_NAMES, MODELS, REPO, WORK, Log, adamw, fashion_mnist, seed_all,
                    set_warmup_cosine_lr, to_unit)
from imagegen_ref import (Classifier, RMSNorm, load_config, load_tensors, save_model_dir,
                          to_uint8, vq_from_dir)
import janus_ref  # noqa: E402
import tokenizer_ref  # noqa: E402
from convert_janus import PAD_TAG, PROMPT_TEMPLATE  # noqa: E402

NAME = "fmnist-t2i"
# How each class is named in captions.
NOUNS = ["t-shirt", "pair of trousers", "pullover", "dress", "coat", "sandal", "shirt",
         "sneaker", "bag", "ankle boot"]
BRIGHT = ("dark", "light")
SIZE = ("small", "large")
PREFIXES = ["", "", "a photo of ", "an image of "]
OBJECT_LEVEL = 20  # grey level above which a pixel counts as the object's


@dataclass
class Cfg:
    dim: int = 128
    n_layer: int = 4
    n_head: int = 4
    intermediate_size: int = 344
    head_hidden: int = 128
    gen_embed_dim: int = 8
    vocab_size: int = 512
    text_vocab_size: int = 0
    block_size: int = 196
    max_prompt_len: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-6


class Block(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = nn.Module()
        self.attention.wqkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.attention.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(c.dim, c.intermediate_size, bias=False)
        self.feed_forward.w2 = nn.Linear(c.intermediate_size, c.dim, bias=False)
        self.feed_forward.w3 = nn.Linear(c.dim, c.intermediate_size, bias=False)
        self.nh = c.n_head

    def forward(self, x, cos, sin, mask, cache=None):
        b, t, d = x.shape
        hd = d // self.nh
        q, k, v = (y.view(b, t, self.nh, hd).transpose(1, 2)
                   for y in self.attention.wqkv(self.attention_norm(x)).split(d, -1))
        q, k = rope_half(q, cos, sin), rope_half(k, cos, sin)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.attention.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.feed_forward.w2(F.silu(self.feed_forward.w1(h)) *
                                        self.feed_forward.w3(h))


def rope_half(x, cos, sin):
    hd = x.shape[-1]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class T2I(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c.text_vocab_size, c.dim)
        self.gen_embed = nn.Embedding(c.vocab_size, c.gen_embed_dim)
        self.gen_aligner = nn.Module()
        self.gen_aligner.layers = nn.ModuleList(
            [nn.Linear(c.gen_embed_dim, c.dim), nn.GELU(), nn.Linear(c.dim, c.dim)])
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.gen_head = nn.Module()
        self.gen_head.output_mlp_projector = nn.Linear(c.dim, c.head_hidden)
        self.gen_head.vision_head = nn.Linear(c.head_hidden, c.vocab_size)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.gen_embed.weight, std=1.0)
        hd = c.dim // c.n_head
        inv = 1.0 / (c.rope_base ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.arange(c.max_prompt_len + c.block_size).float()[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def embed_image(self, ids):
        a = self.gen_aligner.layers
        return a[2](F.gelu(a[0](self.gen_embed(ids))))

    def head(self, h):
        return self.gen_head.vision_head(F.gelu(self.gen_head.output_mlp_projector(h)))

    def trunk(self, x, pos0=0, mask=None, caches=None):
        t = x.shape[1]
        cos, sin = self.cos[pos0:pos0 + t], self.sin[pos0:pos0 + t]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if caches is None else caches[i])
        return self.norm(x)

    def forward_train(self, text, is_text, image):
        """text/image [B, T] ids (0 where unused), is_text [B, T] (the other positions are
        image tokens or right padding); causal. Returns image logits at every position."""
        x = torch.where(is_text[..., None], self.tok_embeddings(text), self.embed_image(image))
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        return self.head(self.trunk(x, mask=mask))


def janus_state_dict(sd: dict, c: Cfg) -> dict:
    """The official key names (tools/janus_ref.py) for the engine-layout tensors."""
    lm = "language_model.model."
    out = {lm + "embed_tokens.weight": sd["tok_embeddings.weight"],
           lm + "norm.weight": sd["norm.weight"]}
    for i in range(c.n_layer):
        p, q = f"{lm}layers.{i}.", f"layers.{i}."
        for n, w in zip("qkv", sd[q + "attention.wqkv.weight"].split(c.dim, 0)):
            out[p + f"self_attn.{n}_proj.weight"] = w
        out[p + "self_attn.o_proj.weight"] = sd[q + "attention.wo.weight"]
        out[p + "input_layernorm.weight"] = sd[q + "attention_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[q + "ffn_norm.weight"]
        out[p + "mlp.gate_proj.weight"] = sd[q + "feed_forward.w1.weight"]
        out[p + "mlp.up_proj.weight"] = sd[q + "feed_forward.w3.weight"]
        out[p + "mlp.down_proj.weight"] = sd[q + "feed_forward.w2.weight"]
    for k, v in sd.items():
        if k.startswith("gen_"):
            out[k] = v
    return out


# ----------------------------------------------------------------------------- captions


def attributes(x_uint8):
    """Per image: brightness (the mean grey level of its object pixels, those above
    OBJECT_LEVEL) and area (how many object pixels)."""
    obj = x_uint8 > OBJECT_LEVEL
    area = obj.sum((1, 2)).float()
    bright = (x_uint8.float() * obj).sum((1, 2)) / area.clamp_min(1)
    return bright, area


def tercile_words(values, labels):
    """-1 (middle third), 0 (lowest third), 1 (highest third), ranked within each class."""
    out = torch.full_like(labels, -1)
    for k in range(10):
        idx = (labels == k).nonzero().squeeze(1)
        lo, hi = torch.quantile(values[idx], torch.tensor([1 / 3, 2 / 3]))
        out[idx[values[idx] <= lo]] = 0
        out[idx[values[idx] >= hi]] = 1
    return out


def caption(rng, label, bword, sword, p_attr=0.7):
    words = []
    if sword >= 0 and rng.random() < p_attr:
        words.append(SIZE[sword])
    if bword >= 0 and rng.random() < p_attr:
        words.append(BRIGHT[bword])
    phrase = " ".join(words + [NOUNS[label]])
    article = "an" if phrase[0] in "aeiou" else "a"
    return rng.choice(PREFIXES) + article + " " + phrase


def build_tokenizer(rng):
    texts = [caption(rng, rng.randrange(10), rng.randrange(-1, 2), rng.randrange(-1, 2))
             for _ in range(6000)]
    texts += [PROMPT_TEMPLATE.replace("{prompt}", t) for t in texts[:500]]
    return tokenizer_ref.build("deepseek", rng, texts=texts + tokenizer_ref.training_text(rng),
                               vocab_size=1024)


def unconditional(ids, pad):
    return [ids[0]] + [pad] * (len(ids) - 2) + [ids[-1]]


# ----------------------------------------------------------------------------- sampling


@torch.no_grad()
def sample(model, prompt_ids, pad, n, cfg_scale, gen):
    """n images for one prompt, as the engine draws them: conditional and unconditional rows,
    logits u + cfg (c - u), temperature 1, full vocabulary. Returns token grids [n, 196]."""
    c = model.c
    rows = [prompt_ids] * n + ([unconditional(prompt_ids, pad)] * n if cfg_scale != 1 else [])
    text = torch.tensor(rows)
    caches = [{} for _ in model.layers]
    x = model.tok_embeddings(text)
    h = model.trunk(x, 0, mask=None if text.shape[1] == 1 else
                    torch.ones(text.shape[1], text.shape[1], dtype=torch.bool).tril(),
                    caches=caches)[:, -1:]
    out = []
    pos = text.shape[1]
    for _ in range(c.block_size):
        logits = model.head(h)[:, 0].float()
        if cfg_scale != 1:
            cond, unc = logits[:n], logits[n:]
            logits = unc + cfg_scale * (cond - unc)
        tok = torch.multinomial(F.softmax(logits, -1), 1, generator=gen)
        out.append(tok)
        if len(out) == c.block_size:
            break
        ids = tok if cfg_scale == 1 else torch.cat([tok, tok], 0)
        h = model.trunk(model.embed_image(ids), pos, caches=caches)
        pos += 1
    return torch.cat(out, 1)


# ----------------------------------------------------------------------------- main


def write_class_prompts(tok, path):
    """The prompt naming each class, as text and as the ids the server would send (for
    imagegen-spec-bench --prompts, which has no tokenizer)."""
    rows = []
    for k, noun in enumerate(NOUNS):
        text = ("an " if noun[0] in "aeiou" else "a ") + noun
        rows.append({"class": k, "text": text,
                     "ids": tok.encode(PROMPT_TEMPLATE.replace("{prompt}", text)).ids})
    with open(path, "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")


def evaluate(model, tok, pad, vq, clf, out_dir, log, n=64, cfg_scale=3.0, seed=11):
    gen = torch.Generator().manual_seed(seed)

    def draw(text):
        ids = tok.encode(PROMPT_TEMPLATE.replace("{prompt}", text)).ids
        grids = sample(model, ids, pad, n, cfg_scale, gen)
        with torch.no_grad():
            img = to_uint8(vq.decode_code(grids))
        return img[:, 0]

    results = {"n_per_prompt": n, "cfg_scale": cfg_scale, "classes": {}}
    correct = total = 0
    bright_ok = size_ok = pairs = 0
    samples = []
    for k, noun in enumerate(NOUNS):
        art = "an" if noun[0] in "aeiou" else "a"
        imgs = {}
        for key, text in (("plain", f"{art} {noun}"), ("dark", f"a dark {noun}"),
                          ("light", f"a light {noun}"), ("small", f"a small {noun}"),
                          ("large", f"a large {noun}")):
            imgs[key] = draw(text)
        with torch.no_grad():
            pred = clf(imgs["plain"][:, None].float() / 255.0).argmax(1)
        acc = (pred == k).float().mean().item()
        correct += int((pred == k).sum())
        total += n
        b = {key: attributes(imgs[key])[0].mean().item() for key in ("dark", "light")}
        a = {key: attributes(imgs[key])[1].mean().item() for key in ("small", "large")}
        bright_ok += int(b["light"] > b["dark"])
        size_ok += int(a["large"] > a["small"])
        pairs += 1
        results["classes"][CLASS_NAMES[k]] = {
            "accuracy": round(acc, 3),
            "brightness_dark": round(b["dark"], 1), "brightness_light": round(b["light"], 1),
            "area_small": round(a["small"], 1), "area_large": round(a["large"], 1)}
        samples.append(torch.cat([imgs[key][:6] for key in
                                  ("plain", "dark", "light", "small", "large")], 0))
        log(eval_class=CLASS_NAMES[k], **results["classes"][CLASS_NAMES[k]])
    results["accuracy"] = round(correct / total, 4)
    results["brightness_pairs_ordered"] = f"{bright_ok}/{pairs}"
    results["size_pairs_ordered"] = f"{size_ok}/{pairs}"
    log(eval=results)
    write_samples(samples, os.path.join(out_dir, "img", "fmnist_t2i_samples.png"))
    return results


def write_samples(samples, path):
    """One row per class: 6 images each of the prompts plain, dark, light, small, large."""
    from PIL import Image
    rows = []
    for s in samples:  # [5 * k, 28, 28]
        k = s.shape[0] // 5
        groups = s.view(5, k, 28, 28)
        pad = torch.full((5, k, 28, 4), 255, dtype=torch.uint8)
        groups = torch.cat([groups, pad], 3)  # a white gap after each image
        row = groups.permute(2, 0, 1, 3).reshape(28, 5 * k * 32)
        rows.append(torch.cat([row, torch.full((4, row.shape[1]), 255, dtype=torch.uint8)], 0))
    Image.fromarray(torch.cat(rows, 0).numpy()).save(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--eval-n", type=int, default=64)
    args = ap.parse_args()
    seed_all(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = os.path.join(MODELS, NAME)
    docs = os.path.join(REPO, "docs")
    vq = vq_from_dir(os.path.join(MODELS, "fmnist-vq"))
    ccfg = load_config(os.path.join(MODELS, "fmnist-classifier"))
    clf = Classifier(ccfg["width"], ccfg["features"], ccfg["num_classes"])
    clf.load_state_dict({k: v for k, v in load_tensors(os.path.join(MODELS, "fmnist-classifier"))
                         .items() if not k.startswith("reference.")})
    clf.eval()

    if args.eval_only:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        conf = load_config(out)
        c = Cfg(**{k: conf[k] for k in Cfg.__dataclass_fields__})
        model = T2I(c)
        model.load_state_dict(load_tensors(out))
        model.eval()
        log = Log(os.path.join("/tmp", "fmnist-t2i-eval.jsonl"))
        write_class_prompts(tok, os.path.join(out, "class_prompts.json"))
        evaluate(model, tok, conf["pad_id"], vq, clf, docs, log, n=args.eval_n)
        return

    rng = random.Random(args.seed)
    tok = build_tokenizer(rng)
    pad = tok.token_to_id(PAD_TAG)
    c = Cfg(text_vocab_size=tok.get_vocab_size())
    model = T2I(c)
    log = Log(os.path.join(out, "train_log.jsonl"))
    log(params=sum(p.numel() for p in model.parameters()), **c.__dict__)

    xtr, ytr = fashion_mnist("train")
    cache = os.path.join(WORK, "t2i_tokens.pt")  # the training images under fmnist-vq
    if os.path.exists(cache):
        ttr = torch.load(cache).long()
    else:
        with torch.no_grad():
            ttr = torch.cat([vq.encode(to_unit(xtr[i:i + 2000]))[1].view(-1, 196)
                             for i in range(0, xtr.shape[0], 2000)])
        os.makedirs(WORK, exist_ok=True)
        torch.save(ttr.to(torch.int16), cache)
    bw = tercile_words(attributes(xtr)[0], ytr)
    sw = tercile_words(attributes(xtr)[1], ytr)
    log(tokenized=ttr.shape[0])

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = adamw(decay, no_decay, args.lr, 0.05)
    g = torch.Generator().manual_seed(args.seed)
    warm = max(1, min(200, args.steps // 10))
    model.train()
    n_img = c.block_size
    for step in range(args.steps):
        lr = set_warmup_cosine_lr(opt, step, args.steps, args.lr, warm)
        idx = torch.randint(0, ttr.size(0), (args.batch,), generator=g).tolist()
        prompts = []
        for i in idx:
            ids = tok.encode(PROMPT_TEMPLATE.replace("{prompt}", caption(
                rng, int(ytr[i]), int(bw[i]), int(sw[i])))).ids
            prompts.append(unconditional(ids, pad) if rng.random() < 0.1 else ids)
        P = max(len(p) for p in prompts)
        T = P + n_img - 1
        text = torch.zeros(args.batch, T, dtype=torch.long)
        image = torch.zeros(args.batch, T, dtype=torch.long)
        is_text = torch.zeros(args.batch, T, dtype=torch.bool)
        target = torch.full((args.batch, T), -100, dtype=torch.long)
        for r, (i, p) in enumerate(zip(idx, prompts)):
            L = len(p)
            text[r, :L] = torch.tensor(p)
            is_text[r, :L] = True
            image[r, L:L + n_img - 1] = ttr[i, :-1]
            target[r, L - 1:L - 1 + n_img] = ttr[i]
        logits = model.forward_train(text, is_text, image)
        loss = F.cross_entropy(logits.reshape(-1, c.vocab_size), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            log(step=step + 1, loss=round(loss.item(), 4), lr=round(lr, 6))
    model.eval()

    # The trained forward against the reference the engine is parity-tested with.
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    ref_c = dict(hidden_size=c.dim, num_attention_heads=c.n_head, num_hidden_layers=c.n_layer,
                 rms_norm_eps=c.norm_eps, rope_theta=c.rope_base)
    ids = tok.encode(PROMPT_TEMPLATE.replace("{prompt}", "a small dark bag")).ids
    prompt = torch.tensor([ids])
    img = ttr[:1, :20]
    with torch.no_grad():
        ref = janus_ref.forward(janus_state_dict(sd, c), ref_c, prompt, img)
        T = prompt.shape[1] + img.shape[1]
        ours = model.forward_train(torch.cat([prompt, torch.zeros_like(img)], 1),
                                   torch.arange(T)[None] < prompt.shape[1],
                                   torch.cat([torch.zeros_like(prompt), img], 1))
    diff = (ref - ours).abs().max().item()
    log(janus_ref_max_abs_diff=diff)
    assert diff < 1e-4, diff

    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    write_class_prompts(tok, os.path.join(out, "class_prompts.json"))
    results = evaluate(model, tok, pad, vq, clf, docs, log, n=args.eval_n)
    config = {"type": "janus-gen", "dim": c.dim, "n_layer": c.n_layer, "n_head": c.n_head,
              "intermediate_size": c.intermediate_size, "text_vocab_size": c.text_vocab_size,
              "vocab_size": c.vocab_size, "block_size": c.block_size,
              "max_prompt_len": c.max_prompt_len, "gen_embed_dim": c.gen_embed_dim,
              "head_hidden": c.head_hidden, "rope_base": c.rope_base, "norm_eps": c.norm_eps,
              "tokenizer": "fmnist-vq", "text_tokenizer": "tokenizer.json", "pad_id": pad,
              "prompt_template": PROMPT_TEMPLATE,
              "sampling_defaults": {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 0,
                                    "top_p": 1.0},
              "trained_on": "fashion-mnist train with generated captions, "
                            "tools/train/train_t2i.py",
              "eval": {"class_accuracy": results["accuracy"],
                       "brightness_pairs_ordered": results["brightness_pairs_ordered"],
                       "size_pairs_ordered": results["size_pairs_ordered"]}}
    save_model_dir(out, config, sd)


if __name__ == "__main__":
    main()
