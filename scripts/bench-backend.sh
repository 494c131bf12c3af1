#!/usr/bin/env bash
# Before/after benchmark of a change to the compute path, measured in one run on one machine:
# bench_step (forward + loss + backward, batch 4 x 512) and `memtune train` steps (full and LoRA,
# the setup of scripts/bench-train.sh) on the ~30M-parameter model with the real vocabulary,
# alternating a baseline build and this tree's build round by round, plus the reference
# backend's step on the tiny preset (for scale: it is the oracle, not a contender).
# Writes out/bench/backend-compare.json: commit, machine, CPU model and flags, threads, date,
# every run, medians and after/before ratios.
# Usage: scripts/bench-backend.sh BASELINE_BUILD_DIR [rounds=3]
#   BASELINE_BUILD_DIR holds bench_step and memtune built from the commit to compare against.
set -euo pipefail
base="${1:?usage: scripts/bench-backend.sh BASELINE_BUILD_DIR [rounds=3]}"
rounds="${2:-3}"
[[ -x "$base/bench_step" && -x "$base/memtune" ]] || { echo "bench-backend: no bench_step/memtune in $base" >&2; exit 1; }
unset MEMTUNE_BENCH_BIN
source "$(dirname "$0")/bench-common.sh"
threads="$(nproc)"
data="$root/out/bench/train-text.jsonl"
if [[ ! -f "$data" ]]; then
  /usr/bin/python3 "$root/tools/make_bench_text.py" "$data.tmp" 64 0
  mv "$data.tmp" "$data"
fi
tiny="$root/out/bench/tiny"
[[ -f "$tiny/model.safetensors" ]] || "$memtune" init-model --preset tiny --out "$tiny" --seed 1 > /dev/null

runs=()
step() {  # build_dir label
  local json
  json="$(OMP_NUM_THREADS=$threads "$1/bench_step" --model "$model" --batch 4 --seq 512 --steps 3 | tail -1)"
  runs+=("{\"what\": \"bench_step\", \"build\": \"$2\", \"result\": $json}")
}
train() {  # build_dir label tuner
  local out="$root/out/bench/compare-$2-$3"
  rm -rf "$out"
  OMP_NUM_THREADS=$threads "$1/memtune" train --model_name_or_path "$model" --tokenizer "$tokenizer" \
    --train_file "$data" --output_dir "$out" --tuner_type "$3" --per_device_train_batch_size 4 --max_length 512 \
    --max_steps 4 --logging_steps 1 --save_strategy no --learning_rate 1e-4 --lr_scheduler_type constant \
    --lora_rank 8 --lora_alpha 32 --target_modules all-linear --lora_dropout 0 > /dev/null
  local tps
  tps="$(/usr/bin/python3 -c '
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if "tokens_per_second" in l]
print(sum(x["tokens_per_second"] for x in r[1:]) / len(r[1:]))' "$out/log.jsonl")"
  runs+=("{\"what\": \"train_$3\", \"build\": \"$2\", \"result\": {\"tokens_per_s\": $tps}}")
}
for ((r = 1; r <= rounds; ++r)); do
  echo "== round $r of $rounds" >&2
  step "$base" before; step "$root/build" after
  train "$base" before full; train "$root/build" after full
  train "$base" before lora; train "$root/build" after lora
done
reference="$(OMP_NUM_THREADS=1 "$root/build/bench_step" --model "$tiny" --backend reference --batch 1 --seq 64 --steps 1 | tail -1)"
cpu_tiny="$(OMP_NUM_THREADS=$threads "$root/build/bench_step" --model "$tiny" --batch 1 --seq 64 --steps 3 | tail -1)"

mkdir -p "$root/out/bench"
/usr/bin/python3 - "$root/out/bench/backend-compare.json" "$reference" "$cpu_tiny" "$threads" "${runs[@]}" <<'PY'
import json, platform, statistics, subprocess, sys, datetime
path, reference, cpu_tiny, threads, *runs = sys.argv[1:]
runs = [json.loads(r) for r in runs]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
summary = {}
for what in ("bench_step", "train_full", "train_lora"):
    med = {b: statistics.median(r["result"]["tokens_per_s"] for r in runs if r["what"] == what and r["build"] == b)
           for b in ("before", "after")}
    summary[what] = {"before_tokens_per_s": med["before"], "after_tokens_per_s": med["after"],
                     "after_over_before": med["after"] / med["before"]}
doc = {"commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "machine": platform.node(), "cpu": cpu,
       "avx512": any(f.startswith("avx512") for f in flags), "threads": int(threads), "runs": runs,
       "summary": summary,
       "tiny_step_seconds": {"reference": json.loads(reference)["seconds_per_step"],
                             "cpu": json.loads(cpu_tiny)["seconds_per_step"]}}
json.dump(doc, open(path, "w"), indent=2)
for what, s in summary.items():
    print(f"{what:<11} before {s['before_tokens_per_s']:8.0f} tok/s  after {s['after_tokens_per_s']:8.0f} tok/s  "
          f"after/before {s['after_over_before']:.3f}")
t = doc["tiny_step_seconds"]
print(f"tiny preset, 1 x 64 tokens: reference backend {t['reference']:.3f} s per step, cpu {t['cpu']:.4f} s")
print(f"wrote {path}")
PY
