#!/usr/bin/env python3
"""PEFT + transformers LoRA training speed on a CUDA GPU, the peer of `hf2q train sft` there.

    train_gpu_peft.py --shape llama-3.2-1b|llama-3.1-8b [--checkpointing] [--steps N] [--json]

Random weights at the real shape (bf16, sdpa attention), LoRA r 16 / alpha 32 on all seven
linears of every layer, AdamW (torch, fused=False), batch 8 x 1024 tokens of random ids, loss on
every token; with --checkpointing, transformers' gradient checkpointing (use_reentrant=False).
Reports tokens/s over the steps after two warm-up steps (CUDA-synchronised wall time) and the
peak allocated memory (torch.cuda.max_memory_allocated).
"""
import argparse
import json
import time

import torch
import transformers
import peft
from transformers import LlamaConfig, AutoModelForCausalLM

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
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
    opt = torch.optim.AdamW(params, lr=2e-4, fused=False)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(a.steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    toks = a.batch * a.seq * len(times) / sum(times)
    res = {"peer": "peft", "shape": a.shape, "checkpointing": a.checkpointing, "tokens_per_s": round(toks, 1),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "steps": len(times),
           "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
           "device": torch.cuda.get_device_name(0)}
    print(json.dumps(res) if a.json else res, flush=True)


if __name__ == "__main__":
    main()
