#!/usr/bin/env bash
# The whole process's memory, predicted against measured: for the demo's run (the 20M model with
# the real vocabulary, full fine-tuning, batch 16 x up to 256 tokens of the Debian data, with
# evaluation) and for the bench model of scripts/bench.sh (30M, LoRA and full, batch 4 x ~510
# tokens), runs `memtune train` and reads its memory.json: the arena (the plan), the process peak
# predicted before the run, the peak RSS the kernel measured (getrusage) and the arena's resident
# pages (mincore). Writes bench/results/memory-*.json and regenerates the tables from them.
# Usage: scripts/bench-memory.sh [steps=20]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-20}"
source "$(dirname "$0")/bench-common.sh"

demo_model="$root/out/bench/demo-20m"
"$root/scripts/demo-model.sh" "$memtune" "$tokenizer" "$demo_model"
data="$root/out/bench/train-text.jsonl"
if [[ ! -f "$data" ]]; then
  /usr/bin/python3 "$root/tools/make_bench_text.py" "$data.tmp" 64 0
  mv "$data.tmp" "$data"
fi
debian="$root/examples/debian-sections"

rows=()
run() {  # run NAME FLAGS...
  local name="$1"
  shift
  local out="$root/out/bench/memory-$(( ${#rows[@]} + 1 ))"
  rm -rf "$out"
  echo "== $name" >&2
  "$memtune" train --output_dir "$out" --max_steps "$steps" --logging_steps "$steps" --save_strategy no "$@" \
    | grep -E '^(process|done)' >&2
  rows+=("$(/usr/bin/python3 - "$out/memory.json" "$name" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
print(json.dumps({"run": sys.argv[2], "arena_bytes": m["arena_bytes"],
                  "predicted_bytes": m["process_predicted_peak_bytes"],
                  "measured_bytes": m["process_peak_rss_bytes"],
                  "arena_resident_bytes": m["arena_resident_bytes"]}))
EOF
)")
}
run "demo (20M, full, 16 x 256, eval)" --model_name_or_path "$demo_model" --train_file "$debian/train.jsonl" \
  --eval_file "$debian/eval.jsonl" --eval_strategy steps --eval_steps "$steps" --metrics label_accuracy,macro_f1 \
  --system "Classify the Debian package by its section." --tuner_type full --per_device_train_batch_size 16 \
  --max_length 256
for tuner in full lora; do
  run "bench model (30M, $tuner, 4 x 512)" --model_name_or_path "$model" --tokenizer "$tokenizer" \
    --train_file "$data" --tuner_type "$tuner" --per_device_train_batch_size 4 --max_length 512
done

settings="{\"steps\": $steps}"
joined="$(IFS=,; echo "${rows[*]}")"
/usr/bin/python3 "$root/scripts/bench_results.py" record memory "$settings" "[$joined]"
/usr/bin/python3 "$root/scripts/bench_results.py" tables
/usr/bin/python3 - "[$joined]" <<'EOF'
import json, sys
worst = 0
for r in json.loads(sys.argv[1]):
    e = (r["predicted_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
    worst = max(worst, abs(e))
    print(f"{r['run']:<36} arena {r['arena_bytes'] / 2**20:8.1f} MiB  predicted {r['predicted_bytes'] / 2**20:8.1f} MiB"
          f"  measured {r['measured_bytes'] / 2**20:8.1f} MiB  ({e:+.1%})")
print(f"largest prediction error {worst:.1%} (target <= 10%)")
EOF
