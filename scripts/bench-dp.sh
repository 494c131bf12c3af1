#!/usr/bin/env bash
# Data-parallel benchmark: full and LoRA fine-tuning of the ~30M-parameter model of
# scripts/bench.sh (real vocabulary 151936) on 1 process (micro-batch 2, all cores) and on
# 2 ranks under mpirun (micro-batch 1 each, one core each): the same global batch of 2 x ~505
# tokens per step. Reports global tokens/s (mean after the first step) and the bytes each rank
# handed to collectives per step against what a ring allreduce of the gradients must send per rank,
# 2 (N-1)/N x gradient bytes.
# Usage: scripts/bench-dp.sh [steps=4]. MEMTUNE_BENCH_BIN=PATH uses that binary.
set -euo pipefail
steps="${1:-4}"
source "$(dirname "$0")/bench-common.sh"
data="$root/out/bench/train-text.jsonl"
if [[ ! -f "$data" ]]; then
  /usr/bin/python3 "$root/tools/make_bench_text.py" "$data.tmp" 64 0
  mv "$data.tmp" "$data"
fi
common=(--model_name_or_path "$model" --tokenizer "$tokenizer" --train_file "$data" --max_length 512
  --max_steps "$steps" --logging_steps 1 --save_strategy no --learning_rate 1e-4 --lr_scheduler_type constant
  --lora_dropout 0)
for tuner in full lora; do
  one="$root/out/bench/dp-$tuner-1"
  two="$root/out/bench/dp-$tuner-2"
  rm -rf "$one" "$two"
  "$memtune" train "${common[@]}" --tuner_type "$tuner" --output_dir "$one" --per_device_train_batch_size 2 > /dev/null
  mpirun --allow-run-as-root --oversubscribe -np 2 "$memtune" train "${common[@]}" --tuner_type "$tuner" \
    --output_dir "$two" --per_device_train_batch_size 1 > /dev/null
  /usr/bin/python3 - "$tuner" "$one" "$two" <<'PY'
import json, os, sys
tuner, one, two = sys.argv[1:]
def records(d):
    with open(os.path.join(d, "log.jsonl")) as f:
        return [json.loads(l) for l in f if '"tokens_per_second"' in l]
def speed(rs):
    timed = rs[1:] or rs
    return sum(r["tokens_per_second"] for r in timed) / len(timed)
r1, r2 = records(one), records(two)
memory = json.load(open(os.path.join(two, "memory.json")))
grad_bytes = memory["categories"]["gradients"]
per_step = r2[-1]["comm_payload_bytes"] / len(r2)
ring = 2 * (2 - 1) / 2 * grad_bytes
print(f"{tuner}: 1 process {speed(r1):.0f} tok/s, 2 ranks {speed(r2):.0f} tok/s ({speed(r2) / speed(r1):.2f}x); "
      f"per rank per step {per_step / 2**20:.2f} MiB handed to collectives, gradients {grad_bytes / 2**20:.2f} MiB, "
      f"ring allreduce minimum sent {ring / 2**20:.2f} MiB ({per_step / ring:.3f}x)")
PY
done
