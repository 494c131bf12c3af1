#!/usr/bin/env bash
# Quality and size of quantized models. Trains the demo's model shape (20M parameters, the real
# Qwen2.5 vocabulary and tokenizer) as a language model on the Debian package descriptions of
# examples/debian-sections (their text, labels dropped; created once in out/bench/quantize-lm),
# quantizes it (int8 and int4 round-to-nearest, int4 GPTQ with and without act-order, calibrated
# on 128 training texts) and measures each copy's perplexity on the held-out descriptions with
# `memtune eval`, with int8 activations (the default) and with float32 ones (the quality guard:
# within 0.5%); int4 GPTQ copies with the LM head packed too (--lm_head_bits 8 and 4) are measured
# against the 16-bit head's (the same guard). Then plans the weights of Qwen2.5-0.5B / 7B / 72B in float16, int8 and int4.
# Writes bench/results/quantize-*.json (scripts/bench_results.py tables makes the table).
# Usage: scripts/bench-quantize.sh [train_steps=300]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-300}"
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" "$root/build" > /dev/null
memtune="$root/build/memtune"
tokenizer="${MEMTUNE_TOKENIZER_DIR:-}"
[[ -n "$tokenizer" ]] || tokenizer="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"
py=/usr/bin/python3
out="$root/out/bench/quantize-lm"
mkdir -p "$out"
for split in train eval; do
  "$py" -c 'import json, sys
for line in open(sys.argv[1]):
    print(json.dumps({"text": json.loads(line)["text"]}))' "$root/examples/debian-sections/$split.jsonl" > "$out/$split.jsonl"
done
"$root/scripts/demo-model.sh" "$memtune" "$tokenizer" "$out/init"
if [[ ! -f "$out/trained/.steps-$steps" ]]; then
  rm -rf "$out/trained"
  "$memtune" train --model_name_or_path "$out/init" --train_file "$out/train.jsonl" --output_dir "$out/trained" \
    --tuner_type full --max_steps "$steps" --per_device_train_batch_size 16 --max_length 256 --learning_rate 2e-3 \
    --lr_scheduler_type cosine --warmup_ratio 0.05 --logging_steps 50 --save_strategy no --seed 7 | tail -n 3
  touch "$out/trained/.steps-$steps"
fi
quantize() {  # NAME FLAGS...
  local name="$1"
  shift
  rm -rf "${out:?}/$name"
  "$memtune" quantize --model "$out/trained" --out "$out/$name" "$@" | tail -n 2 | head -n 1
}
quantize int8-rtn --bits 8
quantize int4-rtn --bits 4
quantize int4-gptq --bits 4 --method gptq --calibration_file "$out/train.jsonl" --num_samples 128 --max_length 256
quantize int4-gptq-act-order --bits 4 --method gptq --act_order --calibration_file "$out/train.jsonl" \
  --num_samples 128 --max_length 256
for head in 8 4; do
  quantize "int4-gptq-head$head" --bits 4 --method gptq --calibration_file "$out/train.jsonl" --num_samples 128 \
    --max_length 256 --lm_head_bits "$head"
done
evaluate() {  # NAME FLAGS...: the last line of memtune eval --json
  local name="$1"
  shift
  "$memtune" eval --model_name_or_path "$out/$name" --eval_file "$out/eval.jsonl" --max_length 256 \
    --metrics eval_loss,perplexity --per_device_eval_batch_size 8 --json "$@" | tail -n 1
}
rows="["
head_base=""
for name in trained int8-rtn int4-rtn int4-gptq int4-gptq-act-order int4-gptq-head8 int4-gptq-head4; do
  # Quantized copies: with int8 activations (the default; evaluation's batches are many rows) and
  # with float32 ones, the quality guard between the two.
  result="$(evaluate "$name")"
  float_result="$(evaluate "$name" --quantized_activations float)"
  bytes="$(du -b "$out/$name/model.safetensors" | cut -f1)"
  row="$("$py" -c 'import json, sys
r, f = json.loads(sys.argv[2]), json.loads(sys.argv[4])
base = json.loads(sys.argv[5]) if sys.argv[5] else None
row = {"model": "float32" if sys.argv[1] == "trained" else sys.argv[1], "perplexity": r["perplexity"],
       "eval_loss": r["eval_loss"], "eval_tokens": r["eval_tokens"], "file_bytes": int(sys.argv[3])}
if sys.argv[1] != "trained":
    row["perplexity_float_activations"] = f["perplexity"]
    row["int8_activations_vs_float"] = r["perplexity"] / f["perplexity"] - 1
if "-head" in sys.argv[1]:  # the packed head against the same layers with a 16-bit head
    row["packed_head_vs_16bit"] = r["perplexity"] / base["perplexity"] - 1
print(json.dumps(row))' "$name" "$result" "$bytes" "$float_result" "$head_base")"
  [[ "$name" != int4-gptq ]] || head_base="$result"
  echo "$row"
  rows+="$row,"
done
rows="${rows%,}]"
sizes="["
for preset in qwen2.5-0.5b qwen2.5-7b qwen2.5-72b; do
  for q in none gptq-int8 gptq-int4; do
    flags=(--preset "$preset" --torch_dtype float16 --max_model_len 2048 --max_num_seqs 1)
    [[ "$q" == none ]] || flags+=(--quantization "$q")
    weights="$("$memtune" plan --inference "${flags[@]}" --json | "$py" -c 'import json, sys
print(json.load(sys.stdin)["categories"]["weights"])')"
    sizes+="{\"preset\": \"$preset\", \"quantization\": \"${q/none/float16}\", \"weights_bytes\": $weights},"
  done
done
sizes="${sizes%,}]"
"$py" "$root/scripts/bench_results.py" record quantize "{\"train_steps\": $steps, \"sizes\": $sizes}" "$rows"
