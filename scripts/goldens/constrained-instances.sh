#!/usr/bin/env bash
# Writes crates/models/tests/fixtures/constrained/instances.json: for every schema of
# schemas.json, the greedy reply of Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, `hf2q pull
# qwen2.5-coder-0.5b`) constrained to it by `hf2q run --json-schema`. The constrained-decoding
# benchmark replays these real model outputs, retokenized, as MaskBench does.
#
#   cargo build --release -p hf2q && scripts/goldens/constrained-instances.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/hf2q}
DIR=crates/models/tests/fixtures/constrained
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$DIR/schemas.json" "$tmp" <<'PY'
import json, sys
for i, e in enumerate(json.load(open(sys.argv[1]))):
    json.dump(e["schema"], open(f"{sys.argv[2]}/{i:03d}.json", "w"))
    open(f"{sys.argv[2]}/{i:03d}.name", "w").write(e["name"])
PY
for f in "$tmp"/*.json; do
    schema=$(cat "$f")
    "$BIN" run qwen2.5-coder-0.5b --temp 0 -n 160 --json --json-schema "$f" \
        -p "Reply with only a JSON value that follows this JSON Schema: $schema" \
        > "${f%.json}.out" 2>/dev/null
done
python3 - "$tmp" "$DIR/instances.json" <<'PY'
import glob, json, sys
out = []
for f in sorted(glob.glob(sys.argv[1] + "/*.out")):
    r = json.load(open(f))
    name = open(f[:-4] + ".name").read()
    if r["finish_reason"] == "stop":
        out.append({"name": name, "text": r["text"]})
json.dump(out, open(sys.argv[2], "w"), indent=1, ensure_ascii=False)
print(f"{len(out)} instances")
PY
