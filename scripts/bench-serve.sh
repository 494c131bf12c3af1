#!/usr/bin/env bash
# Benchmark of `memtune serve` on the Qwen2.5-0.5B shape (random weights, bfloat16, created once in
# out/bench/qwen2.5-0.5b-bf16): concurrency 1, 4 and 16 streaming clients (bench/bench_serve.mjs),
# 128-token prompts and 128 new tokens each; aggregate generated tokens/s, time to first token and
# inter-token latency (p50, p99), and their ratios against concurrency 1 from the same run. Writes
# bench/results/serve-*.json (scripts/bench_results.py tables turns them into the tables).
# Usage: scripts/bench-serve.sh [prompt=128] [new_tokens=128] [rounds=1]
# (MEMTUNE_SERVE_FLAGS adds flags to the server, e.g. "--max_decode_step_tokens 0" for the uncapped steps)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/serve-common.sh"
prompt="${1:-128}" new="${2:-128}" rounds="${3:-1}"
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" "$root/build" > /dev/null
model="$root/out/bench/qwen2.5-0.5b-bf16"
if [[ ! -f "$model/model.safetensors" ]]; then
  "$root/build/memtune" init-model --preset qwen2.5-0.5b --torch_dtype bfloat16 --seed 1 --out "$model"
fi
log="$(mktemp)"
trap 'kill "$server" 2> /dev/null || true; rm -f "$log"' EXIT
OMP_NUM_THREADS="$(nproc)" "$root/build/memtune" serve "$model" --port 0 --max_model_len $((prompt + new)) \
  --max_num_seqs 16 --max_num_batched_tokens 512 ${MEMTUNE_SERVE_FLAGS:-} > "$log" 2>&1 &
server=$!
url="$(wait_for_server "$server" "$log")"
echo "server at $url ($(nproc) threads)"
rows="$(node "$root/bench/bench_serve.mjs" "$url" "$prompt" "$new" 1 4 16 --rounds "$rounds" | tee /dev/stderr |
  python3 -c 'import json, sys; print(json.dumps([json.loads(l) for l in sys.stdin]))')"
kill -TERM "$server"
wait "$server" || true
python3 - "$rows" <<'PY'
import json, sys
rows = {r["concurrency"]: r for r in json.loads(sys.argv[1])}
one, many = rows[1], rows[16]
print(f"concurrency 16: {many['tokens_per_s']:.1f} tokens/s = {many['tokens_per_s'] / one['tokens_per_s']:.2f}x "
      f"concurrency 1 (target >= 6x); p99 inter-token latency {many['itl_p99_s'] * 1e3:.0f} ms = "
      f"{many['itl_p99_s'] / one['itl_p99_s']:.2f}x concurrency 1's (target <= 3x)")
PY
/usr/bin/python3 "$root/scripts/bench_results.py" record serve \
  "{\"prompt\": $prompt, \"new_tokens\": $new, \"rounds\": $rounds, \"torch_dtype\": \"bfloat16\"}" "$rows"
