#!/usr/bin/env python3
"""Golden logits from an independent implementation (PyTorch + transformers) for hf2q's parity tests.

Run on a machine with torch + transformers (the GPU machine); no network needed.

1. Real GGUF checkpoints (`--gguf NAME=PATH`): transformers loads the GGUF (dequantizing every
   tensor to float32 with the `gguf` package), tokenizes a fixed text with the tokenizer it
   builds from the GGUF, and records teacher-forced top-k logits for the last STEPS positions.
2. Tiny random-weight Hugging Face checkpoints (`--tiny DIR`): Llama (llama3 rope scaling),
   Qwen2 (qkv bias), Qwen3 (q/k norm), Gemma 3 (sliding window, sandwich norms), Qwen3-MoE
   (8 experts, top 2, normalised, one dense layer), Mixtral (4 experts, top 2) and Gemma 4
   (dense, and with the routed branch of 8 experts, top 2: sliding and global layers of their
   own head width and KV heads, keys as values on global layers, proportional RoPE, layer
   scalars, soft-capped logits; and as the E2B/E4B, four layers with per-layer embeddings and
   KV-shared layers); and the Llama variants: Phi-3 (fused qkv/gate_up, half the head rotated,
   LongRoPE short factors with its attention factor), Mistral (sliding window 4, shorter than
   the sequence), SmolLM3 (no RoPE on every second layer here), Granite (embedding, residual,
   attention and logit multipliers) and OLMo 2 (post-norms, q/k norms over the whole
   projection); two layers unless said, hidden 64, written by transformers with a byte-level
   tokenizer, plus their full logits.
   `--only NAME` (repeatable) writes only those; the others are still built, so every model's
   random weights are the same whichever are written.

Everything runs in float32 with TF32 off so the reference is as exact as the format allows.
Versions used are written into every fixture (`meta`).
Pinned: transformers 5.17.0 (torch any recent release: float32 on the CPU reproduces the
GPU-written fixtures to the 1e-6 they are rounded to). Write only the Llama variants with
`--tiny DIR --only tiny-phi3 --only tiny-mistral --only tiny-smollm3 --only tiny-granite
--only tiny-olmo2`.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

STEPS = 100
TOPK = 20

# Natural text long enough for STEPS teacher-forced positions after a short prefix.
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books quickly and cheaply. Before that, most books in Europe were copied by hand, a "
    "slow process that made them rare and expensive. Within fifty years, printing shops had opened "
    "in more than two hundred cities, and millions of volumes were in circulation. Scholars could "
    "now compare identical copies of a text, which helped standardize spelling and grammar, and new "
    "ideas spread faster than ever before. def add(a, b):\n    return a + b\n"
)


def meta():
    import gguf  # noqa: F401  (recorded for provenance)
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": getattr(sys.modules["gguf"], "__version__", "unknown"),
        "dtype": "float32",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }


def setup():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)
    return "cuda" if torch.cuda.is_available() else "cpu"


def gguf_golden(name, path, out_dir, dev):
    d, f = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).to(dev).eval()
    ids = tok(TEXT, add_special_tokens=True)["input_ids"]
    if len(ids) < STEPS + 8:
        raise SystemExit(f"{name}: text gives only {len(ids)} tokens")
    x = torch.tensor([ids], device=dev)
    logits = model(x).logits[0].float().cpu()  # (T, V)
    first = len(ids) - STEPS
    steps = []
    for pos in range(first, len(ids)):
        v, i = torch.topk(logits[pos], TOPK)
        steps.append({"pos": pos, "top_ids": i.tolist(), "top_logits": [round(float(a), 5) for a in v]})
    fx = {
        "model": name,
        "file": f,
        "text": TEXT,
        "ids": ids,
        "argmax": [int(logits[p].argmax()) for p in range(len(ids))],
        "steps": steps,
        "meta": meta(),
    }
    with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
        json.dump(fx, fh)
    print(f"{name}: {len(ids)} tokens, first argmax {fx['argmax'][:8]}", flush=True)


def byte_tokenizer(dir_):
    """A byte-level BPE with no merges: 256 byte tokens + 3 specials; small and real."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = bl
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<s>", "</s>", "<pad>"])
    t.save(os.path.join(dir_, "tokenizer.json"))
    with open(os.path.join(dir_, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                   "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                                    "{% if add_generation_prompt %}<s>assistant: {% endif %}"}, fh)
    return t.get_vocab_size()


def tiny_configs(vocab):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Gemma3TextConfig, Qwen3MoeConfig, MixtralConfig
    from transformers import Gemma4TextConfig
    from transformers import Phi3Config, MistralConfig, SmolLM3Config, GraniteConfig, Olmo2Config
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=256, eos_token_id=257, pad_token_id=258)
    gemma4 = dict(**common, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                  attention_k_eq_v=True, rms_norm_eps=1e-6, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0,
                  hidden_size_per_layer_input=0, num_kv_shared_layers=0, hidden_activation="gelu_pytorch_tanh",
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1000000.0}})
    return {
        "tiny-llama": LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "tiny-qwen2": Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
        "tiny-qwen3": Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                  tie_word_embeddings=True),
        "tiny-gemma3": Gemma3TextConfig(**common, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                        rope_local_base_freq=10000.0, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"],
                                        query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh"),
        # Layer 0 routed (8 experts of width 32, top 2, renormalised), layer 1 a dense MLP.
        "tiny-qwen3-moe": Qwen3MoeConfig(**common, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                         tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[1]),
        # Every layer routed; Mixtral's `intermediate_size` is the width of one expert.
        "tiny-mixtral": MixtralConfig(**{**common, "intermediate_size": 48}, rms_norm_eps=1e-5,
                                      rope_theta=1000000.0, tie_word_embeddings=False, num_local_experts=4,
                                      num_experts_per_tok=2),
        # Gemma 4 as the 31B (dense) and the 26B-A4B (routed branch) have it: layer 0 sliding
        # (head width 16, 2 kv heads, window 4), layer 1 global (head width 32, 1 kv head, keys
        # as values, a quarter of each head rotated), soft-capped logits; no per-layer
        # embeddings or KV sharing (those are the E2B/E4B models').
        "tiny-gemma4": Gemma4TextConfig(**gemma4, enable_moe_block=False),
        "tiny-gemma4-moe": Gemma4TextConfig(**gemma4, enable_moe_block=True, num_experts=8, top_k_experts=2,
                                            moe_intermediate_size=32),
        # Gemma 4 as the E2B/E4B have it: per-layer embeddings (width 8), the last two of four
        # layers KV-shared (each reads the last unshared layer of its kind) with double-wide
        # MLPs, values from their own projection on every layer.
        "tiny-gemma4-e": Gemma4TextConfig(**{**gemma4, "num_hidden_layers": 4, "attention_k_eq_v": False,
                                             "layer_types": ["sliding_attention", "full_attention"] * 2,
                                             "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": vocab,
                                             "num_kv_shared_layers": 2, "use_double_wide_mlp": True}),
        # Phi-3/Phi-4: half of each 16-wide head rotated, LongRoPE with 4 short and 4 long factors;
        # max_position / original_max_position = 4 gives the attention factor
        # sqrt(1 + ln 4 / ln 64); the 20 tokens are below original_max_position (short factors).
        "tiny-phi3": Phi3Config(**{**common, "max_position_embeddings": 256}, rms_norm_eps=1e-5,
                                tie_word_embeddings=False, original_max_position_embeddings=64,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5,
                                                 "original_max_position_embeddings": 64,
                                                 "short_factor": [1.0, 1.25, 1.5, 2.0],
                                                 "long_factor": [1.0, 2.0, 4.0, 8.0]}),
        # Mistral: a window of 4 over the 20 tokens; head_dim given apart from hidden / heads.
        "tiny-mistral": MistralConfig(**common, head_dim=32, rms_norm_eps=1e-5, rope_theta=1000000.0,
                                      sliding_window=4, tie_word_embeddings=False),
        # SmolLM3: NoPE every second layer (layer 1), as every fourth in the released model.
        "tiny-smollm3": SmolLM3Config(**common, rms_norm_eps=1e-6, rope_theta=5000000.0,
                                      no_rope_layer_interval=2, tie_word_embeddings=True),
        "tiny-granite": GraniteConfig(**common, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                                      embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.125, logits_scaling=8.0),
        "tiny-olmo2": Olmo2Config(**common, rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False),
    }


