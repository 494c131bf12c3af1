#!/usr/bin/env bash
# Installs the pinned official OpenAI client (tools/openai-client) into out/openai-client/
# (git-ignored): the real client that tests/serve/ drives `memtune serve` with. Prints the
# directory on its last line.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$("$root/scripts/npm-pinned.sh" "$root/tools/openai-client" "$root/out/openai-client" | tail -n 1)"
[[ -f "$dir/node_modules/openai/package.json" ]] || { echo "prepare-openai-client: openai missing after npm ci" >&2; exit 1; }
echo "$dir"
