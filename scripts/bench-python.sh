#!/usr/bin/env bash
# Benchmark of the Python package's training against the same run through the CLI: `memtune
# train` and memtune.Trainer (build/python, Debian's python3 with nothing else installed) on the
# ~30M-parameter bench model (scripts/bench-common.sh), the same text (out/bench/train-text.jsonl,
# 64 examples of 501-510 tokens), full fine-tuning, batch 4, max_length 512, STEPS steps logged
# at every step, in ROUNDS interleaved rounds (CLI then Python, Python then CLI, ...). Both run the same
# engine; what differs is the Python process around it and its hooks (a log record and a step's
# end call back into Python). Reported: each step's loss from both (they must agree exactly: the
# same arithmetic in the same order) and the median over rounds of the tokens/s of the steps
# after the first (from the runs' own log records), with their ratio (target: within 3%).
# Writes bench/results/python_train-*.json (scripts/bench_results.py tables makes its table).
# Usage: scripts/bench-python.sh [steps=8] [rounds=6]
# MEMTUNE_BENCH_BIN=PATH uses that memtune binary (its build directory's python/ holds the package).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-8}" rounds="${2:-6}"
for v in "$steps" "$rounds"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "bench-python: steps and rounds must be positive integers, got '$v'" >&2; exit 1; }
done
((steps >= 2)) || { echo "bench-python: steps must be at least 2 (the first is warm-up)" >&2; exit 1; }
source "$(dirname "$0")/bench-common.sh"
package="$(dirname "$memtune")/python"
[[ -f "$package/memtune/__init__.py" ]] || {
  echo "bench-python: $package/memtune: no Python package next to $memtune (configure with -DMEMTUNE_HF_PYTHON=...)" >&2
  exit 1
}
data="$root/out/bench/train-text.jsonl"
if [[ ! -f "$data" ]]; then
  /usr/bin/python3 "$root/tools/make_bench_text.py" "$data.tmp" 64 0
  mv "$data.tmp" "$data"
fi
work="$root/out/bench/python-train"
rm -rf "$work"
mkdir -p "$work"
flags=(--model_name_or_path "$model" --tokenizer "$tokenizer" --train_file "$data" --tuner_type full --max_steps "$steps"
       --per_device_train_batch_size 4 --max_length 512 --logging_steps 1 --save_strategy no
       --learning_rate 1e-4 --report_to none)
cli_run() {
  echo "== round $1: memtune train"
  "$memtune" train "${flags[@]}" --output_dir "$work/cli-$1" > "$work/cli-$1.log"
}
python_run() {
  echo "== round $1: memtune.Trainer"
  PYTHONPATH="$package" /usr/bin/python3 - "$model" "$tokenizer" "$data" "$steps" "$work/python-$1" \
    > "$work/python-$1.log" <<'PY'
import sys
from memtune import Trainer, TrainingArguments
model, tokenizer, data, steps, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, max_length=512,
                         logging_steps=1, save_strategy="no", learning_rate=1e-4, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train()
PY
}
# Rounds alternate which goes first (CLI, Python; Python, CLI; ...): a machine whose speed drifts
# favours neither.
for ((r = 1; r <= rounds; ++r)); do
  if ((r % 2)); then
    cli_run "$r"
    python_run "$r"
  else
    python_run "$r"
    cli_run "$r"
  fi
done
/usr/bin/python3 - "$root" "$work" "$steps" "$rounds" <<'PY'
import json, statistics, subprocess, sys
root, work, steps, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def run(path):
    with open(f"{path}/log.jsonl") as f:
        records = [json.loads(l) for l in f if '"loss"' in l]
    losses = [r["loss"] for r in records]
    speed = statistics.median(r["tokens_per_second"] for r in records[1:])
    return losses, speed, records[-1]["memory_rss_bytes"]

cli = [run(f"{work}/cli-{r}") for r in range(1, rounds + 1)]
py = [run(f"{work}/python-{r}") for r in range(1, rounds + 1)]
worst = max(abs(a - b) / abs(a) for (la, _, _), (lb, _, _) in zip(cli, py) for a, b in zip(la, lb))
if any(len(l) != steps for l, _, _ in cli + py):
    sys.exit("bench-python: a run did not log every step")
cli_speed = statistics.median(s for _, s, _ in cli)
py_speed = statistics.median(s for _, s, _ in py)
ratio = py_speed / cli_speed
print(f"losses: {steps} steps x {rounds} rounds, largest relative difference Python vs CLI {worst:.2e}")
print(f"tokens/s (median over rounds of each run's median after step 1): CLI {cli_speed:.1f}, "
      f"Python {py_speed:.1f}, ratio {ratio:.3f} (target within 3%: {'met' if abs(ratio - 1) <= 0.03 else 'MISSED'})")
rows = [{"run": f"full fine-tuning, batch 4 x ~510 tokens, {steps} steps", "memtune_cli": {
             "tokens_per_s": cli_speed, "per_round": [s for _, s, _ in cli], "losses": cli[0][0]},
         "memtune_python": {"tokens_per_s": py_speed, "per_round": [s for _, s, _ in py], "losses": py[0][0]},
         "ratio_python_to_cli": ratio, "largest_loss_difference": worst}]
settings = {"steps": steps, "rounds": rounds, "batch": 4, "max_length": 512, "tuner": "full"}
subprocess.run(["/usr/bin/python3", f"{root}/scripts/bench_results.py", "record", "python_train",
                json.dumps(settings), json.dumps(rows)], check=True)
if worst > 1e-6:
    sys.exit(f"bench-python: the losses differ (largest relative difference {worst:.2e})")
PY
