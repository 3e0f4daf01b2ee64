#!/usr/bin/env bash
# LoRA training speed on the CPU: hf2q against mlx-lm's LoRA trainer (`mlx[cpu]`), same model,
# data, rank, targets, batch and sequence length, in one run, alternating the two.
#
#   bench/train_cpu.sh [STEPS] [ROUNDS] [MLX_STEPS]
#
# (mlx-lm's CPU backend ran at 1-2 tokens/s here, one core busy: MLX_STEPS, default 3, keeps its
# share of the run to about a quarter of an hour.)
#
# Model: SmolLM2-135M-Instruct (the default model), converted to a float32 Hugging Face folder
# that both load (hf2q also trains on the Q4_1 GGUF directly: reported as a third row). Data:
# LLaMA-Factory's alpaca_en_demo.json as chat messages. LoRA r 16, alpha 32 (mlx-lm scale 2.0),
# all seven linears of every layer, batch 4, at most 256 tokens, learning rate 2e-4, prompt
# masked, no gradient checkpointing. Tokens/s: all tokens of the steps after the first
# (the first includes start-up), as mlx-lm reports them (the real tokens of each batch).
# Needs: target/release/hf2q, python3; installs mlx[cpu] and mlx-lm into a venv in the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-20}
ROUNDS=${2:-2}
MLX_STEPS=${3:-3}
CACHE="${HF2Q_TEST_CACHE:-$HOME/.cache/hf2q-test}"
WORK="${WORK:-/tmp/hf2q-train-bench}"
BIN=target/release/hf2q
mkdir -p "$WORK"
VENV="$CACHE/mlx-venv"
if [ ! -x "$VENV/bin/mlx_lm.lora" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet "mlx[cpu]" mlx-lm
fi
GGUF=$("$BIN" pull smollm2-135m 2>/dev/null | tail -n 1)
[ -d "$WORK/smollm2-f32" ] || "$BIN" convert "$GGUF" "$WORK/smollm2-f32" --to hf --dtype f32 >&2
ALPACA="$CACHE/data/alpaca_en_demo.json"
[ -f "$ALPACA" ] || { echo "no $ALPACA (scripts/test.sh fetches it)" >&2; exit 1; }
mkdir -p "$WORK/data"
python3 - "$ALPACA" "$WORK/data" <<'EOF'
import json, sys
recs = json.load(open(sys.argv[1]))
def msg(r):
    u = r["instruction"] + ("\n" + r["input"] if r.get("input") else "")
    return {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": r["output"]}]}
with open(sys.argv[2] + "/train.jsonl", "w") as f:
    for r in recs[:900]:
        f.write(json.dumps(msg(r)) + "\n")
with open(sys.argv[2] + "/valid.jsonl", "w") as f:
    for r in recs[900:]:
        f.write(json.dumps(msg(r)) + "\n")
EOF
cat >"$WORK/mlx.yaml" <<EOF
model: $WORK/smollm2-f32
train: true
data: $WORK/data
fine_tune_type: lora
num_layers: -1
batch_size: 4
iters: $MLX_STEPS
val_batches: 1
steps_per_eval: 100000
steps_per_report: 1
learning_rate: 2.0e-4
max_seq_length: 256
mask_prompt: true
grad_checkpoint: false
adapter_path: $WORK/mlx-adapter
lora_parameters:
  rank: 16
  scale: 2.0
  dropout: 0.0
  keys: [self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
EOF

hf2q_rate() { # model -> tokens/s over steps 2..N
    "$BIN" train sft "$1" --data "$WORK/data/train.jsonl" -o "$WORK/hf2q-adapter" --overwrite \
        --steps "$STEPS" --batch 4 --max-seq-len 256 --lora-r 16 --lora-alpha 32 --lr 2e-4 \
        --grad-checkpoint off --device cpu --json 2>/dev/null |
        python3 -c '
import json, sys
toks = secs = 0.0
for line in sys.stdin:
    e = json.loads(line)
    if e["event"] == "step" and e["step"] > 1:
        toks += e["tokens"]; secs += e["tokens"] / e["tokens_per_s"]
print(f"{toks / secs:.1f}")'
}
mlx_rate() { # mlx-lm prints a table: iter, train loss, tok/s, tokens (ANSI colours stripped)
    "$VENV/bin/mlx_lm.lora" -c "$WORK/mlx.yaml" 2>&1 | python3 -c '
import re, sys
rates = []
for line in sys.stdin:
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    m = re.match(r"\s*(\d+)\s+([0-9.]+)\s*[\u25bc\u25b2]?\s+([0-9.]+)\s+([0-9.]+)k?\s*$", line)
    if m:
        rates.append(float(m.group(3)))
rates = rates[1:] or rates
print(f"{sum(rates) / max(len(rates), 1):.1f}" if rates else "failed")'
}

echo "| round | hf2q (f32 HF folder) | hf2q (Q4_1 GGUF) | mlx-lm (f32 HF folder) |"
echo "|---|---|---|---|"
for r in $(seq 1 "$ROUNDS"); do
    a=$(hf2q_rate "$WORK/smollm2-f32")
    b=$(hf2q_rate "$GGUF")
    c=$(mlx_rate)
    echo "| $r | $a | $b | $c |"
done
