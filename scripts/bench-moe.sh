#!/usr/bin/env bash
# Benchmark of a mixture-of-experts model's generation on the CPU against llama.cpp on the same
# weights: a Qwen3-MoE-shaped model small enough for a 2-core machine (out/bench/qwen3-moe-2b:
# qwen3-30b-a3b's block with hidden 1024, 16 layers, 16 heads / 4 KV heads of 64, 64 experts of
# 512, 8 a token; random bfloat16 weights, 1.96B parameters, 0.45B activated), created once by
# memtune init-model, and its GGUF f16 copy (bench/gguf_writer.py, the experts stacked as
# llama.cpp's qwen3moe reads them). memtune: bench/bench_generate.cpp (prefill of the prompt,
# batch-1 decode rounds); llama.cpp: npm node-llama-cpp's prebuilt CPU binary
# (bench/llama_cpp_generate.mjs), run right after. Writes bench/results/moe-*.json
# (scripts/bench_results.py tables: the moe table).
# Usage: scripts/bench-moe.sh [prompt=128] [new_tokens=64]
set -euo pipefail
prompt="${1:-128}" new="${2:-64}"
source "$(dirname "$0")/bench-common.sh"  # root, memtune (built), tokenizer
model="$root/out/bench/qwen3-moe-2b"
if [[ ! -f "$model/model.safetensors.index.json" && ! -f "$model/model.safetensors" ]]; then
  "$memtune" init-model --preset qwen3-30b-a3b --torch_dtype bfloat16 --seed 1 --out "$model" \
    --set hidden_size=1024 --set num_hidden_layers=16 --set num_attention_heads=16 --set num_key_value_heads=4 \
    --set head_dim=64 --set num_experts=64 --set moe_intermediate_size=512
fi
"$root/scripts/npm-pinned.sh" "$root/bench/llama-cpp" "$root/out/llama-cpp" > /dev/null
if [[ ! -f "$model-f16.gguf" || "$root/bench/gguf_writer.py" -nt "$model-f16.gguf" ]]; then
  /usr/bin/python3 "$root/bench/gguf_writer.py" --model "$model" --tokenizer "$tokenizer" --type f16 \
    --out "$model-f16.gguf"
fi
threads="$(nproc)"
echo "== memtune ($threads threads)"
mt="$(OMP_NUM_THREADS=$threads "$root/build/bench_generate" --model "$model" --torch_dtype bfloat16 \
  --prompt "$prompt" --new "$new" --batches 1 --rounds 3 | tee /dev/stderr | tail -1)"
echo "== llama.cpp f16 ($threads threads)"
ll="$(node "$root/bench/llama_cpp_generate.mjs" --model "$model-f16.gguf" --threads "$threads" \
  --prompt "$prompt" --new "$new" --rounds 3 | tee /dev/stderr | tail -1)"
/usr/bin/python3 "$root/scripts/bench_results.py" record moe \
  "{\"prompt\": $prompt, \"new_tokens\": $new, \"model\": \"qwen3-30b-a3b block: hidden 1024, 16 layers, 64 experts of 512, 8 a token\"}" \
  "[{\"run\": \"qwen3-moe 1.96B (0.45B activated), bfloat16 / f16\", \"memtune\": $mt, \"llama_cpp\": $ll}]"
