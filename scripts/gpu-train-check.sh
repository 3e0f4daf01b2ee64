#!/usr/bin/env bash
# Training on a CUDA machine in one go: the CUDA training op tests, the GPU trainer against the
# CPU trainer, PEFT goldens of the tiny checkpoints, and LoRA training speed against PEFT at
# real shapes (random weights), with a summary table at the end.
#
#   scripts/gpu-train-check.sh BIN_DIR [SHAPES]
#
# BIN_DIR holds binaries built elsewhere: hf2q, cuda_train (`cargo test --release -p
# hf2q-cuda --test cuda_train --no-run`), gpu_trainer (`... -p hf2q-train --test gpu_trainer
# --no-run`); BIN_DIR/home is used as HF2Q_HOME (a kernel cache filled beforehand is reused).
# SHAPES: llama-3.2-1b, llama-3.1-8b or both (default: llama-3.2-1b). OPS=0, TRAINER=0 and
# GOLDENS=0 skip the op tests, the trainer test and the goldens; PEFT=0 skips the PEFT runs;
# DPO=0 skips the DPO comparison (bench/train_dpo_gpu.py: hf2q train dpo against TRL-style DPO
# with PEFT, 1B shape, 8 pairs x 512 tokens per side);
# CKPTS lists hf2q's --grad-checkpoint settings to time (default "on off"); Q4=0 skips the
# Q4_K_M base.
# Writes logs and results under $OUT (or /tmp).
set -uo pipefail
BIN=$(cd "${1:?usage: gpu-train-check.sh BIN_DIR [SHAPES]}" && pwd)
SHAPES=${2:-llama-3.2-1b}
OUT_DIR=${OUT:-/tmp/hf2q-train-check}
WORK=${WORK:-/tmp/hf2q-train-work}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT_DIR" "$WORK"
export HF2Q_HOME="$BIN/home"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
export PYTHONUNBUFFERED=1
SUM="$OUT_DIR/summary.md"
: >"$SUM"
TOK="$ROOT/crates/models/tests/fixtures/tiny/tiny-llama"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT_DIR/gpu.txt"

if [ "${OPS:-1}" = 1 ]; then
    echo "== CUDA training op tests"
    (cd "$ROOT/crates/cuda" && "$BIN/cuda_train" --test-threads 1) >"$OUT_DIR/cuda_train.log" 2>&1 \
        && echo "| CUDA training op tests | pass |" >>"$SUM" || echo "| CUDA training op tests | FAIL |" >>"$SUM"
    tail -3 "$OUT_DIR/cuda_train.log"
fi
if [ "${TRAINER:-1}" = 1 ]; then
    echo "== GPU trainer vs CPU trainer (tiny models, a synthesized SmolLM2 shape)"
    "$BIN/hf2q" synth --shape smollm2-135m --type q8_0 --vocab-from "$TOK" "$WORK/smollm2-synth.gguf" >/dev/null 2>&1
    (cd "$ROOT/crates/train" && HF2Q_TEST_SMOLLM2_GGUF="$WORK/smollm2-synth.gguf" "$BIN/gpu_trainer" --test-threads 1 --nocapture) \
        >"$OUT_DIR/gpu_trainer.log" 2>&1 \
        && echo "| GPU trainer vs CPU | pass |" >>"$SUM" || echo "| GPU trainer vs CPU | FAIL |" >>"$SUM"
    grep -E "loss cpu|adapter decode|test result|worst" "$OUT_DIR/gpu_trainer.log"
fi
if [ "${GOLDENS:-1}" = 1 ]; then
    echo "== PEFT goldens (tiny checkpoints)"
    python3 "$ROOT/scripts/goldens/make_peft_goldens.py" --fixtures "$ROOT/crates/train/tests/fixtures/peft" \
        --tiny "$ROOT/crates/models/tests/fixtures/tiny" --out "$WORK/goldens" >"$OUT_DIR/goldens.log" 2>&1 \
        && tar -czf "$OUT_DIR/goldens.tar.gz" -C "$WORK/goldens" . \
        && echo "| PEFT goldens | written |" >>"$SUM" || echo "| PEFT goldens | FAIL |" >>"$SUM"
    grep -E "loss" "$OUT_DIR/goldens.log"
