#!/usr/bin/env python3
"""Tiny random checkpoints and golden logits for the families whose reference is not a plain
`from_config` of transformers: MiniCPM (remote code only) and GPT-OSS (MXFP4 experts).

Run on a machine with torch + transformers 5.17 (no network, no `gguf` package needed):

    python3 scripts/goldens/make_family_goldens.py --tiny DIR

writes DIR/tiny-minicpm and DIR/tiny-gpt-oss (config.json, model.safetensors, a byte-level
tokenizer as make_goldens.py writes it, golden.json with the full logits of the ids below).

- tiny-minicpm: `MiniCPMForCausalLM` (model_type "minicpm") has no transformers class; its
  logits come from `minicpm_forward` below, a plain PyTorch transcription of the published
  modeling_minicpm.py (openbmb/MiniCPM-2B / 1B): embeddings times `scale_emb`, each block half
  added as `h + f(norm(h)) * scale_depth / sqrt(num_hidden_layers)`, the final norm's output
  divided by `hidden_size / dim_model_base` before the (tied) head; otherwise Llama (RMSNorm,
  rotate-half RoPE, grouped KV, SiLU-gated MLP). Cross-checked here against transformers'
  LlamaForCausalLM holding the same weights with the three scales folded in (the embedding
  times scale_emb, o_proj and down_proj times the residual scale, an untied head divided by the
  width ratio): the two must agree to 1e-4 or the script stops.
- tiny-gpt-oss: transformers' GptOssForCausalLM (2 layers: sliding window 4, then full; 4
  experts, top 2; attention sinks; YaRN with original context 64, factor 4; q/k/v/o and expert
  biases; the clamped SwiGLU). The experts' weights are drawn as MXFP4 (random e2m1 codes, e8m0
  scales 2^-7..2^-4) and the float model holds exactly their dequantized values (transformers'
  own `convert_moe_packed_tensors`); the checkpoint stores them as the released model does
  (`*_blocks (E, R, C/32, 16)` uint8 with two codes a byte, low nibble first, `*_scales
  (E, R, C/32)` uint8, `quantization_config.quant_method = "mxfp4"`). The saved folder is read
  back by transformers (`Mxfp4Config(dequantize=True)`), which checks the packing: that path
  runs in bfloat16 (the dequantized experts are exact in it, the activations are not), so its
  logits are compared loosely, 0.1 against logits spread ~0.44 (measured: 2.0e-2); a misread
  packing (nibble order, row order, scale bias) changes the experts entirely and the logits
  by their own size.

Everything in float32 with TF32 off. Pinned: transformers 5.17.0.
"""
import argparse
import json
import math
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_goldens import byte_tokenizer  # noqa: E402

VOCAB = 259
IDS = [256] + list(range(65, 65 + 19))  # BOS + 19 byte tokens: longer than the window


def meta():
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": "float32",
        "device": "cpu",
    }


def write_golden(d, logits):
    with open(os.path.join(d, "golden.json"), "w") as fh:
        json.dump({"ids": IDS, "logits": [[round(float(v), 6) for v in row] for row in logits],
                   "meta": meta()}, fh)


# ---------------------------------------------------------------- MiniCPM

MINICPM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=10000.0, scale_emb=12.0, scale_depth=1.4,
               dim_model_base=16, tie_word_embeddings=True, hidden_act="silu",
               bos_token_id=256, eos_token_id=257, pad_token_id=258)


