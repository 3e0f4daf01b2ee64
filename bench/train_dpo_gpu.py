#!/usr/bin/env python3
"""DPO training speed on a CUDA GPU: TRL-style DPO with PEFT + transformers against
`hf2q train dpo`, on the same synthesized model shape and the same preference pairs.

    train_dpo_gpu.py --hf2q PATH/TO/hf2q [--shape llama-3.2-1b] [--steps 8] [--pairs 8] [--seq 512]
                     [--work DIR] [--skip-peft] [--skip-hf2q] [--json]

On the GPU machine, with a release `hf2q` built elsewhere: `python3 bench/train_dpo_gpu.py
--hf2q ./hf2q` (about 3 minutes at the 1B shape: two hf2q runs, two PEFT runs).

Needs torch, transformers and peft on the machine (checked with torch 2.11, transformers 5.17,
peft 0.21); TRL is not needed: its sigmoid loss is written out below, as `trl.DPOTrainer`
computes it for a PEFT model without a separate reference model.

- Data: `--pairs * (steps + 2)` pairs of random lowercase words, written as JSONL
  (`prompt`/`chosen`/`rejected` strings) for hf2q and tokenized by the same tokenizer (the tiny
  Llama fixture's byte-level BPE, one token per byte) for PyTorch: BOS + prompt (127 tokens) +
  reply, cut to `--seq` tokens per side. Loss on the reply tokens only.
- Model: `hf2q synth --shape SHAPE --type bf16` (random weights at the real shape) for hf2q;
  transformers' `from_config` at the same shape with random weights, bf16, sdpa attention, for
  PEFT (speed does not depend on the values).
- LoRA r 16 / alpha 32 on all seven linears of every layer; AdamW; clipping at 1.0; beta 0.1;
  batch `--pairs` pairs = 2 x pairs sequences of `--seq` tokens per step.
- PEFT step, as TRL: chosen and rejected concatenated in one batch; the reference forward with
  the adapter disabled (`model.disable_adapter()`, no grad); the policy forward; per-sequence
  sums of the reply tokens' log-probabilities (log_softmax + gather in float32); the loss
  `-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`, mean over pairs; backward; step.
  Run without and with transformers' gradient checkpointing (use_reentrant=False).
- hf2q: `hf2q train dpo` with `--grad-checkpoint on` and `off`.

Tokens/s counts both sides' tokens of the policy batch (2 x pairs x seq per step) over the
steps after two warm-up steps (CUDA-synchronised wall time for PEFT; hf2q's own per-step
report), the reference's forward included in the time of both. Prints one table (markdown; one
JSON object per row with --json).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = os.path.join(ROOT, "crates", "models", "tests", "fixtures", "tiny", "tiny-llama")
PROMPT_BYTES = 127
BETA = 0.1


def make_pairs(path, n, seq):
    """n pairs of random words: a prompt of PROMPT_BYTES bytes, replies long enough to be cut."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]

    def text(nbytes):
        s = ""
        while len(s) < nbytes:
            s += rng.choice(words) + " "
        return s[:nbytes]

    rows = [{"prompt": text(PROMPT_BYTES), "chosen": " " + text(seq), "rejected": " " + text(seq)} for _ in range(n)]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def peft_run(a, rows):
    import torch
    import torch.nn.functional as F
    import transformers
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(TOK)
    bos = tok.bos_token_id

    def side(prompt, reply):
        p = [bos] + tok(prompt, add_special_tokens=False)["input_ids"]
        ids = (p + tok(reply, add_special_tokens=False)["input_ids"])[: a.seq]
        assert len(ids) == a.seq, f"a side of {len(ids)} tokens; make the replies longer"
        return ids, len(p)

    cfg = LlamaConfig(**SHAPES[a.shape], max_position_embeddings=4096, rms_norm_eps=1e-5)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if a.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lcfg = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(model, lcfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-5, fused=False)

    def batch(step):
        ids, starts = [], []
        for r in rows[step * a.pairs:(step + 1) * a.pairs]:
            for reply in (r["chosen"], r["rejected"]):
                i, s = side(r["prompt"], reply)
                ids.append(i)
                starts.append(s)
        ids = torch.tensor(ids, device="cuda")  # (2P, T): chosen, rejected, chosen, ...
        labels = ids[:, 1:].clone()
        mask = torch.zeros_like(labels, dtype=torch.bool)
        for k, s in enumerate(starts):
            mask[k, s - 1:] = True  # rows predicting reply tokens
        return ids, labels, mask

    def seq_logps(logits, labels, mask):
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        per = torch.gather(lp, 2, labels.unsqueeze(-1)).squeeze(-1)
        return (per * mask).sum(-1)

    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(a.steps + 2):
        ids, labels, mask = batch(step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), model.disable_adapter():
            ref = seq_logps(model(input_ids=ids).logits, labels, mask)
        pi = seq_logps(model(input_ids=ids).logits, labels, mask)
        logits = (pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2])
        loss = (-F.logsigmoid(BETA * logits)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        losses.append(float(loss))
        if step >= 2:
            times.append(time.perf_counter() - t0)
    toks = 2 * a.pairs * a.seq * len(times) / sum(times)
    return {"run": "PEFT + transformers (TRL's loss)" + (", checkpointing" if a.checkpointing else ""),
            "tokens_per_s": round(toks, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "first_loss": round(losses[0], 6),
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}",
            "device": torch.cuda.get_device_name(0)}


def hf2q_run(a, data, model, ckpt):
    out = os.path.join(a.work, f"adapter-{ckpt}")
    cmd = [a.hf2q, "train", "dpo", model, "--data", data, "-o", out, "--overwrite", "--device", "cuda",
           "--steps", str(a.steps + 2), "--batch", str(a.pairs), "--max-seq-len", str(a.seq),
           "--lora-r", "16", "--lora-alpha", "32", "--lr", "5e-5", "--beta", str(BETA),
           "--grad-checkpoint", ckpt, "--json"]
    err = os.path.join(a.work, f"hf2q-{ckpt}.err")
    with open(err, "w") as fe:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=fe, text=True)
    if p.returncode != 0:
        return {"run": f"hf2q train dpo, checkpointing {ckpt}", "tokens_per_s": None, "peak_gib": None,
                "error": f"exit {p.returncode}, see {err}"}
    t = s = mem = 0.0
    first = None
    for line in p.stdout.splitlines():
        e = json.loads(line)
        if e["event"] == "step":
            first = e["loss"] if first is None else first
            mem = max(mem, e.get("device_memory_gib", 0.0))
            if e["step"] > 2:
                t += e["tokens"]
                s += e["tokens"] / e["tokens_per_s"]
    return {"run": f"hf2q train dpo, checkpointing {ckpt}", "tokens_per_s": round(t / s, 1) if s else None,
            "peak_gib": round(mem, 2), "first_loss": first}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf2q", help="the hf2q binary (needed unless --skip-hf2q)")
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf2q-dpo-bench"))
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--skip-hf2q", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    data = os.path.join(a.work, "pairs.jsonl")
    rows = make_pairs(data, a.pairs * (a.steps + 2), a.seq)
    results = []
    if not a.skip_hf2q:
        if not a.hf2q:
            sys.exit("--hf2q PATH is needed (or --skip-hf2q)")
        model = os.path.join(a.work, f"{a.shape}-bf16.gguf")
        if not os.path.exists(model):
            subprocess.run([a.hf2q, "synth", "--shape", a.shape, "--type", "bf16", "--vocab-from", TOK, model],
                           check=True, stdout=subprocess.DEVNULL)
        for ckpt in ("on", "off"):
            results.append(hf2q_run(a, data, model, ckpt))
    if not a.skip_peft:
        for ck in (False, True):
            a.checkpointing = ck
            results.append(peft_run(a, rows))
    base = next((r["tokens_per_s"] for r in results if r["run"].startswith("PEFT") and "checkpointing" not in r["run"]), None)
    if a.json:
        for r in results:
            print(json.dumps(r))
        return
    print(f"DPO, {a.shape} (random weights, bf16), LoRA r 16 on all linears, {a.pairs} pairs x {a.seq} tokens per side")
    print("| run | tokens/s | vs PEFT (no checkpointing) | peak GiB | first loss |")
    print("|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base and r.get("tokens_per_s") else "-"
        print(f"| {r['run']} | {r.get('tokens_per_s') or r.get('error', '-')} | {ratio} | {r.get('peak_gib', '-')} | {r.get('first_loss', '-')} |")
    dev = next((r for r in results if "device" in r), None)
    if dev:
        print(f"\n{dev['device']}; {dev['versions']}")


if __name__ == "__main__":
    main()
