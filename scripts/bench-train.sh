#!/usr/bin/env bash
# Benchmark of whole fine-tuning steps (forward, loss, backward, gradient clipping, AdamW) through
# `memtune train`, full and LoRA, on the ~30M-parameter Qwen2-shaped model of scripts/bench.sh
# (real Qwen2.5 vocabulary 151936), batch 4 x up to 512 tokens of a fixed text dataset, in one run
# against:
# - the eager PyTorch reference trained the way a Hugging Face Trainer step runs
#   (tools/qwen2_reference.py train-bench, batch 4 x 512 random tokens; float32, and beside
#   `--bf16` with the forward and loss under bfloat16 autocast, Debian's torch on oneDNN);
# - Hugging Face Trainer itself (+ PEFT for LoRA) on the same model, data, batch and steps
#   (bench/hf_trainer_bench.py train, in the pinned environment of scripts/prepare-hf-env.sh),
#   float32 and, against `memtune train --bf16` (mixed precision: bfloat16 weights and products,
#   float32 accumulation, masters and AdamW; oneDNN on the CPU's matrix units where it has them),
#   Trainer's bf16=True (float32 weights, bfloat16 autocast on the CPU).
# memtune's tokens/s is the mean of log.jsonl's tokens_per_second after the first step (all tokens
# of a step: 4 examples of 501-510 tokens); its peak is memory.json's process_peak_rss_bytes.
# Trainer's tokens/s is the mean over the steps after the first of the batch's non-pad tokens over
# the step's wall time (a TrainerCallback's on_step_begin to on_step_end); its peak is the
# process's ru_maxrss. Every run is its own process.
# Writes bench/results/train-*.json (scripts/bench_results.py tables turns them into the tables).
# Usage: scripts/bench-train.sh [steps=4]   (steps 1 is a smoke test: nothing excluded as warm-up)
# MEMTUNE_BENCH_BIN=PATH uses that memtune binary instead of building build/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-4}"
if ! [[ "$steps" =~ ^[1-9][0-9]*$ ]]; then
  echo "bench-train: steps must be a positive integer, got '$steps'" >&2
  exit 1
fi
source "$(dirname "$0")/bench-common.sh"

# 64 examples of 500-509 random common English words, each one token with its leading space;
# memtune's text format appends the eos token: 501-510 tokens, so max_length 512 deletes none.
data="$root/out/bench/train-text.jsonl"
if [[ ! -f "$data" ]]; then
  /usr/bin/python3 "$root/tools/make_bench_text.py" "$data.tmp" 64 0
  mv "$data.tmp" "$data"
fi
stats="$("$memtune" data stats --tokenizer "$tokenizer" --file "$data" --json)"
/usr/bin/python3 - "$stats" <<'EOF'
import json, sys
s = json.loads(sys.argv[1])
n = s["length"]
if not (480 <= n["p50"] <= 511 and n["max"] <= 511):
    sys.exit(f"bench-train: dataset lengths off: p50 {n['p50']}, max {n['max']} "
             f"(want p50 in [480, 511], max <= 511)")
print(f"dataset: {s['examples']} examples (format {s['format']}) of {n['min']}-{n['max']} tokens, p50 {n['p50']}")
EOF

threads="$(nproc)"
hf_python="$("$root/scripts/prepare-hf-env.sh" | tail -n 1)"
results=()
for precision in float32 bf16; do
  bf16_flag=() suffix=""
  if [[ "$precision" == bf16 ]]; then
    bf16_flag=(--bf16) suffix="-bf16"
  fi
  for tuner in full lora; do
    out="$root/out/bench/train-$tuner$suffix"
    rm -rf "$out"
    echo "== memtune train --tuner_type $tuner${bf16_flag[*]:+ ${bf16_flag[*]}} ($threads threads)"
    OMP_NUM_THREADS=$threads "$memtune" train --model_name_or_path "$model" --tokenizer "$tokenizer" \
      --train_file "$data" --output_dir "$out" --tuner_type "$tuner" --per_device_train_batch_size 4 \
      --max_length 512 --max_steps "$steps" --logging_steps 1 --save_strategy no --learning_rate 1e-4 \
      --lr_scheduler_type constant --lora_rank 8 --lora_alpha 32 --target_modules all-linear \
      --lora_dropout 0 "${bf16_flag[@]}" >&2
    mt="$(/usr/bin/python3 - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
