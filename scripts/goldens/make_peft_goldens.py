#!/usr/bin/env python3
"""PEFT goldens for hf2q's LoRA training parity tests (crates/train/tests/peft_parity.rs).

Run on a machine with torch + transformers + peft (the GPU machine; no network needed):

    make_peft_goldens.py --fixtures crates/train/tests/fixtures/peft \
        --tiny crates/models/tests/fixtures/tiny [--smollm2 PATH.gguf] --out DIR

For each case folder NAME under --fixtures (written by hf2q: `batch.json`, `ours_init/`,
`ours_random/`), it loads the base model in float32 (tiny random checkpoints from --tiny,
SmolLM2 from its GGUF, dequantized by transformers), and writes into --out/NAME:

- golden.json: the loss of the batch under our random adapter (`ours_random`, loaded by
  PeftModel.from_pretrained), the probe's logits under it, the loss curve of 20 AdamW steps from
  our initial adapter (`ours_init`), the probe's logits of the adapter PEFT saved after them,
  the hyper-parameters and the versions used;
- grads.safetensors: the gradient of every LoRA factor under `ours_random` (PEFT names);
- peft_trained/: PEFT's own save_pretrained() after the 20 steps.

Loss: mean over labelled rows of -log softmax(logits)[target] (targets already shifted: row i
predicts targets[i]; -100 = none), each sequence run alone (no padding). Dropout 0. AdamW
(torch.optim.AdamW), linear warm-up then cosine (transformers.get_cosine_schedule_with_warmup),
gradient clipping by global norm (torch.nn.utils.clip_grad_norm_), as hf2q's trainer.
float32 throughout, TF32 off, eager attention.
"""
import argparse
import json
import os
import sys

import torch
import transformers
import peft
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

STEPS = 20
HP = {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
      "warmup_steps": 3, "max_grad_norm": 1.0, "steps": STEPS}
TOPK = 20


def meta(dev):
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "dtype": "float32", "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"}


def load_base(name, tiny, smollm2, dev):
    kw = dict(torch_dtype=torch.float32, attn_implementation="eager")
    if name == "smollm2":
        d, f = os.path.split(os.path.abspath(smollm2))
        m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, **kw)
    else:
        m = AutoModelForCausalLM.from_pretrained(os.path.join(tiny, name), **kw)
    return m.to(dev)


def loss_of(model, batch, dev):
    ids, targets, total = batch["ids"], batch["targets"], 0.0
    n = sum(1 for t in targets if t >= 0)
    start = 0
    loss = None
    for length in batch["lengths"]:
        x = torch.tensor([ids[start:start + length]], device=dev)
        t = torch.tensor(targets[start:start + length], device=dev)
        logits = model(input_ids=x).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        mask = t >= 0
        part = -lp[mask, t[mask]].sum()
        loss = part if loss is None else loss + part
        start += length
    return loss / n


def probe_logits(model, batch, dev, full):
    with torch.no_grad():
        x = torch.tensor([batch["probe"]], device=dev)
        logits = model(input_ids=x).logits[0].float().cpu()
    if full:
        return {"logits": [[round(float(v), 6) for v in row] for row in logits]}
    steps = []
    for row in logits:
        v, i = torch.topk(row, TOPK)
        steps.append({"top_ids": i.tolist(), "top_logits": [round(float(a), 6) for a in v]})
    return {"top": steps}


def lora_params(model):
    return {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}


def run_case(name, fixtures, tiny, smollm2, out, dev):
    fx = os.path.join(fixtures, name)
    with open(os.path.join(fx, "batch.json")) as fh:
        batch = json.load(fh)
    full = name != "smollm2"
    res = {"meta": meta(dev), "hp": HP}

    # 1. Loss, gradients and probe logits under our random adapter.
    model = PeftModel.from_pretrained(load_base(name, tiny, smollm2, dev), os.path.join(fx, "ours_random"),
                                      is_trainable=True)
    model.eval()  # dropout is 0 anyway; eval keeps every module deterministic
    loss = loss_of(model, batch, dev)
    loss.backward()
    res["loss"] = float(loss.detach())
    grads = {n: p.grad.detach().float().cpu().contiguous() for n, p in lora_params(model).items()}
    res["probe_ours_random"] = probe_logits(model, batch, dev, full)
    del model

    # 2. 20 AdamW steps from our initial adapter.
    model = PeftModel.from_pretrained(load_base(name, tiny, smollm2, dev), os.path.join(fx, "ours_init"),
                                      is_trainable=True)
    model.eval()
    params = list(lora_params(model).values())
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=tuple(HP["betas"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=False, fused=False)
    sched = transformers.get_cosine_schedule_with_warmup(opt, HP["warmup_steps"], STEPS)
    curve, norms, lrs = [], [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, batch, dev)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, HP["max_grad_norm"])
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        curve.append(float(loss))
        norms.append(float(norm))
    res["curve"] = curve
    res["grad_norms"] = norms
    res["lrs"] = lrs
    with torch.no_grad():
        res["loss_after"] = float(loss_of(model, batch, dev))
    od = os.path.join(out, name)
    os.makedirs(od, exist_ok=True)
    model.save_pretrained(os.path.join(od, "peft_trained"))
    res["probe_peft_trained"] = probe_logits(model, batch, dev, full)
    save_file(grads, os.path.join(od, "grads.safetensors"))
    with open(os.path.join(od, "golden.json"), "w") as fh:
        json.dump(res, fh)
    print(f"{name}: loss {res['loss']:.6f}, curve {curve[0]:.4f} -> {curve[-1]:.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--tiny", required=True)
    ap.add_argument("--smollm2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for name in sorted(os.listdir(a.fixtures)):
        if not os.path.isfile(os.path.join(a.fixtures, name, "batch.json")):
            continue
        if name == "smollm2" and not a.smollm2:
            print("smollm2: skipped (no --smollm2)", file=sys.stderr)
            continue
        run_case(name, a.fixtures, a.tiny, a.smollm2, a.out, dev)


if __name__ == "__main__":
    main()
