#!/usr/bin/env bash
# The batched decode step on one CUDA machine: the paged step bench at several batch sizes, the
# same with graphs up to 128 rows, per-kernel times of a 16- and a 64-row graph step (Nsight
# Compute), and the server at 16 and 64 clients, on a synthesized Llama-3.2-1B Q4_0.
#
#   bench/step-gpu.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR holds a release `hf2q` and the `paged_step` test binary (crates/models/tests/
# paged_step.rs), built elsewhere; every `paged_step*` binary there is measured (e.g. one built
# before a change beside one after it). Writes OUT_DIR/steps-BINARY-OPTIONS.txt, ncu-ROWS.csv
# (`ncu --csv --page raw`, one line per kernel of the profiled pass: sum gpu__time_duration.sum
# by kernel name to see where a step goes), serve/ (bench/serve-gpu.sh's table) and logs.
# Environment: WORK (default /tmp/hf2q-step), ROWS (1,16,32,48,64,96,128), SERVE_CONFIGS
# (bench/serve-gpu.sh's CONFIGS; default `default;g64:paged-graphs=64`), SERVE=0 to skip it,
# NCU_ROWS (batch sizes to profile, default "16 64"; empty: none).
set -uo pipefail
BIN=$(cd "${1:?usage: step-gpu.sh BIN_DIR [OUT_DIR]}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=${2:-${OUT:-/tmp/hf2q-step/out}}
WORK=${WORK:-/tmp/hf2q-step}
ROWS=${ROWS:-1,16,32,48,64,96,128}
mkdir -p "$WORK" "$OUT_DIR"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
export HF2Q_HOME="$WORK/home"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT_DIR/gpu.txt"
M="$WORK/llama-3.2-1b-q4_0.gguf"
if [ ! -f "$M" ]; then
    python3 "$ROOT/bench/synth_vocab.py" "$WORK/vocab" 128256 >/dev/null || exit 1
    "$BIN/hf2q" synth --shape llama-3.2-1b --type q4_0 --vocab-from "$WORK/vocab" "$M" \
        >"$OUT_DIR/synth.log" 2>&1 || { tail -5 "$OUT_DIR/synth.log"; exit 1; }
fi
for b in "$BIN"/paged_step*; do
    for opt in "" "paged-graphs=128"; do
        start=$(date +%s)
        HF2Q_CUDA_OPT=$opt HF2Q_BENCH_MODEL=$M HF2Q_BENCH_ROWS=$ROWS HF2Q_BENCH_PROFILE=none \
            timeout 300 "$b" bench_paged_decode_steps --ignored --nocapture 2>&1 |
            grep "batched decode" | tee "$OUT_DIR/steps-$(basename "$b")-${opt:-default}.txt"
        echo "$(basename "$b") ${opt:-default}: $(($(date +%s) - start)) s"
    done
done
b=$(ls "$BIN"/paged_step* | tail -1)
for r in ${NCU_ROWS-16 64}; do
    HF2Q_CUDA_OPT=paged-graphs=128 HF2Q_BENCH_MODEL=$M HF2Q_BENCH_ROWS=$r HF2Q_BENCH_STEPS=4 \
        HF2Q_BENCH_PROFILE=graphs timeout 300 ncu --profile-from-start off --clock-control none \
        --cache-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
        "$b" bench_paged_decode_steps --ignored --nocapture >"$OUT_DIR/ncu-$r.csv" 2>"$OUT_DIR/ncu-$r.err"
    echo "ncu, $r rows: exit status $?"
done
if [ "${SERVE:-1}" != 0 ]; then
    MODEL_FILES=$M LEVELS=16,64 NUM_PROMPTS=64 PP=0 WORK="$WORK/serve" \
        CONFIGS="${SERVE_CONFIGS:-default;g64:paged-graphs=64}" \
        bash "$ROOT/bench/serve-gpu.sh" run "$BIN" "$OUT_DIR/serve" >"$OUT_DIR/serve.log" 2>&1
    cat "$OUT_DIR/serve/serve.md"
fi