def tiny_goldens(out_dir, dev, only):
    torch.manual_seed(1234)
    for name, cfg in tiny_configs(259).items():
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        # Random init leaves norms at exactly 1 (or 0 for Gemma); perturb every parameter so the
        # test sees each weight's role. Routers get a larger spread so routing is decisive.
        for pname, p in model.named_parameters():
            router = pname.endswith("mlp.gate.weight") or pname.endswith("router.proj.weight")
            p.data.add_(torch.randn_like(p) * (0.5 if router else 0.05))
        # Gemma 4's layer scalars are buffers (ones at init): set apart from 1 without drawing.
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):
                b.fill_(0.75 + 0.125 * int(bname.split(".")[2]))
        if only and name not in only:
            continue
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        byte_tokenizer(d)
        model = model.to(dev).eval()
        model.save_pretrained(d, safe_serialization=True)
        ids = [256] + list(range(65, 65 + 19))  # BOS + 19 byte tokens: longer than the window
        logits = model(torch.tensor([ids], device=dev)).logits[0].float().cpu()
        with open(os.path.join(d, "golden.json"), "w") as fh:
            json.dump({"ids": ids, "logits": [[round(float(v), 6) for v in row] for row in logits],
                       "meta": meta()}, fh)
        print(f"{name}: saved", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", action="append", default=[], help="NAME=PATH of a GGUF checkpoint")
    ap.add_argument("--tiny", help="write tiny random HF checkpoints here")
    ap.add_argument("--only", action="append", default=[], help="with --tiny: write only this model")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = setup()
    os.makedirs(a.out, exist_ok=True)
    for spec in a.gguf:
        name, path = spec.split("=", 1)
        gguf_golden(name, path, a.out, dev)
    if a.tiny:
        tiny_goldens(a.tiny, dev, set(a.only))


if __name__ == "__main__":
    main()
