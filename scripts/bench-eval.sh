#!/usr/bin/env bash
# Benchmark of evaluation memory and time: `memtune eval` (streaming metrics, logits never kept)
# against the eager PyTorch reference evaluated the way Hugging Face Trainer's evaluation loop
# runs with a custom compute_metrics (tools/qwen2_reference.py eval-bench), in one run, on the
# ~30M-parameter Qwen2-shaped model of scripts/bench.sh (real Qwen2.5 vocabulary 151936), batch 4
# x up to 512 tokens:
#   full:   compute_metrics receives the logits of the whole eval set (eval_accumulation_steps
#           unset: HF's nested_concat grows one [N, 512, V] float32 tensor with torch.cat, so the
#           last cat holds about twice that); it grows with the eval set;
#   argmax: preprocess_logits_for_metrics keeps only logits.argmax(-1), eval_loss is HF's mean of
#           per-batch losses.
# memtune evaluates a fixed text dataset (out/bench/eval-text.jsonl, NUM examples of 501-510
# tokens, generated once the way scripts/bench-train.sh makes train-text.jsonl); the reference
# NUM random sequences of 512 tokens. memtune's seconds and peak RSS are those of the whole
# process (/usr/bin/time -v: loading, tokenizing, evaluating); the reference's seconds cover its
# evaluation loop and compute_metrics only (not importing torch or loading the model), its peak
# RSS is the whole process's (getrusage).
# Usage: scripts/bench-eval.sh [num_sequences=24]
#   (24 keeps the full mode's peak, ~2 x 24 x 311 MB = ~15 GB, within a 24 GB machine; a larger
#   NUM whose projection exceeds the RAM is still run, and the full mode is reported as failed)
# MEMTUNE_BENCH_BIN=PATH uses that memtune binary instead of building build/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
num="${1:-24}"
if ! [[ "$num" =~ ^[1-9][0-9]*$ ]]; then
  echo "bench-eval: num_sequences must be a positive integer, got '$num'" >&2
  exit 1
fi
batch=4 seq=512
source "$(dirname "$0")/bench-common.sh"

# NUM examples of 500-509 random common English words, each one token with its leading space;
# memtune's text format appends the eos token: 501-510 tokens, so max_length 512 deletes none.
# scripts/bench-train.sh's generator and words, seeded 1 (train-text.jsonl is seeded 0); the
# file is regenerated only when it does not hold NUM examples.
data="$root/out/bench/eval-text.jsonl"
if [[ ! -f "$data" ]] || [[ "$(wc -l < "$data")" -ne "$num" ]]; then
  mkdir -p "$(dirname "$data")"
  /usr/bin/python3 "$root/tools/make_bench_text.py" "$data.tmp" "$num" 1
  mv "$data.tmp" "$data"
fi
stats="$("$memtune" data stats --tokenizer "$tokenizer" --file "$data" --json)"
/usr/bin/python3 - "$stats" "$num" <<'EOF'
import json, sys
s, num = json.loads(sys.argv[1]), int(sys.argv[2])
n = s["length"]
if s["examples"] != num or not (480 <= n["p50"] <= 511 and n["max"] <= 511):
    sys.exit(f"bench-eval: dataset off: {s['examples']} examples (want {num}), lengths p50 "
             f"{n['p50']}, max {n['max']} (want p50 in [480, 511], max <= 511)")
print(f"dataset: {s['examples']} examples (format {s['format']}) of {n['min']}-{n['max']} tokens, p50 {n['p50']}")
EOF

threads="$(nproc)"
# What the full mode keeps: NUM x 512 x V float32 logits; the last torch.cat holds the old and the
# new tensor, about twice that.
/usr/bin/python3 - "$model/config.json" "$num" "$seq" <<'EOF'
import json, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
num, seq = int(sys.argv[2]), int(sys.argv[3])
ram = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
per_seq = seq * vocab * 4
gb = lambda b: f"{b / 1e9:.1f} GB"
print(f"full-mode logits: {seq} x {vocab} x 4 bytes = {per_seq / 1e6:.0f} MB per sequence, "
      f"growing with the eval set; this machine has {gb(ram)} of RAM")
for n in dict.fromkeys((num, 200)):
    kept, peak = n * per_seq, 2 * n * per_seq
    verdict = "exceeds the RAM: the full mode will fail" if peak > ram else "fits"
    print(f"  {n:>4} sequences: {gb(kept)} kept, ~{gb(peak)} during the last torch.cat ({verdict})")
EOF

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== memtune eval ($threads threads)"
eval_args=(eval --model_name_or_path "$model" --tokenizer "$tokenizer" --eval_file "$data"
  --metrics eval_loss,token_accuracy --per_device_eval_batch_size "$batch" --max_length "$seq" --json)
