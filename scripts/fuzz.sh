#!/usr/bin/env bash
# Runs one fuzz target for a time budget and prints what it did.
#
#   scripts/fuzz.sh TARGET SECONDS [OUT_DIR]
#
# TARGET: gguf safetensors tokenizer_json gguf_tokenizer chat_template mlx imatrix openai_request
# sse_json (fuzz/src/lib.rs says what each covers). Seeds: fuzz/corpus/TARGET.
#
# With cargo-afl installed (`cargo install cargo-afl --locked`, which builds AFL++), the run is
# coverage-guided: the target is built instrumented into target/afl and run under afl-fuzz;
# OUT_DIR (default fuzz-out/TARGET) holds AFL's queue, crashes and hangs, and the summary comes
# from its fuzzer_stats. Without it (or with FUZZ_MODE=mutate) the in-process mutator of
# `hf2q-fuzz run` runs instead (no coverage feedback; what CI uses). Exit status 1 when anything
# crashed or hung, so a crash is never a quiet success.
#
# A crash found: minimise it (`cargo afl tmin -i CRASH -o MIN -- target/afl/release/hf2q-fuzz-afl
# TARGET`), fix it, and commit MIN under fuzz/regressions/TARGET/ (tests/fuzz_corpus.rs replays
# it in CI).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=${1:?usage: scripts/fuzz.sh TARGET SECONDS [OUT_DIR]}
SECONDS_BUDGET=${2:?usage: scripts/fuzz.sh TARGET SECONDS [OUT_DIR]}
OUT_DIR=${3:-fuzz-out/$TARGET}
[ -d "fuzz/corpus/$TARGET" ] || { echo "fuzz.sh: unknown target '$TARGET' (no fuzz/corpus/$TARGET)" >&2; exit 2; }

MODE=${FUZZ_MODE:-}
if [ -z "$MODE" ]; then
    if cargo afl --version >/dev/null 2>&1; then MODE=afl; else MODE=mutate; fi
fi

if [ "$MODE" = mutate ]; then
    cargo build --release --locked -p hf2q-fuzz --bin hf2q-fuzz
    mkdir -p "$OUT_DIR"
    exec target/release/hf2q-fuzz run "$TARGET" --seconds "$SECONDS_BUDGET" --findings "$OUT_DIR/findings"
fi

CARGO_TARGET_DIR=target/afl cargo afl build --release --locked -p hf2q-fuzz --features afl --bin hf2q-fuzz-afl
BIN=target/afl/release/hf2q-fuzz-afl
mkdir -p "$OUT_DIR"
# Resume an earlier run in the same folder; else start from the seeds.
IN="fuzz/corpus/$TARGET"
[ -f "$OUT_DIR/default/fuzzer_stats" ] && IN=-
# No UI (logs, CI); no CPU-frequency or core-dump-pattern checks (settings of the machine that a
# fuzz run must not change); a hang is an input past 5 s (the slowest seeds take ~0.1 s).
RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_AFFINITY=1 \
    cargo afl fuzz -i "$IN" -o "$OUT_DIR" -V "$SECONDS_BUDGET" -t 5000 -- "$BIN" "$TARGET" >"$OUT_DIR/afl.log" 2>&1 \
    || { tail -n 30 "$OUT_DIR/afl.log" >&2; exit 1; }
scripts/fuzz-stats.sh "$OUT_DIR"