fi

echo "== training data (random words, records longer than 1024 bytes: 1024 tokens each)"
python3 - "$WORK/text.jsonl" <<'PY'
import json, random, sys
random.seed(0)
words = ["".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(random.randint(2, 9))) for _ in range(3000)]
with open(sys.argv[1], "w") as f:
    for _ in range(200):
        f.write(json.dumps({"text": " ".join(random.choice(words) for _ in range(260))}) + "\n")
PY

ours() { # model file, checkpointing -> "tokens/s peak_GiB"
    "$BIN/hf2q" train sft "$1" --data "$WORK/text.jsonl" -o "$WORK/adapter" --overwrite --device cuda \
        --steps 8 --batch 8 --max-seq-len 1024 --train-on-prompt --lora-r 16 --lora-alpha 32 \
        --grad-checkpoint "$2" --json 2>"$OUT_DIR/ours-$(basename "$1")-$2.err" |
        python3 -c '
import json, sys
t = s = 0.0; mem = 0.0
for line in sys.stdin:
    e = json.loads(line)
    if e["event"] == "step":
        mem = max(mem, e.get("device_memory_gib", 0.0))
        if e["step"] > 2:
            t += e["tokens"]; s += e["tokens"] / e["tokens_per_s"]
print(f"{t / s:.0f} {mem:.1f}" if s else "failed -")'
}
peft() { # shape, extra flag -> "tokens/s peak_GiB"
    python3 "$ROOT/bench/train_gpu_peft.py" --shape "$1" $2 --json 2>"$OUT_DIR/peft-$1$2.err" |
        python3 -c 'import json,sys; r=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(r["tokens_per_s"], r["peak_gib"])' \
        || echo "failed -"
}

echo "| shape | weights | run | tokens/s | peak GiB |" >>"$SUM"
echo "|---|---|---|---|---|" >>"$SUM"
for shape in $SHAPES; do
    for ty in bf16 $([ "${Q4:-1}" = 1 ] && echo q4_k_m); do
        f="$WORK/$shape-$ty.gguf"
        [ -f "$f" ] || "$BIN/hf2q" synth --shape "$shape" --type "$ty" --vocab-from "$TOK" "$f" >/dev/null 2>&1
    done
    for ck in ${CKPTS:-on off}; do
        r=$(ours "$WORK/$shape-bf16.gguf" "$ck"); echo "| $shape | bf16 | hf2q, checkpointing $ck | ${r% *} | ${r#* } |" | tee -a "$SUM"
    done
    if [ "${Q4:-1}" = 1 ]; then
        r=$(ours "$WORK/$shape-q4_k_m.gguf" on); echo "| $shape | q4_k_m | hf2q, checkpointing on | ${r% *} | ${r#* } |" | tee -a "$SUM"
    fi
    if [ "${PEFT:-1}" = 1 ]; then
        r=$(peft "$shape" --checkpointing); echo "| $shape | bf16 | PEFT, checkpointing on | ${r% *} | ${r#* } |" | tee -a "$SUM"
        [ "$shape" = llama-3.2-1b ] && { r=$(peft "$shape" ""); echo "| $shape | bf16 | PEFT, checkpointing off | ${r% *} | ${r#* } |" | tee -a "$SUM"; }
    fi
done
if [ "${DPO:-1}" = 1 ]; then
    echo "== DPO: hf2q train dpo against TRL-style DPO with PEFT"
    python3 "$ROOT/bench/train_dpo_gpu.py" --hf2q "$BIN/hf2q" --work "$WORK/dpo" >"$OUT_DIR/dpo.md" 2>"$OUT_DIR/dpo.err" \
        || echo "| DPO bench | FAIL (see dpo.err) |" >>"$SUM"
    cat "$OUT_DIR/dpo.md"
fi
echo; cat "$SUM"
