#!/usr/bin/env bash
# Installs a pinned npm package set (SRC holds package.json + package-lock.json) into DEST with
# `npm ci`, unless DEST already holds an install newer than both files. Only the npm registry is
# contacted, and only then. Prints DEST on its last line.
# Usage: scripts/npm-pinned.sh SRC DEST
set -euo pipefail
src="$1" dest="$2"
for tool in node npm; do
  if ! command -v "$tool" > /dev/null; then
    echo "npm-pinned: '$tool' not found on PATH; install Node.js (Debian: apt-get install nodejs npm)" >&2
    exit 1
  fi
done
# npm writes node_modules/.package-lock.json on every install: it marks a finished install.
marker="$dest/node_modules/.package-lock.json"
if [[ ! -e "$marker" || "$src/package.json" -nt "$marker" || "$src/package-lock.json" -nt "$marker" ]]; then
  echo "npm-pinned: installing the packages pinned in $src into $dest" >&2
  mkdir -p "$dest"
  cp "$src/package.json" "$src/package-lock.json" "$dest/"
  (cd "$dest" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
  touch "$marker"
fi
echo "$dest"
