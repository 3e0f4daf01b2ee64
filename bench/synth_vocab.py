#!/usr/bin/env python3
"""Writes a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json) of exactly N
tokens, for `hf2q synth --vocab-from`, so that a synthesized model's whole vocabulary is text.

Why: `hf2q synth --vocab-from` a small tokenizer pads the vocabulary to the shape's with unused
`[PAD<i>]` tokens, and a model of random weights then generates almost only those. Servers
render them differently (hf2q streams the piece `[PAD123]`, llama.cpp streams nothing for an
unused token), so TTFT and ITL, which are measured on text chunks, would not compare. With this
vocabulary every generated token is a piece of text in both.

The tokens: the byte-level BPE alphabet and special tokens of the base tokenizer (default: the
tiny-llama fixture; ids kept), then merges of lowercase letters, breadth first: `Ġa`..`Ġz` (a
space and a letter), `aa`..`zz`, then each existing merge followed by a letter, until N tokens.
The chat template and special tokens come from the base's tokenizer_config.json. Standard
library only; deterministic.

  bench/synth_vocab.py OUT_DIR N [--base DIR]
"""

import argparse
import json
import os
import string


def build(base_dir, n):
    with open(os.path.join(base_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    taken = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    have = set(vocab) | {t["content"] for t in tok.get("added_tokens", [])}
    if tok["model"].get("merges"):
        raise SystemExit("the base tokenizer must have no merges (a byte-level alphabet)")
    if n < len(taken):
        raise SystemExit(f"N = {n} is smaller than the base's {len(taken)} tokens")
    letters = string.ascii_lowercase
    merges = []
    next_id = 0
    queue = [("Ġ", c) for c in letters] + [(a, b) for a in letters for b in letters]
    qi = 0
    while len(taken) < n:
        if qi == len(queue):
            raise SystemExit("ran out of merges")  # not reached below 10^7 tokens
        a, b = queue[qi]
        qi += 1
        piece = a + b
        if piece in have:
            continue
        while next_id in taken:
            next_id += 1
        vocab[piece] = next_id
        taken.add(next_id)
        have.add(piece)
        merges.append(f"{a} {b}")
        queue.extend((piece, c) for c in letters)
    tok["model"]["vocab"] = vocab
    tok["model"]["merges"] = merges
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("n", type=int, help="vocabulary size (the shape's: llama-3.x 128256, qwen3 151936, smollm2 49152)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--base", default=os.path.join(root, "crates/models/tests/fixtures/tiny/tiny-llama"))
    a = ap.parse_args()
    tok = build(a.base, a.n)
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(a.base, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = f.read()
    with open(os.path.join(a.out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(cfg)
    print(f"{a.out_dir}: {len(tok['model']['vocab']) + len(tok.get('added_tokens', []))} tokens, "
          f"{len(tok['model']['merges'])} merges")


if __name__ == "__main__":
    main()
