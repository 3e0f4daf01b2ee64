#!/usr/bin/env bash
# `hf2q serve` and llama.cpp's `llama-server` under the same load on one CUDA machine, on the same
# synthesized GGUF files and the same requests (bench/loadgen.py's synthetic dataset: no network).
#
#   bench/serve-gpu.sh build LLAMA_SRC_TARBALL    # llama.cpp's llama-server, CUDA, sm_90
#   bench/serve-gpu.sh run BIN_DIR [OUT_DIR]      # synthesize, then each server at each level
#
# `build` unpacks a llama.cpp source tree (a tarball made elsewhere: the GPU machine reaches no
# network) into $WORK/llama and builds only llama-server (CUDA for sm_90, no curl, no OpenSSL)
# with CMake and ninja; it prints the build time. `run` takes the release `hf2q` in BIN_DIR
# (built elsewhere), synthesizes MODELS (shape:type pairs; default llama-3.2-1b:q4_0) with
# `hf2q synth` when missing, with a vocabulary of the shape's size that is all text
# (bench/synth_vocab.py; VOCAB_SIZE overrides the size, 0 = the tiny-llama tokenizer padded with
# unused tokens, which a random model generates and the two servers stream differently), then
# for each model:
#   - for each of CONFIGS (`tag`, `tag:KEY=VALUE,...` with CUDA options as `--cuda-opt` takes
#     them, or `tag:--flag ...` with `hf2q serve` flags, e.g. `nocache:--no-prefix-cache`;
#     separated by ';'; default `default`): starts `hf2q serve FILE --device cuda --kv-paged`
#     on a loopback port, waits for /health and /v1/models, runs bench/loadgen.py at each of
#     LEVELS, stops the server (SIGTERM, then waits);
#   - when llama-server exists ($WORK/llama/build/bin/llama-server, or LLAMA_SERVER names it):
#     the same with `llama-server -m FILE -ngl 99 -fa on -np NP -c NP*CTX`, prompt caching off
#     (`--no-cache-prompt --cache-ram 0` where the build knows them: the levels replay the same
#     prompts, and hf2q's paged KV cache keeps no prefixes).
# The first server to run builds the request list (loadgen --requests OUT_DIR/requests-MODEL.json)
# and every later server and configuration replays it: identical prompts and max_tokens.
# Results are written as they come: OUT_DIR/serve.jsonl (one line per level of every server and
# configuration, tagged serve_server / serve_config / serve_model), OUT_DIR/serve.md (the table,
# rewritten after every level), each server's log (OUT_DIR/*.log) and loadgen's output.
# Environment: WORK (default /tmp/hf2q-serve), MODELS, CONFIGS, LEVELS (1,16,64), NUM_PROMPTS
# (128), SEED (0), PROMPT_TOKENS (64:512), OUTPUT_TOKENS (64:256), CTX (per-request context,
# 1024), NP (slots: llama-server -np, hf2q --max-seqs; 64), KV_MEM (hf2q --kv-mem; 16G, 1G on the
# CPU), PP (loadgen's prefill probe, 512; 0 = none), SYSTEM_WORDS (a system prompt of that many
# words shared by every request, loadgen --system-prompt-words; 0 = none), PORT (first port, 18090), HF2Q_ARGS and
# LLAMA_ARGS (extra flags), DEVICE (cuda; `cpu` for a trial without a GPU), MODEL_FILES (model
# files or folders to serve as they are, instead of synthesizing MODELS), READY_TIMEOUT (600 s).
set -uo pipefail

WORK=${WORK:-/tmp/hf2q-serve}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$WORK"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"

case "${1:-}" in
build)
    "$ROOT/bench/llama-build.sh" llama-server "${2:?usage: serve-gpu.sh build LLAMA_SRC_TARBALL}" "$WORK" || exit 1
    ;;
