#!/usr/bin/env bash
# Benchmark of generation on the Qwen2.5-0.5B shape (random weights, created once in
# out/bench/qwen2.5-0.5b-bf16), float32, bfloat16 and its GPTQ int8 / int4 copies (group 128,
# round-to-nearest, made once by memtune quantize; with int8 and with float32 activations, and the
# int4 copy with its LM head packed at load to 8 and 4 bits): prefill and decode tokens/s at batch 1 and 8
# against the machine's memory read bandwidth and sgemm ceiling measured in the same run
# (bench/bench_generate.cpp); and llama.cpp (npm node-llama-cpp's prebuilt CPU binary, pinned in
# bench/llama-cpp) on GGUF f16 / q8_0 / q4_0 copies of the same bfloat16 weights
# (bench/gguf_writer.py), each run beside the memtune run it compares with; MEMTUNE_BENCH_LLAMA_CPP=0
# leaves llama.cpp out. Writes bench/results/generate-*.json
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
# llama.cpp on the same weights: GGUF copies written once (again when the writer changes).
llama_cpp="${MEMTUNE_BENCH_LLAMA_CPP:-1}"
if [[ "$llama_cpp" == 1 ]]; then
  tokenizer="${MEMTUNE_TOKENIZER_DIR:-}"
  [[ -n "$tokenizer" ]] || tokenizer="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"
  "$root/scripts/npm-pinned.sh" "$root/bench/llama-cpp" "$root/out/llama-cpp" > /dev/null
  for type in f16 q8_0 q4_0; do
    if [[ ! -f "$model-$type.gguf" || "$root/bench/gguf_writer.py" -nt "$model-$type.gguf" ]]; then
      /usr/bin/python3 "$root/bench/gguf_writer.py" --model "$model" --tokenizer "$tokenizer" --type "$type" \
        --out "$model-$type.gguf"
    fi
  done
fi
threads="$(nproc)"
rows="["
# The GPTQ copies with int8 activations (prefill rounds its input to int8 for integer dot
# products), with bfloat16 operands (the input and each dequantized weight tile rounded to
# bfloat16, products through oneDNN) and with float32 inputs, in the same run; the packed-head
# copies take the default (--quantized_activations auto: bfloat16 operands where the CPU's matrix
# unit is AMX tiles, int8 activations otherwise). Each row's "products" names the kernels.
# llama.cpp's q4_0 (its llama-quantize's choice for this shape: a Q8_0 head) sits beside the int4
# copy with an 8-bit head.
for run in float32 bfloat16 llama.cpp:f16 gptq-int8:int8 gptq-int8:bf16 gptq-int8:float llama.cpp:q8_0 \
           gptq-int4:int8 gptq-int4:bf16 gptq-int4:float gptq-int4:head8 llama.cpp:q4_0 gptq-int4:head4; do
  [[ "$run" == llama.cpp:* && "$llama_cpp" != 1 ]] && continue
  echo "== $run ($threads threads)"
  case "$run" in
    llama.cpp:*)
      line="$(node "$root/bench/llama_cpp_generate.mjs" --model "$model-${run#llama.cpp:}.gguf" --threads "$threads" \
        --prompt "$prompt" --new "$new" --rounds 5 | tee /dev/stderr | tail -1)"
      rows+="$line,"
      continue ;;
    gptq-*:head*) args=(--model "$model-${run%:head*}" --torch_dtype bfloat16 --lm_head_bits "${run##*:head}") ;;
    gptq-*:int8 | gptq-*:bf16 | gptq-*:float)
      args=(--model "$model-${run%:*}" --torch_dtype bfloat16 --quantized_activations "${run##*:}") ;;
    *) args=(--model "$model" --torch_dtype "$run") ;;
  esac
  line="$(OMP_NUM_THREADS=$threads "$root/build/bench_generate" "${args[@]}" \
    --prompt "$prompt" --new "$new" | tee /dev/stderr | tail -1)"
  rows+="$line,"
done
rows="${rows%,}]"
/usr/bin/python3 "$root/scripts/bench_results.py" record generate \
  "{\"prompt\": $prompt, \"new_tokens\": $new, \"batches\": [1, 8]}" "$rows"
