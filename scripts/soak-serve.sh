#!/usr/bin/env bash
# Soak of `memtune serve` (bench/soak_serve.mjs): a small model with Qwen2.5's real tokenizer and
# vocabulary, CONCURRENCY hostile clients for SECONDS on localhost, then the status counts, the
# server's RSS drift, the KV blocks left held and greedy answers before vs after; SIGTERM at the
# end must exit 0. Not part of the test suite (it runs for minutes); prints one JSON line.
# Usage: scripts/soak-serve.sh [seconds=120] [concurrency=24]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/serve-common.sh"
seconds="${1:-120}" concurrency="${2:-24}"
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" "$root/build" > /dev/null
tokenizer="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"
model="$root/out/bench/soak-model"
if [[ ! -f "$model/model.safetensors" ]]; then
  "$root/build/memtune" init-model --preset tiny --set vocab_size=151936 --set hidden_size=128 \
    --set intermediate_size=384 --seed 5 --out "$model" > /dev/null
  cp "$tokenizer/tokenizer.json" "$tokenizer/tokenizer_config.json" "$model/"
fi
log="$(mktemp)"
trap 'kill "$server" 2> /dev/null || true; rm -f "$log"' EXIT
"$root/build/memtune" serve "$model" --port 0 --max_model_len 256 --max_num_seqs 8 --max_queue 64 > "$log" 2>&1 &
server=$!
url="$(wait_for_server "$server" "$log")"
status=0
node "$root/bench/soak_serve.mjs" "$url" "$server" "$seconds" "$concurrency" || status=$?
kill -TERM "$server"
code=0
wait "$server" || code=$?
trap 'rm -f "$log"' EXIT
if [[ $code -ne 0 ]]; then
  echo "memtune serve exited $code after SIGTERM:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
exit "$status"
