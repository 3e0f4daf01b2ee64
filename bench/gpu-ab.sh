#!/usr/bin/env bash
# Side-by-side decode (and optionally prefill) throughput of several configurations of one build
# on a CUDA machine, alternated so that drift of the machine spreads over all of them.
#
#   bench/gpu-ab.sh BIN_DIR CONFIGS [OUT_DIR]
#
# BIN_DIR holds the release `hf2q` (built elsewhere: the GPU machine needs no Rust toolchain).
# CONFIGS: configurations separated by ';', each `tag` or `tag:KEY=VALUE,KEY=VALUE` (the CUDA
# options `hf2q bench --cuda-opt` runs with; `hf2q bench --help` lists them), e.g.
#   'default;nop8:p8=off;stored:q4k-relayout=off'
# Environment: MODELS (shape:type pairs, synthesized when missing; default Llama-3.2-1B q4_0 and
# Llama-3.1-8B q4_k_m), ROUNDS (default 2), GEN (tokens of the decode test, default 128), PROMPT
# (tokens of a prefill test; default 0, none).
# Writes OUT_DIR/ab.md (a table, one row per model, one column per configuration, every round's
# tokens/s) and OUT_DIR/ab.jsonl (each run's `hf2q bench --json` lines, tagged).
set -uo pipefail

BIN=$(cd "${1:?usage: gpu-ab.sh BIN_DIR CONFIGS [OUT_DIR]}" && pwd)
CONFIGS=${2:?usage: gpu-ab.sh BIN_DIR CONFIGS [OUT_DIR]}
OUT_DIR=${3:-${OUT:-/tmp/hf2q-gpu-ab}}
WORK=${WORK:-/tmp/hf2q-gpu-work}
MODELS=${MODELS:-"llama-3.2-1b:q4_0 llama-3.1-8b:q4_k_m"}
ROUNDS=${ROUNDS:-2}
GEN=${GEN:-128}
PROMPT=${PROMPT:-0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT_DIR" "$WORK"
export HF2Q_HOME="$WORK/home"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
file_of() { echo "$WORK/${1%%:*}-${1##*:}.gguf"; }

TOK="$ROOT/crates/models/tests/fixtures/tiny/tiny-llama"
for m in $MODELS; do
    f=$(file_of "$m")
    [ -f "$f" ] || "$BIN/hf2q" synth --shape "${m%%:*}" --type "${m##*:}" --vocab-from "$TOK" "$f" \
        >>"$OUT_DIR/synth.log" 2>&1 &
done
wait

IFS=';' read -ra CFGS <<<"$CONFIGS"
: >"$OUT_DIR/ab.jsonl"
for ((r = 1; r <= ROUNDS; r++)); do
    for cfg in "${CFGS[@]}"; do
        tag=${cfg%%:*}
        opts=()
        [[ $cfg == *:* ]] && opts=(--cuda-opt "${cfg#*:}")
        for m in $MODELS; do
            f=$(file_of "$m")
            [ -f "$f" ] || continue
            "$BIN/hf2q" bench "$f" --device cuda "${opts[@]}" -p "$PROMPT" -n "$GEN" -r 3 -t 1 \
                --json 2>>"$OUT_DIR/bench.log" |
                python3 -c '
import json, sys
for line in sys.stdin:
    if line.strip():
        row = json.loads(line)
        row.update(ab_tag=sys.argv[1], ab_model=sys.argv[2], ab_round=int(sys.argv[3]))
        print(json.dumps(row))
' "$tag" "$m" "$r" >>"$OUT_DIR/ab.jsonl"
            echo "round $r $tag $m done"
        done
    done
done

python3 - "$OUT_DIR/ab.jsonl" "$CONFIGS" >"$OUT_DIR/ab.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
tags = [c.split(":", 1)[0] for c in sys.argv[2].split(";")]
models = list(dict.fromkeys(r["ab_model"] for r in rows))
tests = list(dict.fromkeys(r["test"] for r in rows))
print("| model | test | " + " | ".join(tags) + " |")
print("|---|---|" + "---|" * len(tags))
for m in models:
    for t in tests:
        cells = []
        for tag in tags:
            v = [r["tokens_per_second"] for r in rows
                 if r["ab_model"] == m and r["test"] == t and r["ab_tag"] == tag]
            cells.append(" / ".join("%.1f" % x for x in v) or "-")
        print("| %s | %s | %s |" % (m, t, " | ".join(cells)))
EOF
cat "$OUT_DIR/ab.md"
