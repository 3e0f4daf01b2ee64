#!/usr/bin/env python3
"""DPO goldens for hf2q's DPO parity test (crates/train/tests/dpo_parity.rs).

Pinned versions (the ones these fixtures were made with): torch 2.15.0, transformers 5.17.0,
peft 0.21.0; CPU, float32, eager attention. No network needed.

    make_dpo_goldens.py --fixtures crates/train/tests/fixtures/peft \
        --tiny crates/models/tests/fixtures/tiny --out crates/train/tests/fixtures/dpo

For each tiny case NAME (its `ours_random/` adapter under --fixtures, written by hf2q: random A
and B), it builds a batch of two preference pairs (byte-level ids, BOS 256 first; targets on the
completion rows only, the prompt's rows -100) and computes TRL's sigmoid DPO loss
(`trl.DPOTrainer`, loss_type="sigmoid", label_smoothing 0):

    logits = (pi_c - ref_c) - (pi_r - ref_r);  loss = mean(-logsigmoid(beta * logits))

with pi = the sum of the completion tokens' log-probabilities under the policy (PEFT loading
`ours_random`), each sequence run alone (no padding), and two references:

- "base": the same PeftModel with its adapter disabled (`model.disable_adapter()`), beta 0.1;
- "ref_adapter": a second adapter (`ours_random` with B scaled by -0.5, A by 0.75, saved by
  PEFT as NAME/dpo_ref/), beta 0.5.

Writes --out/NAME/golden.json (batch, per case: beta, loss, the four policy and reference
log-probs, TRL's metrics) and --out/NAME/grads_CASE.safetensors (every LoRA factor's gradient).
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
import transformers
import peft
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

PAIRS = [
    ("Q: What is two plus three? A:", " Five.", " Six, I think."),
    ("The capital of France is", " Paris.", " a city in Spain."),
]
CASES = [("base", 0.1), ("ref_adapter", 0.5)]


def batch():
    ids, targets, lengths = [], [], []
    for prompt, chosen, rejected in PAIRS:
        for reply in (chosen, rejected):
            seq = [256] + list(prompt.encode()) + list(reply.encode())
            start = 1 + len(prompt.encode())  # first completion token
            for i in range(len(seq)):
                targets.append(seq[i + 1] if i + 1 < len(seq) and i + 1 >= start else -100)
            ids += seq
            lengths.append(len(seq))
    return {"ids": ids, "targets": targets, "lengths": lengths}


def seq_logps(model, b):
    out, start = [], 0
    for length in b["lengths"]:
        x = torch.tensor([b["ids"][start:start + length]])
        t = torch.tensor(b["targets"][start:start + length])
        lp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        mask = t >= 0
        out.append(lp[mask, t[mask]].sum())
        start += length
    return torch.stack(out)


def load_base(tiny, name):
    return AutoModelForCausalLM.from_pretrained(os.path.join(tiny, name), torch_dtype=torch.float32,
                                                attn_implementation="eager")


def run(name, fixtures, tiny, out):
    b = batch()
    od = os.path.join(out, name)
    os.makedirs(od, exist_ok=True)
    # The reference adapter: ours_random changed so that it differs from the policy.
    refm = PeftModel.from_pretrained(load_base(tiny, name), os.path.join(fixtures, name, "ours_random"))
    with torch.no_grad():
        for n, p in refm.named_parameters():
            if "lora_B" in n:
                p.mul_(-0.5)
            elif "lora_A" in n:
                p.mul_(0.75)
    refm.save_pretrained(os.path.join(od, "dpo_ref"))
    os.remove(os.path.join(od, "dpo_ref", "README.md"))  # the model card: nothing the test reads
    refm.eval()
    res = {"batch": b, "meta": {"torch": torch.__version__, "transformers": transformers.__version__,
                                "peft": peft.__version__, "dtype": "float32", "device": "cpu"}}
    for case, beta in CASES:
        model = PeftModel.from_pretrained(load_base(tiny, name), os.path.join(fixtures, name, "ours_random"),
                                          is_trainable=True)
        model.eval()  # dropout 0; every module deterministic
        with torch.no_grad():
            if case == "base":
                with model.disable_adapter():
                    ref = seq_logps(model, b)
            else:
                ref = seq_logps(refm, b)
        pi = seq_logps(model, b)
        pc, pr, rc, rr = pi[0::2], pi[1::2], ref[0::2], ref[1::2]
        logits = (pc - rc) - (pr - rr)
        loss = (-F.logsigmoid(beta * logits)).mean()
        loss.backward()
        cr, rj = beta * (pc - rc).detach(), beta * (pr - rr).detach()
        res[case] = {
            "beta": beta,
            "loss": float(loss),
            "policy_logps": [float(v) for v in pi.detach()],
            "ref_logps": [float(v) for v in ref],
            "rewards/chosen": float(cr.mean()),
            "rewards/rejected": float(rj.mean()),
            "rewards/margins": float((cr - rj).mean()),
            "rewards/accuracies": float((cr > rj).float().mean()),
            "logps/chosen": float(pc.detach().mean()),
            "logps/rejected": float(pr.detach().mean()),
        }
        grads = {n.replace(".default", ""): p.grad.detach().float().contiguous()
                 for n, p in model.named_parameters() if p.requires_grad}
        save_file(grads, os.path.join(od, f"grads_{case}.safetensors"))
        print(f"{name} {case}: loss {float(loss):.6f}, margins {res[case]['rewards/margins']:.6f}", flush=True)
    with open(os.path.join(od, "golden.json"), "w") as fh:
        json.dump(res, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--tiny", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="tiny-llama,tiny-qwen3")
    a = ap.parse_args()
    torch.manual_seed(0)
    for name in a.cases.split(","):
        run(name, a.fixtures, a.tiny, a.out)


if __name__ == "__main__":
    main()
