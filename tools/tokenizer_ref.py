#!/usr/bin/env python3
"""Reference ids for the C++ tokenizer (server/tokenizer.h), from the `tokenizers` package.

Trains small byte-level BPE tokenizers on a generated text with the `tokenizers` package, in the
layouts real models ship (GPT-2's ByteLevel split; DeepSeek-LLM's split sequence, which Janus
uses, with its chat template's special tokens; LLaMA-3's split with ignore_merges; a normalised
one with NFKC, lowercase, punctuation and digit splits and added tokens that strip), saves each
as tokenizer.json, and encodes a test corpus with each (with and without the post-processor's
special tokens). The C++ test loads the same files and must give the same ids.

  tools/tokenizer_ref.py --out DIR [--tokenizer NAME=path/to/tokenizer.json ...]

Writes DIR/<name>.tokenizer.json and DIR/<name>.expected.jsonl (one {"text", "ids",
"ids_plain"} per line). --tokenizer adds an existing file (the bundled model's) to the set.
"""
import argparse
import json
import os
import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers, AddedToken

# DeepSeek-LLM's letter class (its tokenizer.json spells the cased letters out as ranges), by
# code point.
LETTER_RANGES = """0041-005A 0061-007A 00B5 00C0-00D6 00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF
0370-0373 0376-0377 037B-037D 037F 0386 0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 048A-052F
0531-0556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 1D79-1D9A
1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC
1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113
2115 2119-211D 2124 2126 2128 212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183-2184
2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2-2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E
AB70-ABBF FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB
10C80-10CB2 10CC0-10CF2 118A0-118DF 1E900-1E943"""


def char_class(ranges):
    out = ""
    for r in ranges.split():
        lo, _, hi = r.partition("-")
        out += chr(int(lo, 16)) + ("-" + chr(int(hi, 16)) if hi else "")
    return out


LETTERS = char_class(LETTER_RANGES)
PUNCT = char_class("0021-002F 003A-007E FF01-FF0F FF1A-FF5E 2018-201F 3000-3002")
CJK = char_class("4E00-9FA5 0800-4E00 AC00-D7FF")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

JANUS_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",
                  "<|User|>", "<|Assistant|>", "<begin_of_image>", "<end_of_image>",
                  "<image_placeholder>"]

CORPUS = [
    "a dark ankle boot",
    "A small bag, seen from the front.",
    "Hello, world!  How's it going? I'll say: it's fine, they've gone, we're done.",
    "trailing spaces   ",
    "   leading spaces",
    "tabs\tand\nnewlines\r\nand\n\n\nmore",
    "digits 0123456789 and 3.14159 and 1,000,000 and ١٢٣ and ５６",
    "Ünïcödé àccents: café, naïve, façade, Øresund, Straße, İstanbul",
    "Ελληνικά και Кириллица",
    "中文字符测试，还有标点。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 and ❤️",
    "mixed\u00a0no-break\u3000ideographic\u2009thin space",
    "vertical\u000btab and form\u000cfeed and next\u0085line",
    "combining e\u0301 vs é, ligature ﬁ, fullwidth ＡＢＣ, ½",
    "<|User|>: draw a white sneaker\n\n<|Assistant|>:<begin_of_image>",
    "<｜begin▁of▁sentence｜>system prompt<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜><｜▁pad▁｜> padded",
    "words<image_placeholder>glued and <image_placeholder> spaced",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "symbols !@#$%^&*()_+-=[]{}|;':\",./<>?`~ and ‘quotes’ “double” — dash … ellipsis",
    "code: for (int i = 0; i < n; ++i) { x += y; }",
    "",
    " ",
    "\n",
    "a",
    "https://example.com/path?query=1&x=y#frag",
    "It's 5 o'clock: DON'T and I'LL",
]

ADJ = ["dark", "light", "small", "large", "bright", "faded", "striped", "plain", "wide", "narrow"]
NOUNS = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
         "ankle boot"]


