#!/usr/bin/env python3
"""MLX affine-quantized folders written by mlx-lm itself, plus mlx-lm's logits, for hf2q's
`crates/models/tests/mlx_parity.rs`.

Runs on any CPU (no GPU, no network):

    python3 -m venv VENV && VENV/bin/pip install "mlx[cpu]==0.32.4" "mlx-lm==0.32.2"
    VENV/bin/python scripts/goldens/make_mlx_goldens.py

For each tiny random Hugging Face checkpoint under `crates/models/tests/fixtures/tiny/` this

1. stages a copy whose config.json also carries the pre-transformers-5 keys that this mlx-lm
   version reads for the family (`rope_theta`/`rope_scaling` for Llama and Qwen2,
   `sliding_window_pattern` for Gemma 3; the `rope_parameters` / `layer_types` written by
   transformers 5 are kept, so both readings describe the same model),
2. checks that mlx-lm reads the staged float checkpoint as transformers does (its logits
   against the tiny fixture's transformers golden),
3. converts it with `mlx_lm.convert(..., quantize=True)` into
   `crates/models/tests/fixtures/mlx/<name>/` (one quantization recipe per model, below),
4. loads that folder with `mlx_lm.load` and records the logits for the tiny golden's ids, in
   float32, into `<name>/golden.json` (every value printed with 9 significant digits, which
   round-trips a float32 exactly).

Recipes (hidden size 64, intermediate 128, vocab 259: every group divides the row length):

- mlx-llama-q4g32: 4 bits, group 32, untied lm_head.
- mlx-qwen3-q8g64: 8 bits, group 64, tied embeddings (lm_head = embed_tokens.as_linear).
- mlx-gemma3-mixed: default 4 bits group 64, with per-layer overrides that mlx-lm writes into
  config.json's `quantization` block under the module path (2/3/5/6/8 bits, groups 32/64/128),
  one Linear left unquantized (float), tied embeddings quantized at 6 bits.
- mlx-qwen2-mixed-bf16: mlx-lm's own `mixed_3_6` recipe, group 32, converted with
  dtype=bfloat16 (bf16 scales/biases/norms, as most published MLX folders have). mlx-lm would
  then compute in bf16; to compare weights rather than bf16 rounding, the loaded mlx-lm model
  is cast to float32 (lossless for bf16 values) before the forward pass.
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_map
from mlx_lm import convert, load

PINNED = {"mlx": "0.32.4", "mlx_lm": "0.32.2"}

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "crates/models/tests/fixtures/tiny"
OUT = ROOT / "crates/models/tests/fixtures/mlx"

# mlx-lm's float forward vs transformers' (both float32, CPU vs whatever made the tiny golden,
# rounded to 1e-6 there): summation order only, so 1e-4 catches any misread config key.
STAGE_TOL = 1e-4


def check_versions():
    got = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
    if got != PINNED:
        sys.exit(f"pinned versions {PINNED}, found {got}: install the pinned ones")


def gemma3_predicate(path, module):
    """Per-layer overrides of several widths; anything not named keeps the default (4, 64)."""
    table = {
        "model.embed_tokens": {"group_size": 32, "bits": 6, "mode": "affine"},
        "model.layers.0.self_attn.q_proj": {"group_size": 32, "bits": 3, "mode": "affine"},
        "model.layers.0.self_attn.k_proj": {"group_size": 64, "bits": 5, "mode": "affine"},
        "model.layers.0.self_attn.v_proj": {"group_size": 32, "bits": 8, "mode": "affine"},
        "model.layers.0.mlp.down_proj": {"group_size": 128, "bits": 6, "mode": "affine"},
        "model.layers.1.mlp.up_proj": {"group_size": 32, "bits": 2, "mode": "affine"},
    }
    if path in table:
        return table[path]
    if path == "model.layers.1.mlp.gate_proj":
        return False  # stays float
    return True


MODELS = [
    # (output name, tiny source, config additions for this mlx-lm, convert kwargs)
    ("mlx-llama-q4g32", "tiny-llama", "llama", dict(q_bits=4, q_group_size=32)),
    ("mlx-qwen3-q8g64", "tiny-qwen3", None, dict(q_bits=8, q_group_size=64)),
    ("mlx-gemma3-mixed", "tiny-gemma3", "gemma3", dict(q_bits=4, q_group_size=64, quant_predicate=gemma3_predicate)),
    ("mlx-qwen2-mixed-bf16", "tiny-qwen2", "qwen2", dict(q_group_size=32, quant_predicate="mixed_3_6", dtype="bfloat16")),
]


def stage_config(cfg, family):
    """Adds the legacy keys this mlx-lm reads; the transformers-5 keys stay as they are."""
    rp = cfg.get("rope_parameters") or {}
    if family == "llama":
        # mlx-lm's llama reads top-level rope_theta/rope_scaling only.
        cfg["rope_theta"] = rp["rope_theta"]
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    elif family == "qwen2":
        cfg["rope_theta"] = rp["rope_theta"]
    elif family == "gemma3":
        # mlx-lm's gemma3_text reads sliding_window_pattern (default 6), not layer_types;
        # and the per-layer-type rope thetas as rope_theta / rope_local_base_freq.
        lt = cfg["layer_types"]
        pattern = lt.index("full_attention") + 1
        want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(len(lt))]
        assert want == lt, f"layer_types {lt} is not a sliding_window_pattern"
        cfg["sliding_window_pattern"] = pattern
        cfg["rope_theta"] = rp["full_attention"]["rope_theta"]
        cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    return cfg


def logits_of(model, ids):
    out = model(mx.array([ids], dtype=mx.int32))  # (1, T, V)
    out = out[0].astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def to_f32(model):
    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))


def fmt_rows(rows):
    return "[" + ",\n".join("[" + ",".join(f"{float(x):.9g}" for x in r) + "]" for r in rows) + "]"


def main():
    check_versions()
    mx.set_default_device(mx.cpu)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, src, family, kw in MODELS:
            tiny = TINY / src
            golden = json.loads((tiny / "golden.json").read_text())
            ids = golden["ids"]
            stage = Path(tmp) / src
            shutil.copytree(tiny, stage)
            (stage / "golden.json").unlink()
            cfg = stage_config(json.loads((stage / "config.json").read_text()), family)
            (stage / "config.json").write_text(json.dumps(cfg, indent=2))

            model, _ = load(str(stage))
            err = float(np.abs(logits_of(model, ids) - np.array(golden["logits"], dtype=np.float32)).max())
            print(f"{name}: staged float checkpoint, mlx-lm vs transformers max |d| {err:.2e}")
            if err > STAGE_TOL:
                sys.exit(f"{name}: mlx-lm reads the staged config differently from transformers")

            dst = OUT / name
            if dst.exists():
                shutil.rmtree(dst)
            convert(str(stage), str(dst), quantize=True, **kw)
            for extra in ["README.md"]:
                (dst / extra).unlink(missing_ok=True)

            model, _ = load(str(dst))
            if kw.get("dtype") == "bfloat16":
                to_f32(model)
            logits = logits_of(model, ids)
            qcfg = json.loads((dst / "config.json").read_text())["quantization"]
            meta = {
                "mlx": mx.__version__,
                "mlx_lm": mlx_lm.__version__,
                "numpy": np.__version__,
                "device": "cpu",
                "dtype": "float32",
                "source": f"tiny/{src}",
                "convert": {k: (v if isinstance(v, (int, str)) else "custom predicate") for k, v in kw.items()},
            }
            if kw.get("dtype") == "bfloat16":
                meta["note"] = "bf16 folder; mlx-lm model cast to float32 after load"
            text = (
                '{"ids": ' + json.dumps(ids) + ',\n"quantization": ' + json.dumps(qcfg)
                + ',\n"meta": ' + json.dumps(meta) + ',\n"logits": ' + fmt_rows(logits) + "}\n"
            )
            (dst / "golden.json").write_text(text)
            size = sum(p.stat().st_size for p in dst.iterdir())
            print(f"{name}: {len(ids)} x {logits.shape[1]} logits, folder {size / 1024:.0f} KB, quantization {qcfg}")


if __name__ == "__main__":
    main()
