#!/usr/bin/env bash
# hf2q and llama.cpp side by side on one CUDA machine, on the same synthesized GGUF files.
#
#   bench/peer-gpu.sh build LLAMA_SRC_TARBALL     # llama.cpp's llama-bench, CUDA, sm_90
#   bench/peer-gpu.sh run BIN_DIR [OUT_DIR]       # synthesize, then alternate the two
#
# `build` unpacks a llama.cpp source tree (a tarball made elsewhere: the GPU machine reaches no
# network) into $WORK/llama and builds only llama-bench (CUDA for sm_90, flash attention as its
# default, no curl, no server) with CMake and ninja; it prints the build time. `run` takes the
# release `hf2q` in BIN_DIR (built elsewhere), synthesizes MODELS (shape:type pairs; default
# qwen3-30b-a3b:q4_k_m) with `hf2q synth` when missing, then for ROUNDS rounds (default 2) runs
# `llama-bench -m FILE -p PROMPT -n GEN -r REPS -ngl 99 -fa 1 -o json` and
# `hf2q bench FILE --device cuda -p PROMPT -n GEN -r REPS --json`, alternated, and writes
# OUT_DIR/peer.jsonl (every line of both, tagged) and OUT_DIR/peer.md (a table of tokens/s).
# Environment: WORK (default /tmp/hf2q-peer), MODELS, ROUNDS, PROMPT (512), GEN (128), REPS (3).
set -uo pipefail

WORK=${WORK:-/tmp/hf2q-peer}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$WORK"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"

case "${1:-}" in
build)
    "$ROOT/bench/llama-build.sh" llama-bench "${2:?usage: peer-gpu.sh build LLAMA_SRC_TARBALL}" "$WORK" || exit 1
    ;;
run)
    BIN=$(cd "${2:?usage: peer-gpu.sh run BIN_DIR [OUT_DIR]}" && pwd)
    OUT_DIR=${3:-${OUT:-$WORK/out}}
    MODELS=${MODELS:-"qwen3-30b-a3b:q4_k_m"}
    ROUNDS=${ROUNDS:-2}
    PROMPT=${PROMPT:-512}
    GEN=${GEN:-128}
    REPS=${REPS:-3}
    LB="$WORK/llama/build/bin/llama-bench"
    mkdir -p "$OUT_DIR"
    export HF2Q_HOME="$WORK/home"
    TOK="$ROOT/crates/models/tests/fixtures/tiny/tiny-llama"
    for m in $MODELS; do
        f="$WORK/${m%%:*}-${m##*:}.gguf"
        if [ ! -f "$f" ]; then
            start=$(date +%s)
            "$BIN/hf2q" synth --shape "${m%%:*}" --type "${m##*:}" --vocab-from "$TOK" "$f" \
                >>"$OUT_DIR/synth.log" 2>&1 || { tail -5 "$OUT_DIR/synth.log"; continue; }
            echo "synthesized $f ($(du -h "$f" | cut -f1)) in $(($(date +%s) - start)) s"
        fi
    done
    : >"$OUT_DIR/peer.jsonl"
    tag() {
        python3 -c '
import json, sys
text = sys.stdin.read().strip()
rows = json.loads(text) if text.startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
for row in rows:
    row.update(peer=sys.argv[1], peer_model=sys.argv[2], peer_round=int(sys.argv[3]))
    print(json.dumps(row))
' "$@"
    }
    for ((r = 1; r <= ROUNDS; r++)); do
        for m in $MODELS; do
            f="$WORK/${m%%:*}-${m##*:}.gguf"
            [ -f "$f" ] || continue
            if [ -x "$LB" ]; then
                "$LB" -m "$f" -p "$PROMPT" -n "$GEN" -r "$REPS" -ngl 99 -fa 1 -o json \
                    2>>"$OUT_DIR/llama.log" | tag llama.cpp "$m" "$r" >>"$OUT_DIR/peer.jsonl"
            fi
            "$BIN/hf2q" bench "$f" --device cuda -p "$PROMPT" -n "$GEN" -r "$REPS" --json \
                2>>"$OUT_DIR/hf2q.log" | tag hf2q "$m" "$r" >>"$OUT_DIR/peer.jsonl"
            echo "round $r $m done"
        done
    done
    python3 - "$OUT_DIR/peer.jsonl" >"$OUT_DIR/peer.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def test(r):
    if r["peer"] == "llama.cpp":
        return "pp%d" % r["n_prompt"] if r.get("n_prompt") else "tg%d" % r["n_gen"]
    return r["test"]
def speed(r):
    return r["avg_ts"] if r["peer"] == "llama.cpp" else r["tokens_per_second"]
print("| model | test | hf2q tokens/s | llama.cpp tokens/s | ratio |")
print("|---|---|---|---|---|")
for m in dict.fromkeys(r["peer_model"] for r in rows):
    for t in dict.fromkeys(test(r) for r in rows if r["peer_model"] == m):
        got = {p: [speed(r) for r in rows if r["peer_model"] == m and test(r) == t and r["peer"] == p]
               for p in ("hf2q", "llama.cpp")}
        h, l = got["hf2q"], got["llama.cpp"]
        ratio = "%.2fx" % (sum(h) / len(h) / (sum(l) / len(l))) if h and l else "-"
        print("| %s | %s | %s | %s | %s |" % (m, t, " / ".join("%.1f" % v for v in h) or "-",
              " / ".join("%.1f" % v for v in l) or "-", ratio))
EOF
    cat "$OUT_DIR/peer.md"
    ;;
*)
    echo "usage: peer-gpu.sh build LLAMA_SRC_TARBALL | run BIN_DIR [OUT_DIR]" >&2
    exit 2
    ;;
esac
