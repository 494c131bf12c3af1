#!/usr/bin/env bash
# Benchmark of a mixture-of-experts model's generation on the CPU against llama.cpp on the same
# weights: a Qwen3-MoE-shaped model small enough for a 2-core machine (out/bench/qwen3-moe-2b:
# qwen3-30b-a3b's block with hidden 1024, 16 layers, 16 heads / 4 KV heads of 64, 64 experts of
# 512, 8 a token; random bfloat16 weights, 1.96B parameters, 0.45B activated), created once by
# memtune init-model, its GGUF f16 copy (bench/gguf_writer.py, the experts stacked as
# llama.cpp's qwen3moe reads them), and a 4-bit pair (memtune's RTN int4 with an 8-bit head;
# llama.cpp's q4_0). memtune: bench/bench_generate.cpp (prefill of the prompt,
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
# Its 4-bit copy (memtune quantize: round to nearest, groups of 128) and llama.cpp's q4_0 of the
# same bfloat16 weights; both heads 8-bit (memtune packs the head at load, q4_0's head is Q8_0).
if [[ ! -f "$model-gptq-int4/model.safetensors" && ! -f "$model-gptq-int4/model.safetensors.index.json" ]]; then
  "$memtune" quantize --model "$model" --bits 4 --group_size 128 --method rtn --out "$model-gptq-int4"
fi
"$root/scripts/npm-pinned.sh" "$root/bench/llama-cpp" "$root/out/llama-cpp" > /dev/null
for type in f16 q4_0; do
  if [[ ! -f "$model-$type.gguf" || "$root/bench/gguf_writer.py" -nt "$model-$type.gguf" ]]; then
    /usr/bin/python3 "$root/bench/gguf_writer.py" --model "$model" --tokenizer "$tokenizer" --type "$type" \
      --out "$model-$type.gguf"
  fi
done
threads="$(nproc)"
rows="["
for run in bfloat16:f16 int4:q4_0; do
  echo "== memtune $run ($threads threads)"
  if [[ "$run" == bfloat16:* ]]; then
    args=(--model "$model" --torch_dtype bfloat16)
    label="qwen3-moe 1.96B (0.45B activated), bfloat16 / f16"
  else
    args=(--model "$model-gptq-int4" --torch_dtype bfloat16 --lm_head_bits 8)
    label="qwen3-moe 1.96B (0.45B activated), gptq-int4 with an 8-bit head / q4_0 (Q8_0 head)"
  fi
  mt="$(OMP_NUM_THREADS=$threads "$root/build/bench_generate" "${args[@]}" \
    --prompt "$prompt" --new "$new" --batches 1 --rounds 3 | tee /dev/stderr | tail -1)"
  echo "== llama.cpp ${run#*:} ($threads threads)"
  ll="$(node "$root/bench/llama_cpp_generate.mjs" --model "$model-${run#*:}.gguf" --threads "$threads" \
    --prompt "$prompt" --new "$new" --rounds 3 | tee /dev/stderr | tail -1)"
  rows+="{\"run\": \"$label\", \"memtune\": $mt, \"llama_cpp\": $ll},"
done
/usr/bin/python3 "$root/scripts/bench_results.py" record moe \
  "{\"prompt\": $prompt, \"new_tokens\": $new, \"model\": \"qwen3-30b-a3b block: hidden 1024, 16 layers, 64 experts of 512, 8 a token\"}" \
  "${rows%,}]"
