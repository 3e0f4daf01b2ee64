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
# Every test and the hf2q binary in one feature set: a separate `cargo build -p hf2q` resolves
# features without the tests' dev-dependencies and compiles about forty crates a second time.
cargo test --release --locked --workspace --no-run
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

echo "== training data (LLaMA-Factory's demo sets, from its PyPI sdist; cached in $CACHE/data)"
DATA="$CACHE/data"
if [ ! -f "$DATA/alpaca_en_demo.json" ] || [ ! -f "$DATA/dpo_en_demo.json" ]; then
    mkdir -p "$DATA"
    python3 -m pip download --quiet --no-deps --no-binary :all: "llamafactory==0.9.5" -d "$DATA" \
        && tar -xzf "$DATA/llamafactory-0.9.5.tar.gz" -C "$DATA" --strip-components 2 \
            llamafactory-0.9.5/data/alpaca_en_demo.json llamafactory-0.9.5/data/dpo_en_demo.json \
        || echo "warning: could not fetch the llamafactory sdist; training behaviour tests will be skipped" >&2
fi
[ -f "$DATA/alpaca_en_demo.json" ] && export HF2Q_TEST_ALPACA_JSON="$DATA/alpaca_en_demo.json"
[ -f "$DATA/dpo_en_demo.json" ] && export HF2Q_TEST_DPO_JSON="$DATA/dpo_en_demo.json"

# ---- the Hub client (issue 46): Python's huggingface_hub reads what hf2q pulled, and the reverse --
# huggingface_hub in a venv (cached); a failed install makes the interop test print "skipped".
echo "== huggingface_hub (cached in $CACHE/hub-venv)"
if ! "$CACHE/hub-venv/bin/python" -c "import huggingface_hub" >/dev/null 2>&1; then
    { python3 -m venv "$CACHE/hub-venv" && "$CACHE/hub-venv/bin/pip" install --quiet "huggingface_hub==2.4.0"; } \
        || echo "warning: could not install huggingface_hub; its interop test will be skipped" >&2
fi
if "$CACHE/hub-venv/bin/python" -c "import huggingface_hub" >/dev/null 2>&1; then
    export HF2Q_TEST_HUB_PYTHON="$CACHE/hub-venv/bin/python"
fi

echo "== tests"
cargo test --release --locked --workspace -- --test-threads 2

# ---- hf2q serve (issue 4): real clients against a real server -----------------------------------
# (with Qwen2.5-Coder: tool calls and structured output through the openai client, and the web
# chat's agent mode in Chromium over a fixture workspace)
# The official `openai` Python package (in a venv), playwright-core (npm) driving Debian's chromium,
# and the release binary itself (SIGTERM drain). Each tool is installed into the cache on first
# use; one that cannot be installed makes its test print "skipped".
echo "== server clients (openai python client, headless chromium, hf2q serve binary)"
SERVE_CACHE="$CACHE/serve"
mkdir -p "$SERVE_CACHE"
if ! "$SERVE_CACHE/venv/bin/python" -c "import openai" >/dev/null 2>&1; then
    { python3 -m venv "$SERVE_CACHE/venv" && "$SERVE_CACHE/venv/bin/pip" install --quiet "openai==3.51.0"; } \
        || echo "warning: could not install the openai package; its test will be skipped" >&2
fi
if [ ! -d "$SERVE_CACHE/node/node_modules/playwright-core" ]; then
    npm install --prefix "$SERVE_CACHE/node" --no-audit --no-fund --silent "playwright-core@1.65.1" \
        || echo "warning: could not install playwright-core; the browser test will be skipped" >&2
fi
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null \
        || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi
export HF2Q_TEST_PYTHON="$SERVE_CACHE/venv/bin/python"
export HF2Q_TEST_NODE_MODULES="$SERVE_CACHE/node/node_modules"
HF2Q_TEST_CHROMIUM="$(command -v chromium || true)"
export HF2Q_TEST_CHROMIUM
export HF2Q_TEST_BIN="$PWD/$BIN"
# --workspace keeps the feature set the build step compiled (`-p` would resolve another and
# compile a few dozen crates again).
cargo test --release --locked --workspace --test clients -- --test-threads 1