def training_text(rng, n=4000):
    lines = []
    for _ in range(n):
        k = rng.random()
        if k < 0.5:
            lines.append(f"a {rng.choice(ADJ)} {rng.choice(NOUNS)}")
        elif k < 0.8:
            lines.append(rng.choice(CORPUS))
        else:
            lines.append(" ".join(rng.choice(CORPUS).split()[::-1]) + f" {rng.randint(0, 99999)}")
    return lines


def build(name, rng, texts=None, vocab_size=1200):
    """A tokenizer in the layout `name`, trained on `texts` (default: training_text(rng))."""
    tok = Tokenizer(models.BPE(ignore_merges=(name == "llama3")))
    specials = []
    if name == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        specials = ["<|endoftext|>"]
    elif name == "deepseek":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex("[\r\n]"), "isolated"),
            pre_tokenizers.Split(Regex(r"\s?[" + LETTERS + "]+"), "isolated"),
            pre_tokenizers.Split(Regex(r"\s?[" + PUNCT + "]+"), "isolated"),
            pre_tokenizers.Split(Regex(r"\s+$"), "isolated"),
            pre_tokenizers.Split(Regex("[" + CJK + "]+"), "isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        specials = JANUS_SPECIALS
    elif name == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    elif name == "normalized":
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                               normalizers.Replace("  ", " ")])
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Punctuation("merged_with_previous"),
            pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.Split("-", "merged_with_next"),
            pre_tokenizers.Split(Regex(r"[aeiou]+"), "contiguous"),
            pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
        ])
        specials = ["<s>", "</s>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_text(rng) if texts is None else texts, trainer=trainer)
    if name == "deepseek":
        bos = tok.token_to_id(JANUS_SPECIALS[0])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{JANUS_SPECIALS[0]} $A", special_tokens=[(JANUS_SPECIALS[0], bos)])
    elif name == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
    elif name == "normalized":
        tok.add_tokens([AddedToken("[mask]", lstrip=True, rstrip=True, normalized=True),
                        AddedToken("boot", single_word=True, normalized=False)])
        s, e = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", s), ("</s>", e)])
    return tok


EXTRA = [
    "a [mask] b", "a[mask]b", "x  [mask]  y", "boot", "boots", "a boot!", "reboot", "boot_x",
    "Café CAFÉ café", "double  space  here",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", action="append", default=[],
                    help="NAME=path: an existing tokenizer.json to include")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(1234)
    corpus = CORPUS + EXTRA
    # Random strings over the awkward characters, for what the list does not think of.
    pool = list("aZ0 9\t\n\r'’.,!?-_ \u00a0\u3000éß中한😀👍🏽\u0301") + ["<|User|>", "[mask]", "boot"]
    for _ in range(1000):
        corpus.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 24))))
    # Long words over few characters: many merges of equal rank in one pre-tokenizer piece, so
    # the merge order (lowest rank, leftmost first) decides the ids.
    for unit in ["dress", "sneaker", "a", "ab", "aaab", "boot", "1", "中"]:
        corpus.append(unit * (600 // len(unit)))
    for _ in range(60):
        few = rng.choice(["ab", "aab", "esr", "dres", "ot b", "01", "a中"])
        corpus.append("".join(rng.choice(few) for _ in range(rng.randint(50, 800))))
    sets = {name: build(name, rng) for name in ["gpt2", "deepseek", "llama3", "normalized"]}
    for spec in args.tokenizer:
        name, path = spec.split("=", 1)
        sets[name] = Tokenizer.from_file(path)
    for name, tok in sets.items():
        tok.save(os.path.join(args.out, f"{name}.tokenizer.json"))
        with open(os.path.join(args.out, f"{name}.expected.jsonl"), "w", encoding="utf-8") as f:
            for text in corpus:
                ids = tok.encode(text).ids
                plain = tok.encode(text, add_special_tokens=False).ids
                f.write(json.dumps({"text": text, "ids": ids, "ids_plain": plain},
                                   ensure_ascii=False) + "\n")
    n_tok = sum(len(t.encode(x).ids) for t in sets.values() for x in corpus)
    print(f"tokenizer_ref: {len(sets)} tokenizers x {len(corpus)} strings, {n_tok} ids -> "
          f"{args.out}")


if __name__ == "__main__":
    main()