run)
    BIN=$(cd "${2:?usage: serve-gpu.sh run BIN_DIR [OUT_DIR]}" && pwd)
    OUT_DIR=${3:-${OUT:-$WORK/out}}
    MODELS=${MODELS:-"llama-3.2-1b:q4_0"}
    CONFIGS=${CONFIGS:-default}
    LEVELS=${LEVELS:-1,16,64}
    NUM_PROMPTS=${NUM_PROMPTS:-128}
    SEED=${SEED:-0}
    PROMPT_TOKENS=${PROMPT_TOKENS:-64:512}
    OUTPUT_TOKENS=${OUTPUT_TOKENS:-64:256}
    CTX=${CTX:-1024}
    NP=${NP:-64}
    DEVICE=${DEVICE:-cuda}
    if [ "$DEVICE" = cpu ]; then KV_MEM=${KV_MEM:-1G}; NGL=0; else KV_MEM=${KV_MEM:-16G}; NGL=99; fi
    PP=${PP:-512}
    SYSTEM_WORDS=${SYSTEM_WORDS:-0}
    PORT=${PORT:-18090}
    READY_TIMEOUT=${READY_TIMEOUT:-600}
    LLAMA_SERVER=${LLAMA_SERVER:-$WORK/llama/build/bin/llama-server}
    mkdir -p "$OUT_DIR"
    OUT_DIR=$(cd "$OUT_DIR" && pwd)
    export HF2Q_HOME="$WORK/home"
    TOK="$ROOT/crates/models/tests/fixtures/tiny/tiny-llama"

    # The models: label<TAB>path lines.
    MODEL_LIST=()
    if [ -n "${MODEL_FILES:-}" ]; then
        for f in $MODEL_FILES; do MODEL_LIST+=("$(basename "$f")"$'\t'"$f"); done
    else
        for m in $MODELS; do
            shape=${m%%:*}
            # A vocabulary of the shape's size, all text (bench/synth_vocab.py says why).
            case $shape in
            llama-3.*) n=128256 ;;
            qwen3-8b | qwen3-30b-a3b) n=151936 ;;
            smollm2-135m) n=49152 ;;
            mixtral-8x7b) n=32000 ;;
            *) n=0 ;;
            esac
            n=${VOCAB_SIZE:-$n}
            vocab=$TOK
            if [ "$n" != 0 ]; then
                vocab="$WORK/vocab-$n"
                [ -f "$vocab/tokenizer.json" ] || python3 "$ROOT/bench/synth_vocab.py" "$vocab" "$n" >/dev/null || continue
            fi
            f="$WORK/$shape-${m##*:}-v$n.gguf"
            if [ ! -f "$f" ]; then
                start=$(date +%s)
                "$BIN/hf2q" synth --shape "$shape" --type "${m##*:}" --vocab-from "$vocab" "$f" \
                    >>"$OUT_DIR/synth.log" 2>&1 || { tail -5 "$OUT_DIR/synth.log"; continue; }
                echo "synthesized $f ($(du -h "$f" | cut -f1)) in $(($(date +%s) - start)) s"
            fi
            MODEL_LIST+=("$m"$'\t'"$f")
        done
    fi

    SERVER_PID=
    stop_server() {
        [ -n "$SERVER_PID" ] || return 0
        kill -TERM "$SERVER_PID" 2>/dev/null
        for _ in $(seq 1 120); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.5
        done
        kill -0 "$SERVER_PID" 2>/dev/null && { echo "  the server ignored SIGTERM for 60 s: SIGKILL"; kill -KILL "$SERVER_PID"; }
        wait "$SERVER_PID" 2>/dev/null
        echo "  server stopped (exit status $?)"
        SERVER_PID=
    }
    trap 'stop_server' EXIT
    trap 'exit 130' INT TERM

    # wait_ready PORT: 0 once /health and /v1/models answer 200, 1 when the server exits first
    # or READY_TIMEOUT passes.
    wait_ready() {
        python3 - "$1" "$SERVER_PID" "$READY_TIMEOUT" <<'EOF'
import os, sys, time, urllib.request
port, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.time()
while time.time() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        print("  the server exited before it was ready", flush=True)
        sys.exit(1)
    try:
        for path in ("/health", "/v1/models"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                if r.status != 200:
                    raise OSError(r.status)
        print(f"  ready in {time.time() - t0:.1f} s", flush=True)
        sys.exit(0)
    except Exception:
        time.sleep(0.5)
print(f"  not ready after {limit:.0f} s", flush=True)
sys.exit(1)
EOF
    }

    # run_levels SERVER CONFIG MODEL REQS: loadgen at each level against the server on $PORT,
    # one line per level appended to serve.jsonl, the table rewritten after each.
    run_levels() {
        local server=$1 config=$2 model=$3 reqs=$4 label pp=$PP
        label="$server-${config}-${model//[:\/]/_}"
        IFS=',' read -ra LVLS <<<"$LEVELS"
        for level in "${LVLS[@]}"; do
            echo "== $label, $level clients" >>"$OUT_DIR/loadgen.log"
            python3 "$ROOT/bench/loadgen.py" --base-url "http://127.0.0.1:$PORT" \
                --dataset "synthetic:$SEED" --synthetic-prompt-tokens "$PROMPT_TOKENS" \
                --synthetic-output-tokens "$OUTPUT_TOKENS" --num-prompts "$NUM_PROMPTS" \
                --requests "$reqs" --concurrency "$level" --pp "$pp" \
                --system-prompt-words "$SYSTEM_WORDS" \
                --json "$OUT_DIR/$label-c$level.json" \
                >"$OUT_DIR/$label-c$level.txt" 2>>"$OUT_DIR/loadgen.log"
            echo "  $server $config $model: $level clients, loadgen exit status $?"
            pp=0 # the prefill probe once per server
            [ -f "$OUT_DIR/$label-c$level.json" ] || continue
            python3 - "$OUT_DIR/$label-c$level.json" "$server" "$config" "$model" >>"$OUT_DIR/serve.jsonl" <<'EOF'
import json, sys
rep = json.load(open(sys.argv[1]))
for lv in rep["levels"]:
    row = dict(lv, serve_server=sys.argv[2], serve_config=sys.argv[3], serve_model=sys.argv[4],
               served_model_id=rep["model"], dataset=rep["dataset"],
               prompt_tokens_counted_by=rep["prompt_tokens_counted_by"],
               prompt_tokens_mean=rep["prompt_tokens_mean"], output_tokens_mean=rep["output_tokens_mean"])
    row.update({k: v for k, v in rep.items() if k.startswith("pp")})
    print(json.dumps(row))
EOF
            table
        done
    }

    table() {
        python3 - "$OUT_DIR/serve.jsonl" >"$OUT_DIR/serve.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| model | server / config | clients | requests | errors | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for r in rows:
    print("| %s | %s / %s | %d | %d | %d | %.1f | %.2f / %.2f | %.1f / %.1f |" % (
        r["serve_model"], r["serve_server"], r["serve_config"], r["concurrency"], r["requests"],
        r["errors"], r["output_tok_per_s"], r["ttft_p50_s"], r["ttft_p99_s"],
        1000 * r["itl_p50_s"], 1000 * r["itl_p99_s"]))
print()
for m in dict.fromkeys(r["serve_model"] for r in rows):
    r = next(r for r in rows if r["serve_model"] == m)
    print("%s: %s; mean prompt %.0f tokens (counted by %s), mean output %.0f tokens.  " % (
        m, r["dataset"], r["prompt_tokens_mean"], r["prompt_tokens_counted_by"], r["output_tokens_mean"]))
    for r in rows:
        pp = [(k, v) for k, v in r.items() if k.startswith("pp") and k.endswith("_tok_per_s")]
        if r["serve_model"] == m and pp:
            print("%s / %s: %s.  " % (r["serve_server"], r["serve_config"],
                  ", ".join("%s %.0f tok/s" % (k[:-10], v) for k, v in pp)))
        elif r["serve_model"] == m and r.get("pp_error"):
            print("%s / %s: prefill probe failed (%s).  " % (r["serve_server"], r["serve_config"], r["pp_error"][:120]))
EOF
    }

    : >"$OUT_DIR/serve.jsonl"
    IFS=';' read -ra CFGS <<<"$CONFIGS"
    for entry in "${MODEL_LIST[@]}"; do
        m=${entry%%$'\t'*}
        f=${entry#*$'\t'}
        reqs="$OUT_DIR/requests-${m//[:\/]/_}.json"
        rm -f "$reqs"
        for cfg in "${CFGS[@]}"; do
            tag=${cfg%%:*}
            opts=()
            if [[ $cfg == *:--* ]]; then
                read -ra opts <<<"${cfg#*:}"
            elif [[ $cfg == *:* ]]; then
                opts=(--cuda-opt "${cfg#*:}")
            fi
            log="$OUT_DIR/hf2q-$tag-${m//[:\/]/_}.log"
            echo "hf2q serve $m ($tag) on port $PORT"
            # shellcheck disable=SC2086
            "$BIN/hf2q" serve "$f" --device "$DEVICE" --kv-paged --host 127.0.0.1 --port "$PORT" \
                --no-lab -c "$CTX" --max-seqs "$NP" --kv-mem "$KV_MEM" "${opts[@]}" ${HF2Q_ARGS:-} \
                >"$log" 2>&1 &
            SERVER_PID=$!
            if wait_ready "$PORT"; then
                run_levels hf2q "$tag" "$m" "$reqs"
            else
                tail -5 "$log"
            fi
            stop_server
            PORT=$((PORT + 1))
        done
        if [ -x "$LLAMA_SERVER" ]; then
            log="$OUT_DIR/llama-${m//[:\/]/_}.log"
            help=$("$LLAMA_SERVER" --help 2>&1)
            nocache=()
            grep -q -- '--no-cache-prompt' <<<"$help" && nocache+=(--no-cache-prompt)
            grep -q -- '--cache-ram' <<<"$help" && nocache+=(--cache-ram 0)
            echo "llama-server $m on port $PORT"
            # shellcheck disable=SC2086
            "$LLAMA_SERVER" -m "$f" -ngl "$NGL" -fa on -np "$NP" -c $((NP * CTX)) \
                --host 127.0.0.1 --port "$PORT" "${nocache[@]}" ${LLAMA_ARGS:-} >"$log" 2>&1 &
            SERVER_PID=$!
            if wait_ready "$PORT"; then
                run_levels llama.cpp default "$m" "$reqs"
            else
                tail -5 "$log"
            fi
            stop_server
            PORT=$((PORT + 1))
        else
            echo "no llama-server at $LLAMA_SERVER: hf2q only"
        fi
    done
    table
    cat "$OUT_DIR/serve.md"
    ;;
*)
    echo "usage: serve-gpu.sh build LLAMA_SRC_TARBALL | run BIN_DIR [OUT_DIR]" >&2
    exit 2
    ;;
esac
