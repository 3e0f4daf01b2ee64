#!/usr/bin/env bash
# One pass on a CUDA machine: the CUDA op tests, the end-to-end GPU parity gates and the GPU
# benchmarks, with a summary table at the end.
#
#   scripts/gpu-check.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR holds binaries built elsewhere (the GPU machine needs no Rust toolchain):
#   hf2q          the release binary
#   cuda_ops      `cargo test --release -p hf2q-cuda --test cuda_ops --no-run` (the path it prints)
#   cuda_parity   `cargo test --release -p hf2q-models --test cuda_parity --no-run`
# Optional: HF2Q_TEST_SMOLLM2_GGUF / HF2Q_TEST_GEMMA3_GGUF for real-weight parity.
# Models for the speed tests are synthesized here (`hf2q synth`, random weights at real shapes).
# Environment: MODELS, the shape:type pairs to synthesize and measure (default: Llama-3.2-1B in
# q4_0 q8_0 q4_k_m f16, Llama-3.1-8B in q4_0 q4_k_m); REPS (default 3); the parity gate also runs
# on the synthesized Llama-3.1-8B Q4_K_M (about a minute per prefill setting) unless PARITY_8B=0,
# with the prefill products of each `gemm` CUDA option in GEMMS (default: pairs, the
# default; "pairs f16 int8" compares them; only the default's result decides the exit status).
set -uo pipefail

BIN=$(cd "${1:?usage: gpu-check.sh BIN_DIR [OUT_DIR]}" && pwd)
OUT_DIR=${2:-${OUT:-/tmp/hf2q-gpu-check}}
WORK=${WORK:-/tmp/hf2q-gpu-work}
MODELS=${MODELS:-"llama-3.2-1b:q4_0 llama-3.2-1b:q8_0 llama-3.2-1b:q4_k_m llama-3.2-1b:f16 llama-3.1-8b:q4_0 llama-3.1-8b:q4_k_m"}
REPS=${REPS:-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT_DIR" "$WORK"
export HF2Q_HOME="$WORK/home"
# NVRTC and the CUDA libraries, where the toolkit keeps them.
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
SUMMARY="$OUT_DIR/summary.md"
: >"$SUMMARY"
status=0
file_of() { echo "$WORK/${1%%:*}-${1##*:}.gguf"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT_DIR/gpu.txt"

echo "== CUDA op tests"
if (cd "$ROOT/crates/cuda" && "$BIN/cuda_ops" --test-threads 1) >"$OUT_DIR/cuda_ops.log" 2>&1; then
    echo "| CUDA op tests | pass |" >>"$SUMMARY"
else
    echo "| CUDA op tests | FAIL (cuda_ops.log) |" >>"$SUMMARY"
    status=1
fi
tail -3 "$OUT_DIR/cuda_ops.log"

echo "== synthesizing"
TOK="$ROOT/crates/models/tests/fixtures/tiny/tiny-llama"
for m in $MODELS; do
    f=$(file_of "$m")
    [ -f "$f" ] || "$BIN/hf2q" synth --shape "${m%%:*}" --type "${m##*:}" --vocab-from "$TOK" "$f" \
        2>>"$OUT_DIR/synth.log" || status=1
done

echo "== GPU parity (tiny models, real models if given, a synthesized 1B)"
PARITY_MODEL=$(file_of "llama-3.2-1b:q4_0")
if (cd "$ROOT/crates/models" && HF2Q_TEST_CUDA_GGUF="$PARITY_MODEL" "$BIN/cuda_parity" --test-threads 1 --nocapture) >"$OUT_DIR/cuda_parity.log" 2>&1; then
    echo "| GPU parity gates | pass |" >>"$SUMMARY"
else
    echo "| GPU parity gates | FAIL (cuda_parity.log) |" >>"$SUMMARY"
    status=1
fi
grep -E "argmax|graphs=|test result|panicked" "$OUT_DIR/cuda_parity.log"

if [ "${PARITY_8B:-1}" = 1 ]; then
    BIG=$(file_of "llama-3.1-8b:q4_k_m")
    [ -f "$BIG" ] || "$BIN/hf2q" synth --shape llama-3.1-8b --type q4_k_m --vocab-from "$TOK" "$BIG" \
        2>>"$OUT_DIR/synth.log" || status=1
    for gemm in ${GEMMS:-pairs}; do
        log="$OUT_DIR/cuda_parity_8b_$gemm.log"
        if (cd "$ROOT/crates/models" && HF2Q_CUDA_OPT=gemm=$gemm HF2Q_TEST_CUDA_GGUF="$BIG" \
            "$BIN/cuda_parity" real_models_meet_the_gate --nocapture) >"$log" 2>&1; then
            verdict=pass
        else
            verdict="FAIL ($(basename "$log"))"
            [ "$gemm" = pairs ] && status=1
        fi
        echo "| 8B Q4_K_M parity, gemm=$gemm | $verdict: $(grep -E 'prefill: GPU' "$log" | sed 's/.*reference //') |" >>"$SUMMARY"
        grep -E "argmax|test result" "$log"
    done
fi

echo "== GPU benchmarks"
{
    echo
    echo "| model | pp512 t/s | tg128 t/s | tg128 % of bandwidth floor | per token: launches, graph replays (nodes), syncs |"
    echo "|---|---|---|---|---|"
} >>"$SUMMARY"
for m in $MODELS; do
    f=$(file_of "$m")
    [ -f "$f" ] || continue
    if ! "$BIN/hf2q" bench "$f" --device cuda -p 512 -n 128 -r "$REPS" -t 1 --json --stats \
        >"$WORK/bench.json" 2>>"$OUT_DIR/bench.log"; then
        echo "| ${m%%:*} ${m##*:} | FAIL (bench.log) | | | |" >>"$SUMMARY"
        status=1
        continue
    fi
    cat "$WORK/bench.json" >>"$OUT_DIR/bench.jsonl"
    python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
get = lambda t: next((r for r in rows if r["test"] == t), None)
pp, tg = get("pp512"), get("tg128")
fmt = lambda r: "%.1f ± %.1f" % (r["tokens_per_second"], r["stddev"]) if r else "-"
pct = "%.1f%%" % tg["bandwidth_floor_pct"] if tg and tg.get("bandwidth_floor_pct") else "-"
st = "%.1f, %.1f (%s), %.1f" % (tg["launches_per_token"], tg["graph_launches_per_token"], tg.get("graph_nodes"), tg["syncs_per_token"]) if tg and "launches_per_token" in tg else "-"
print("| %s | %s | %s | %s | %s |" % (sys.argv[2], fmt(pp), fmt(tg), pct, st))
' "$WORK/bench.json" "${m%%:*} ${m##*:}" >>"$SUMMARY"
done
echo
cat "$SUMMARY"
exit $status
