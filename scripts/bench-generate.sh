#!/usr/bin/env bash
# Benchmark of generation on the Qwen2.5-0.5B shape (random weights, created once in
# out/bench/qwen2.5-0.5b-bf16), float32, bfloat16 and its GPTQ int8 / int4 copies (group 128,
# round-to-nearest, made once by memtune quantize; with int8 and with float32 activations, and the
# int4 copy with its LM head packed at load to 8 and 4 bits): prefill and decode tokens/s at batch 1 and 8
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
for bits in 8 4; do
  if [[ ! -f "$model-gptq-int$bits/model.safetensors" ]]; then
    "$root/build/memtune" quantize --model "$model" --bits $bits --group_size 128 --out "$model-gptq-int$bits"
  fi
done
threads="$(nproc)"
rows="["
# The GPTQ copies with int8 activations (the default: prefill rounds its input to int8) and with
# float32 ones (--quantized_activations float), measured in the same run.
for run in float32 bfloat16 gptq-int8 gptq-int8:float gptq-int4 gptq-int4:float gptq-int4:head8 gptq-int4:head4; do
  echo "== $run ($threads threads)"
  case "$run" in
    gptq-*:head*) args=(--model "$model-${run%:head*}" --torch_dtype bfloat16 --lm_head_bits "${run##*:head}") ;;
    gptq-*:float) args=(--model "$model-${run%:float}" --torch_dtype bfloat16 --quantized_activations float) ;;
    gptq-*) args=(--model "$model-$run" --torch_dtype bfloat16) ;;
    *) args=(--model "$model" --torch_dtype "$run") ;;
  esac
  line="$(OMP_NUM_THREADS=$threads "$root/build/bench_generate" "${args[@]}" \
    --prompt "$prompt" --new "$new" | tee /dev/stderr | tail -1)"
  rows+="$line,"
done
rows="${rows%,}]"
/usr/bin/python3 "$root/scripts/bench_results.py" record generate \
  "{\"prompt\": $prompt, \"new_tokens\": $new, \"batches\": [1, 8]}" "$rows"
