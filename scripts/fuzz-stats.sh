#!/usr/bin/env bash
# Sums the fuzzer_stats of every AFL++ instance under each OUT_DIR (one dir per target; the
# instances of a parallel run are its subfolders) into one line per target, for RELIABILITY.md:
#
#   scripts/fuzz-stats.sh OUT_DIR...
#
# Columns: target folder, instances, executions, wall seconds (longest instance), CPU-seconds
# (sum), executions per second, edges found (`edges_found`/`total_edges` of the most advanced
# instance), corpus size, crashes, hangs. Exit status 1 if any instance saved a crash or a hang.
set -euo pipefail
printf '%-16s %4s %12s %7s %8s %9s %15s %7s %7s %5s\n' target inst execs wall_s cpu_s exec/s edges corpus crashes hangs
bad=0
for d in "$@"; do
    awk -v name="$(basename "$d")" '
        FNR == 1 { n++ }
        { split($0, kv, /[ \t]*:[ \t]*/); v[kv[1]] = kv[2] }
        /^execs_done/       { ex += v["execs_done"] }
        /^run_time/         { rt = v["run_time"]; cpu += rt; if (rt > wall) wall = rt }
        /^corpus_count/     { if (v["corpus_count"] > corp) corp = v["corpus_count"] }
        /^saved_crashes/    { cr += v["saved_crashes"] }
        /^saved_hangs/      { hg += v["saved_hangs"] }
        /^edges_found/      { if (v["edges_found"] > edges) edges = v["edges_found"] }
        /^total_edges/      { tot = v["total_edges"] }
        END {
            printf "%-16s %4d %12d %7d %8d %9.0f %7d/%-7d %7d %7d %5d\n", name, n, ex, wall, cpu, (cpu > 0 ? ex / cpu : 0), edges, tot, corp, cr, hg
            exit (cr + hg > 0)
        }' $(find "$d" -name 'fuzzer_stats*' | sort) || bad=1
done
exit $bad