if [[ -x /usr/bin/time ]]; then
  OMP_NUM_THREADS=$threads /usr/bin/time -v -o "$work/time.txt" "$memtune" "${eval_args[@]}" > "$work/memtune.json"
  mt="$(/usr/bin/python3 - "$work/time.txt" "$work/memtune.json" <<'EOF'
import json, sys
fields = dict(line.strip().rsplit(": ", 1) for line in open(sys.argv[1]) if ": " in line)
seconds = 0.0
for part in fields["Elapsed (wall clock) time (h:mm:ss or m:ss)"].split(":"):
    seconds = seconds * 60 + float(part)
result = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
print(json.dumps({"seconds": seconds,
                  "peak_rss_bytes": int(fields["Maximum resident set size (kbytes)"]) * 1024,
                  "result": result}))
EOF
)"
else
  # No /usr/bin/time (Debian package `time`): wall time and the child's peak RSS from Python.
  mt="$(OMP_NUM_THREADS=$threads /usr/bin/python3 - "$memtune" "${eval_args[@]}" <<'EOF'
import json, resource, subprocess, sys, time
start = time.perf_counter()
run = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, text=True)
seconds = time.perf_counter() - start
if run.returncode:
    sys.exit(f"bench-eval: memtune eval exited with status {run.returncode}")
print(json.dumps({"seconds": seconds,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "result": json.loads(run.stdout.strip().splitlines()[-1])}))
EOF
)"
fi
echo "$mt"

results=("$mt")
for mode in full argmax; do
  echo "== PyTorch eager reference, Trainer-style evaluation, --mode $mode ($threads threads)"
  if /usr/bin/python3 "$root/tools/qwen2_reference.py" eval-bench --model "$model" --batch "$batch" \
      --seq "$seq" --num_sequences "$num" --threads "$threads" --mode "$mode" \
      > "$work/$mode.out" 2> "$work/$mode.err"; then
    pt="$(tail -n 1 "$work/$mode.out")"
  else
    rc=$?
    cat "$work/$mode.err" >&2
    why="$(grep -v '^[[:space:]]*$' "$work/$mode.err" | tail -n 1 | cut -c1-200 || true)"
    if (( rc > 128 )); then
      why="killed by signal $((rc - 128))${why:+; $why} (SIGKILL: most likely the kernel's out-of-memory killer)"
    fi
    pt="$(/usr/bin/python3 -c 'import json, sys; print(json.dumps({"mode": sys.argv[1], "failed": sys.argv[2]}))' \
      "$mode" "exit status $rc: ${why:-no message}")"
  fi
  echo "$pt"
  results+=("$pt")
done

/usr/bin/python3 - "$num" "${results[@]}" <<'EOF'
import json, sys
num = int(sys.argv[1])
mt, full, argmax = (json.loads(a) for a in sys.argv[2:5])
mib = lambda b: f"{b / 2**20:.0f} MiB"
r = mt["result"]
print(f"\n{'path':<16} {'seconds':>9} {'seq/s':>8} {'peak RSS':>10} {'eval_loss':>10} {'token_acc':>10}")
print(f"{'memtune eval':<16} {mt['seconds']:>9.2f} {num / mt['seconds']:>8.2f} "
      f"{mib(mt['peak_rss_bytes']):>10} {r['eval_loss']:>10.4f} {r['token_accuracy']:>10.4f}")
for name, pt in (("PyTorch full", full), ("PyTorch argmax", argmax)):
    if "failed" in pt:
        print(f"{name:<16} failed: {pt['failed']}")
    else:
        print(f"{name:<16} {pt['seconds']:>9.2f} {pt['sequences_per_s']:>8.2f} "
              f"{mib(pt['peak_rss_bytes']):>10} {pt['eval_loss']:>10.4f} {pt['token_accuracy']:>10.4f}")
print()
for name, pt, mem_target in (("full", full, 1 / 20), ("argmax", argmax, 1 / 5)):
    if "failed" in pt:
        print(f"memtune/{name}: n/a (the {name} mode failed)")
        continue
    mem = mt["peak_rss_bytes"] / pt["peak_rss_bytes"]
    time_ratio = mt["seconds"] / pt["seconds"]
    print(f"memtune/{name:<6}  memory {mem:.3f}x (target <= {mem_target:.3f}x = 1/{round(1 / mem_target)}: "
          f"{'met' if mem <= mem_target else 'MISSED'})   time {time_ratio:.3f}x (target < 1x, faster: "
          f"{'met' if time_ratio < 1 else 'MISSED'})")
print(f"memtune: {r['eval_examples']} examples, {r['eval_tokens']} target tokens, whole-process time and "
      f"RSS (arena {mib(r['arena_bytes'])}); PyTorch: {num} x 512 random tokens, "
      f"time of the evaluation loop and compute_metrics only")
EOF
