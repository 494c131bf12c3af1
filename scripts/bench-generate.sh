#!/usr/bin/env bash
# Benchmark of generation on the Qwen2.5-0.5B shape (random weights, created once in
# out/bench/qwen2.5-0.5b-bf16), float32 and bfloat16: prefill and decode tokens/s at batch 1 and 8
# against the machine's memory read bandwidth and sgemm ceiling measured in the same run
# (bench/bench_generate.cpp). Writes bench/results/generate-*.json
# (scripts/bench_results.py tables turns them into the tables).
# Usage: scripts/bench-generate.sh [prompt=128] [new_tokens=128]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
prompt="${1:-128}" new="${2:-128}"
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" "$root/build" > /dev/null
model="$root/out/bench/qwen2.5-0.5b-bf16"
if [[ ! -f "$model/model.safetensors" ]]; then
  "$root/build/memtune" init-model --preset qwen2.5-0.5b --torch_dtype bfloat16 --seed 1 --out "$model"
fi
threads="$(nproc)"
rows="["
for dtype in float32 bfloat16; do
  echo "== $dtype ($threads threads)"
  line="$(OMP_NUM_THREADS=$threads "$root/build/bench_generate" --model "$model" --torch_dtype "$dtype" \
    --prompt "$prompt" --new "$new" | tee /dev/stderr | tail -1)"
  rows+="$line,"
done
rows="${rows%,}]"
/usr/bin/python3 "$root/scripts/bench_results.py" record generate \
  "{\"prompt\": $prompt, \"new_tokens\": $new, \"batches\": [1, 8]}" "$rows"
