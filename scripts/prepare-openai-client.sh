#!/usr/bin/env bash
# Installs the pinned official OpenAI client (tools/openai-client/package.json + package-lock.json,
# `npm ci`) into out/openai-client/ (git-ignored): the real client that tests/serve/ drives
# `memtune serve` with. Only the npm registry is contacted, and only when the pinned package is
# not installed yet. Prints the directory on its last line.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ref="$root/tools/openai-client"
dir="$root/out/openai-client"
for tool in node npm; do
  if ! command -v "$tool" > /dev/null; then
    echo "prepare-openai-client: '$tool' not found on PATH; install Node.js (Debian: apt-get install nodejs npm)" >&2
    exit 1
  fi
done
# npm writes node_modules/.package-lock.json on every install: it marks a finished install.
marker="$dir/node_modules/.package-lock.json"
if [[ ! -e "$marker" || "$ref/package.json" -nt "$marker" || "$ref/package-lock.json" -nt "$marker" ]]; then
  echo "prepare-openai-client: installing the pinned openai package into $dir" >&2
  mkdir -p "$dir"
  cp "$ref/package.json" "$ref/package-lock.json" "$dir/"
  (cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
  touch "$marker"
fi
[[ -f "$dir/node_modules/openai/package.json" ]] || { echo "prepare-openai-client: openai missing after npm ci" >&2; exit 1; }
echo "$dir"