def minicpm_weights(c, g):
    """Random weights under MiniCPM's (= Llama's) parameter names."""
    d, f = c["hidden_size"], c["intermediate_size"]
    dh = d // c["num_attention_heads"]
    hq, hkv = c["num_attention_heads"] * dh, c["num_key_value_heads"] * dh
    r = lambda *s, std=0.05: torch.randn(*s, generator=g) * std  # noqa: E731
    w = {"model.embed_tokens.weight": r(c["vocab_size"], d, std=0.02),
         "model.norm.weight": 1 + r(d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w.update({f"{p}.input_layernorm.weight": 1 + r(d), f"{p}.post_attention_layernorm.weight": 1 + r(d),
                  f"{p}.self_attn.q_proj.weight": r(hq, d, std=0.1), f"{p}.self_attn.k_proj.weight": r(hkv, d, std=0.1),
                  f"{p}.self_attn.v_proj.weight": r(hkv, d, std=0.1), f"{p}.self_attn.o_proj.weight": r(d, hq, std=0.1),
                  f"{p}.mlp.gate_proj.weight": r(f, d, std=0.1), f"{p}.mlp.up_proj.weight": r(f, d, std=0.1),
                  f"{p}.mlp.down_proj.weight": r(d, f, std=0.1)})
    return w


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def minicpm_forward(c, w, ids):
    """modeling_minicpm.py's forward (no cache, causal), written out: (T,) -> (T, V)."""
    d, nl = c["hidden_size"], c["num_hidden_layers"]
    h, hkv = c["num_attention_heads"], c["num_key_value_heads"]
    dh, eps = d // h, c["rms_norm_eps"]
    t = len(ids)
    x = w["model.embed_tokens.weight"][torch.tensor(ids)] * c["scale_emb"]
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.full((t, t), float("-inf")).triu(1)
    res = c["scale_depth"] / math.sqrt(nl)
    for i in range(nl):
        p = f"model.layers.{i}"
        a = rms(x, w[f"{p}.input_layernorm.weight"], eps)
        q = (a @ w[f"{p}.self_attn.q_proj.weight"].T).view(t, h, dh).transpose(0, 1)
        k = (a @ w[f"{p}.self_attn.k_proj.weight"].T).view(t, hkv, dh).transpose(0, 1)
        v = (a @ w[f"{p}.self_attn.v_proj.weight"].T).view(t, hkv, dh).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(h // hkv, 0), v.repeat_interleave(h // hkv, 0)
        s = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(dh) + mask, dim=-1)
        o = (s @ v).transpose(0, 1).reshape(t, d) @ w[f"{p}.self_attn.o_proj.weight"].T
        x = x + o * res
        m = rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        m = (torch.nn.functional.silu(m @ w[f"{p}.mlp.gate_proj.weight"].T) * (m @ w[f"{p}.mlp.up_proj.weight"].T)) \
            @ w[f"{p}.mlp.down_proj.weight"].T
        x = x + m * res
    x = rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return (x / (d / c["dim_model_base"])) @ head.T


def minicpm_via_llama(c, w, ids):
    """The same model as transformers' Llama with the scales folded into the weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{k: v for k, v in c.items() if k not in ("scale_emb", "scale_depth", "dim_model_base")})
    cfg.tie_word_embeddings = False
    m = LlamaForCausalLM(cfg).eval()
    res = c["scale_depth"] / math.sqrt(c["num_hidden_layers"])
    sd = {}
    for n, v in w.items():
        if n.endswith(("o_proj.weight", "down_proj.weight")):
            v = v * res
        sd[n] = v
    sd["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * c["scale_emb"]
    sd["lm_head.weight"] = w["model.embed_tokens.weight"] / (c["hidden_size"] / c["dim_model_base"])
    m.load_state_dict(sd, strict=True)
    return m(torch.tensor([ids])).logits[0]


def write_minicpm(out, g):
    c = MINICPM
    w = minicpm_weights(c, g)
    logits = minicpm_forward(c, w, IDS)
    ref = minicpm_via_llama(c, w, IDS)
    err = float((logits - ref).abs().max())
    print(f"tiny-minicpm: reference vs folded Llama max |d| {err:.2e}", flush=True)
    if err > 1e-4:
        raise SystemExit("tiny-minicpm: the reference disagrees with transformers' Llama")
    d = os.path.join(out, "tiny-minicpm")
    os.makedirs(d, exist_ok=True)
    byte_tokenizer(d)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})
    cfg = {"architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm", "torch_dtype": "float32", **c}
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    write_golden(d, logits)
    print("tiny-minicpm: saved", flush=True)


# ---------------------------------------------------------------- GPT-OSS

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def random_mxfp4(g, e, rows, cols):
    """Random MXFP4 `(E, rows, cols)`: blocks (E, rows, cols/32, 16) uint8, scales (E, rows, cols/32)."""
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(120, 124, (e, rows, cols // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return blocks, scales


def dequant_mxfp4(blocks, scales):
    """(E, R, G, 16), (E, R, G) -> (E, R, G*32) float32: lut[code] * 2^(scale - 127), low nibble first."""
    lut = torch.tensor(FP4, dtype=torch.float64)
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    vals = torch.stack((lut[lo], lut[hi]), dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return vals.reshape(*blocks.shape[:-2], -1).float()


def write_gpt_oss(out, g):
    from transformers import AutoModelForCausalLM, GptOssConfig
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       attention_bias=True, bos_token_id=256, eos_token_id=257, pad_token_id=258,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                        "original_max_position_embeddings": 64})
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32, attn_implementation="eager").eval()
    for n, p in model.named_parameters():
        spread = 0.5 if n.endswith(("router.weight", "sinks")) else 0.05
        p.data.add_(torch.randn(p.shape, generator=g) * spread)
    e, f, d = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
    packed = {}
    for i, layer in enumerate(model.model.layers):
        gu_b, gu_s = random_mxfp4(g, e, 2 * f, d)  # rows: gate 0, up 0, gate 1, up 1, ...
        dn_b, dn_s = random_mxfp4(g, e, d, f)
        layer.mlp.experts.gate_up_proj.data.copy_(dequant_mxfp4(gu_b, gu_s).transpose(1, 2))
        layer.mlp.experts.down_proj.data.copy_(dequant_mxfp4(dn_b, dn_s).transpose(1, 2))
        p = f"model.layers.{i}.mlp.experts"
        packed.update({f"{p}.gate_up_proj_blocks": gu_b, f"{p}.gate_up_proj_scales": gu_s,
                       f"{p}.down_proj_blocks": dn_b, f"{p}.down_proj_scales": dn_s})
    res = model(torch.tensor([IDS]), output_hidden_states=True)
    logits = res.logits[0].float()
    d_ = os.path.join(out, "tiny-gpt-oss")
    os.makedirs(d_, exist_ok=True)
    if os.environ.get("HIDDEN_STATES_TO"):  # per-layer hidden states, for debugging a mismatch
        with open(os.environ["HIDDEN_STATES_TO"], "w") as fh:
            json.dump([[[round(float(v), 6) for v in row] for row in h[0]] for h in res.hidden_states], fh)
    byte_tokenizer(d_)
    sd = {n: t.detach().contiguous() for n, t in model.state_dict().items()
          if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    sd.update(packed)
    save_file(sd, os.path.join(d_, "model.safetensors"), metadata={"format": "pt"})
    cj = cfg.to_dict()
    cj["architectures"] = ["GptOssForCausalLM"]
    cj["quantization_config"] = {"quant_method": "mxfp4",
                                 "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}
    with open(os.path.join(d_, "config.json"), "w") as fh:
        json.dump(cj, fh, indent=2)
    write_golden(d_, logits)
    # Read the folder back as transformers does (dequantizing the experts): same logits.
    try:
        from transformers import Mxfp4Config
        back = AutoModelForCausalLM.from_pretrained(d_, torch_dtype=torch.float32, device_map="cpu",
                                                    quantization_config=Mxfp4Config(dequantize=True),
                                                    attn_implementation="eager").eval()
        err = float((back(torch.tensor([IDS])).logits[0].float() - logits).abs().max())
        print(f"tiny-gpt-oss: read back by transformers, max |d| {err:.2e}", flush=True)
        if err > 0.1:
            raise SystemExit("tiny-gpt-oss: transformers reads the packed experts differently")
    except SystemExit:
        raise
    except Exception as ex:  # a missing optional dependency: report, keep the fixture
        print(f"tiny-gpt-oss: read-back skipped: {type(ex).__name__}: {ex}", flush=True)
    print("tiny-gpt-oss: saved", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", required=True, help="write the tiny checkpoints here")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(2468)
    write_minicpm(a.tiny, g)
    write_gpt_oss(a.tiny, g)


if __name__ == "__main__":
    main()