with open(os.path.join(out, "log.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
steps = [r for r in records if "tokens_per_second" in r]
if not steps:
    sys.exit(f"bench-train: {out}/log.jsonl has no records with tokens_per_second")
# The first step is a warm-up; with a single step (a smoke test) it is all there is.
timed = steps[1:] or steps
with open(os.path.join(out, "memory.json")) as f:
    memory = json.load(f)
print(json.dumps({"tokens_per_s": sum(r["tokens_per_second"] for r in timed) / len(timed),
                  "timed_steps": len(timed), "peak_rss_bytes": memory["process_peak_rss_bytes"],
                  "products": memory.get("products", [])}))
EOF
)"
    echo "$mt"
    autocast=()
    [[ "$precision" == bf16 ]] && autocast=(--autocast bf16)
    echo "== PyTorch eager reference, $tuner, $precision ($threads threads)"
    pt="$(/usr/bin/python3 "$root/tools/qwen2_reference.py" train-bench --model "$model" --batch 4 --seq 512 \
      --steps "$((steps + 1))" --threads "$threads" --tuner "$tuner" --lora_rank 8 --lora_alpha 32 \
      --target_modules all-linear --lr 1e-4 "${autocast[@]}" | tail -n 1)"
    echo "$pt"
    echo "== Hugging Face Trainer, $tuner, $precision ($threads threads)"
    hf="$(OMP_NUM_THREADS=$threads "$hf_python" "$root/bench/hf_trainer_bench.py" train --model "$model" \
      --tokenizer "$tokenizer" --data "$data" --memtune "$memtune" --steps "$steps" --max_length 512 \
      --tuner "$tuner" --precision "$precision" | tail -n 1)"
    echo "$hf"
    results+=("$tuner" "$precision" "$mt" "$pt" "$hf")
  done
done

/usr/bin/python3 - "$root" "$steps" "${results[@]}" <<'EOF'
import json, subprocess, sys
root, steps, args = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = [(args[i], args[i + 1], *(json.loads(a) for a in args[i + 2:i + 5])) for i in range(0, len(args), 5)]
recorded = []
for tuner, precision, mt, pt, hf in rows:
    row = {"run": f"train {tuner}{' bf16' if precision == 'bf16' else ''}, 4 x ~510 tokens", "tuner": tuner,
           "precision": precision, "memtune": mt}
    if pt is not None:
        row["reference"] = pt
    row["hf_trainer"] = hf
    row["vs_hf_trainer"] = {"tokens_per_s": mt["tokens_per_s"] / hf["tokens_per_s"],
                            "peak_rss": mt["peak_rss_bytes"] / hf["peak_rss_bytes"]}
    recorded.append(row)
settings = {"batch": 4, "max_length": 512, "steps": int(steps),
            "hf_trainer": {k: rows[0][4][k] for k in ("transformers", "peft", "torch")},
            "bf16": "memtune --bf16: bfloat16 weights, bfloat16 operands with float32 accumulation in the "
                    "linear layers' and the LM head's products (oneDNN), float32 masters and AdamW; "
                    "Trainer bf16=True keeps float32 weights and autocasts to bfloat16"}
subprocess.run(["/usr/bin/python3", f"{root}/scripts/bench_results.py", "record", "train",
                json.dumps(settings), json.dumps(recorded)], check=True)
mib = lambda b: f"{b / 2**20:.0f} MiB"
print(f"\n{'tuner':<6} {'precision':<9} {'memtune tok/s':>14} {'PyTorch tok/s':>14} {'speed':>7} "
      f"{'memtune RSS':>12} {'PyTorch RSS':>12} {'memory':>7}")
for tuner, precision, mt, pt, hf in rows:
    if pt is None:
        continue
    speed = mt["tokens_per_s"] / pt["tokens_per_s"]
    mem = mt["peak_rss_bytes"] / pt["peak_rss_bytes"]
    print(f"{tuner:<6} {precision:<9} {mt['tokens_per_s']:>14.0f} {pt['tokens_per_s']:>14.0f} {speed:>6.2f}x "
          f"{mib(mt['peak_rss_bytes']):>12} {mib(pt['peak_rss_bytes']):>12} {mem:>6.3f}x")
print("targets: speed >= 2x (bf16 against autocast: 3x), memory <= 0.2x (memtune counts the tokens of its "
      "batches, 4 x 501-510; PyTorch 4 x 512)")

speed_target, memory_target = 2.5, 0.25
versions = ", ".join(f"{k} {rows[0][4][k]}" for k in ("transformers", "peft", "torch"))
print(f"\nHugging Face Trainer ({versions}), same model, data, batch and steps:")
print(f"{'tuner':<6} {'precision':<9} {'memtune tok/s':>14} {'Trainer tok/s':>14} {'speed':>7} "
      f"{'memtune RSS':>12} {'Trainer RSS':>12} {'memory':>7}  targets")
for tuner, precision, mt, pt, hf in rows:
    speed = mt["tokens_per_s"] / hf["tokens_per_s"]
    mem = mt["peak_rss_bytes"] / hf["peak_rss_bytes"]
    verdict = (f"speed {'met' if speed >= speed_target else 'MISSED'}, "
               f"memory {'met' if mem <= memory_target else 'MISSED'}")
    print(f"{tuner:<6} {precision:<9} {mt['tokens_per_s']:>14.0f} {hf['tokens_per_s']:>14.0f} {speed:>6.2f}x "
          f"{mib(mt['peak_rss_bytes']):>12} {mib(hf['peak_rss_bytes']):>12} {mem:>6.3f}x  {verdict}")
print(f"targets: memtune >= {speed_target}x Trainer's tokens/s at <= {memory_target}x its peak RSS, same "
      f"precision (both count the non-pad tokens of the same batches; bf16: memtune --bf16 is mixed "
      f"precision, bfloat16 weights and products; Trainer bf16=True autocasts float32 weights)")
EOF
