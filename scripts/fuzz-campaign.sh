#!/usr/bin/env bash
# The long fuzz campaign on a many-core machine that has no Rust toolchain: every target under
# AFL++ at once, in parallel mode (one main and INSTANCES-1 secondary instances per target sharing
# a queue), for SECONDS, then one summary line per target (scripts/fuzz-stats.sh).
#
#   scripts/fuzz-campaign.sh BUNDLE SECONDS OUT_DIR [INSTANCES_PER_TARGET]
#
# BUNDLE holds what was built elsewhere: `afl-fuzz` (cargo-afl's AFL++ build) and
# `hf2q-fuzz-afl` (`cargo afl build --release -p hf2q-fuzz --features afl --bin hf2q-fuzz-afl`,
# stripped). Seeds come from fuzz/corpus/. INSTANCES_PER_TARGET defaults to the cores divided by
# the nine targets. OUT_DIR gets per target the instances' fuzzer_stats, crashes and hangs, flat
# (the queues stay in WORK), and summary.txt. Exit status 1 if anything crashed or hung.
set -uo pipefail
BUNDLE=$(cd "${1:?usage: fuzz-campaign.sh BUNDLE SECONDS OUT_DIR [INSTANCES]}" && pwd)
SECS=${2:?seconds}
OUT_DIR=${3:?out dir}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/hf2q-fuzz-campaign}
TARGETS=${TARGETS:-$(cd "$ROOT/fuzz/corpus" && ls)}
NT=$(echo "$TARGETS" | wc -w)
PER=${4:-$(( $(nproc) / NT ))}
[ "$PER" -ge 1 ] || PER=1
mkdir -p "$OUT_DIR" "$WORK"
# One compute thread per instance (AFL runs one instance per core).
export RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_AFFINITY=1
# A second run over the same WORK resumes the first (its statistics continue from where they were).
export AFL_FORKSRV_INIT_TMOUT=30000 AFL_AUTORESUME=1
# Libraries afl-fuzz was linked with that the machine may lack travel in the bundle.
export LD_LIBRARY_PATH="$BUNDLE${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "fuzz campaign: $NT targets x $PER instances, ${SECS}s, $(nproc) cores" | tee "$OUT_DIR/campaign.txt"
pids=()
for t in $TARGETS; do
    for i in $(seq 1 "$PER"); do
        role="-S s$i"; [ "$i" = 1 ] && role="-M main"
        # shellcheck disable=SC2086
        "$BUNDLE/afl-fuzz" -i "$ROOT/fuzz/corpus/$t" -o "$WORK/$t" $role -V "$SECS" -t 5000 \
            -- "$BUNDLE/hf2q-fuzz-afl" "$t" >"$WORK/$t-$i.log" 2>&1 &
        pids+=($!)
    done
done
for p in "${pids[@]}"; do wait "$p"; done
for t in $TARGETS; do
    mkdir -p "$OUT_DIR/$t"
    # Flat, plain names (AFL's contain ':' and ','): fuzzer_stats-INSTANCE, crash-INSTANCE-N,
    # hang-INSTANCE-N; names.txt maps them to AFL's names.
    for inst in "$WORK/$t"/*/; do
        n=$(basename "$inst")
        cp "$inst/fuzzer_stats" "$OUT_DIR/$t/fuzzer_stats-$n" 2>/dev/null
        for k in crashes hangs; do
            kind=hang; [ "$k" = crashes ] && kind=crash
            i=0
            for f in "$inst/$k"/id*; do
                [ -f "$f" ] || continue
                cp "$f" "$OUT_DIR/$t/$kind-$n-$i"
                echo "$kind-$n-$i $(basename "$f")" >>"$OUT_DIR/$t/names.txt"
                i=$((i + 1))
            done
        done
    done
    [ -f "$OUT_DIR/$t/fuzzer_stats-main" ] || { echo "$t: no stats; log:"; tail -n 15 "$WORK/$t-1.log"; } >>"$OUT_DIR/campaign.txt"
done
"$ROOT/scripts/fuzz-stats.sh" $(for t in $TARGETS; do echo "$OUT_DIR/$t"; done) | tee "$OUT_DIR/summary.txt"
