#!/usr/bin/env bash
# Benchmark of evaluation memory and time: `memtune eval` (streaming metrics, logits never kept)
# against the eager PyTorch reference evaluated the way Hugging Face Trainer's evaluation loop
# runs with a custom compute_metrics (tools/qwen2_reference.py eval-bench), and against Hugging
# Face Trainer.evaluate itself at three eval-set sizes, in one run, on the ~30M-parameter
# Qwen2-shaped model of scripts/bench.sh (real Qwen2.5 vocabulary 151936), batch 4 x up to 512
# tokens:
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
# Growth with the eval set: at each of SIZES (default 8,16,24 sequences) `memtune eval` and
# Trainer.evaluate (bench/hf_trainer_bench.py eval, in the pinned environment of
# scripts/prepare-hf-env.sh; modes full and argmax as above, batch (batch_eval_metrics=True),
# written with transformers' own Trainer, compute_metrics taking the argmax for token accuracy,
# and memtune: memtune.Trainer from build/python with the argmax mode's two functions) run on the same text (the first
# SIZE examples of the same generator; each size at least one batch), each in its own process; the
# script prints every peak RSS and the growth per added sequence. Trainer's seconds are
# Trainer.evaluate's, its peak the process's (getrusage).
# Usage: scripts/bench-eval.sh [num_sequences=24] [sizes=8,16,24]
#   (24 keeps the full mode's peak, ~2 x 24 x 311 MB = ~15 GB, within a 24 GB machine; a larger
#   NUM or size whose projection exceeds the RAM is still run, and the full mode is reported as
#   failed)
# MEMTUNE_BENCH_BIN=PATH uses that memtune binary instead of building build/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
num="${1:-24}"
if ! [[ "$num" =~ ^[1-9][0-9]*$ ]]; then
  echo "bench-eval: num_sequences must be a positive integer, got '$num'" >&2
  exit 1
fi
sizes_arg="${2:-8,16,24}"
IFS=, read -r -a sizes <<< "$sizes_arg"
for n in "${sizes[@]}"; do
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
    echo "bench-eval: sizes must be two or more increasing positive integers separated by commas, got '$sizes_arg'" >&2
    exit 1
  fi
done
batch=4 seq=512
increasing=1
for ((i = 1; i < ${#sizes[@]}; ++i)); do
  (( sizes[i - 1] < sizes[i] )) || increasing=0
done
if (( ${#sizes[@]} < 2 || ! increasing )); then
  echo "bench-eval: sizes must be two or more increasing positive integers separated by commas, got '$sizes_arg'" >&2
  exit 1
fi
# Below one batch, a larger set is a larger batch: its peak grows with the batch, not the set.
if (( sizes[0] < batch )); then
  echo "bench-eval: sizes must be at least the batch size ($batch), got '$sizes_arg'" >&2
  exit 1
fi
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
/usr/bin/python3 - "$model/config.json" "$num" "$seq" "${sizes[@]}" <<'EOF'
import json, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
num, seq, sizes = int(sys.argv[2]), int(sys.argv[3]), [int(a) for a in sys.argv[4:]]
ram = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
per_seq = seq * vocab * 4
gb = lambda b: f"{b / 1e9:.1f} GB"
print(f"full-mode logits: {seq} x {vocab} x 4 bytes = {per_seq / 1e6:.0f} MB per sequence, "
      f"growing with the eval set; this machine has {gb(ram)} of RAM")
for n in sorted(dict.fromkeys((num, *sizes, 200))):
    kept, peak = n * per_seq, 2 * n * per_seq
    verdict = "exceeds the RAM: the full mode will fail" if peak > ram else "fits"
    print(f"  {n:>4} sequences: {gb(kept)} kept, ~{gb(peak)} during the last torch.cat ({verdict})")
EOF

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# memtune_eval DATA: one `memtune eval` process on DATA; prints its JSON (seconds, peak RSS, result).
memtune_eval() {
  local eval_args=(eval --model_name_or_path "$model" --tokenizer "$tokenizer" --eval_file "$1"
    --metrics eval_loss,token_accuracy --per_device_eval_batch_size "$batch" --max_length "$seq" --json)
  if [[ -x /usr/bin/time ]]; then
    # (errexit does not reach into the command substitutions that call this: fail explicitly)
    OMP_NUM_THREADS=$threads /usr/bin/time -v -o "$work/time.txt" "$memtune" "${eval_args[@]}" > "$work/memtune.json" \
      || { echo "bench-eval: memtune eval on $1 failed" >&2; return 1; }
    /usr/bin/python3 - "$work/time.txt" "$work/memtune.json" <<'EOF'
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
  else
    # No /usr/bin/time (Debian package `time`): wall time and the child's peak RSS from Python.
    OMP_NUM_THREADS=$threads /usr/bin/python3 - "$memtune" "${eval_args[@]}" <<'EOF'
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
  fi
}

# measured MODE COMMAND...: runs a Python evaluation that prints a JSON line last; prints that
# line, or {"mode": MODE, "failed": why} when it fails (the full mode's logits may not fit).
measured() {
  local mode="$1" rc=0 why
  shift
  "$@" > "$work/run.out" 2> "$work/run.err" || rc=$?
  if (( rc == 0 )); then
    tail -n 1 "$work/run.out"
    return
  fi
  cat "$work/run.err" >&2
  why="$(grep -v '^[[:space:]]*$' "$work/run.err" | tail -n 1 | cut -c1-200 || true)"
  if (( rc > 128 )); then
    why="killed by signal $((rc - 128))${why:+; $why} (SIGKILL: most likely the kernel's out-of-memory killer)"
  fi
  /usr/bin/python3 -c 'import json, sys; print(json.dumps({"mode": sys.argv[1], "failed": sys.argv[2]}))' \
    "$mode" "exit status $rc: ${why:-no message}"
}

echo "== memtune eval ($threads threads)"
mt="$(memtune_eval "$data")"
echo "$mt"

results=("$mt")
for mode in full argmax; do
  echo "== PyTorch eager reference, Trainer-style evaluation, --mode $mode ($threads threads)"
  pt="$(measured "$mode" /usr/bin/python3 "$root/tools/qwen2_reference.py" eval-bench --model "$model" \
    --batch "$batch" --seq "$seq" --num_sequences "$num" --threads "$threads" --mode "$mode")"
  echo "$pt"
  results+=("$pt")
done

# Growth with the eval set: memtune eval and Trainer.evaluate on the first SIZE examples.
hf_python="$("$root/scripts/prepare-hf-env.sh" | tail -n 1)"
growth=()
for n in "${sizes[@]}"; do
  # The first SIZE examples of eval-text.jsonl's generator (seed 1), made once.
  sized="$root/out/bench/eval-text-$n.jsonl"
  if [[ ! -f "$sized" ]] || [[ "$(wc -l < "$sized")" -ne "$n" ]]; then
    /usr/bin/python3 "$root/tools/make_bench_text.py" "$sized.tmp" "$n" 1
    mv "$sized.tmp" "$sized"
  fi
  echo "== memtune eval, $n sequences ($threads threads)"
  g_mt="$(memtune_eval "$sized")"
  echo "$g_mt"
  growth+=("$n" "$g_mt")
  for mode in full argmax batch memtune; do
    echo "== Trainer.evaluate, $n sequences, --mode $mode ($threads threads)"
    hf="$(PYTHONPATH="$(dirname "$memtune")/python" OMP_NUM_THREADS=$threads measured "$mode" "$hf_python" \
      "$root/bench/hf_trainer_bench.py" eval \
      --model "$model" --tokenizer "$tokenizer" --memtune "$memtune" --data "$sized" --num_sequences "$n" \
      --seq "$seq" --mode "$mode")"
    echo "$hf"
    growth+=("$hf")
  done
done

/usr/bin/python3 - "$root" "$num" "$batch" "$seq" "${results[@]}" "${growth[@]}" <<'EOF'
import json, subprocess, sys
root, num, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mt, full, argmax = (json.loads(a) for a in sys.argv[5:8])
rest = sys.argv[8:]  # per size: SIZE, memtune eval, Trainer full, argmax, batch, memtune.Trainer
growth = [(int(rest[i]), *(json.loads(a) for a in rest[i + 1:i + 6])) for i in range(0, len(rest), 6)]
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

# Growth with the eval set: Trainer.evaluate against memtune eval, same text, same sizes.
hf = next((h for _, _, *modes in growth for h in modes if "failed" not in h), None)
versions = ", ".join(f"{k} {hf[k]}" for k in ("transformers", "peft", "torch")) if hf else "no run completed"
print(f"\nGrowth with the eval set: memtune eval against Hugging Face Trainer.evaluate ({versions}), "
      f"the same text, batch {batch}")
print(f"{'sequences':>9} {'memtune RSS':>12} {'seconds':>8} {'Trainer full RSS':>17} {'seconds':>8} "
      f"{'Trainer argmax RSS':>19} {'seconds':>8} {'Trainer batch RSS':>18} {'seconds':>8} "
      f"{'memtune.Trainer RSS':>20} {'seconds':>8} {'accuracy (argmax, memtune.Trainer)':>35}")
cell = lambda r, w: (f"{mib(r['peak_rss_bytes']):>{w}} {r['seconds']:>8.2f}" if "failed" not in r
                     else f"{'failed':>{w}} {'-':>8}")
accuracy = lambda r: f"{r['token_accuracy']:.6f}" if "failed" not in r else "-"
for n, g_mt, g_full, g_argmax, g_batch, g_py in growth:
    print(f"{n:>9} {cell(g_mt, 12)} {cell(g_full, 17)} {cell(g_argmax, 19)} {cell(g_batch, 18)} {cell(g_py, 20)} "
          f"{accuracy(g_argmax) + ', ' + accuracy(g_py):>35}")
for n, g_mt, *modes in growth:
    for name, r in zip(("full", "argmax", "batch", "memtune.Trainer"), modes):
        if "failed" in r:
            print(f"{name} at {n} sequences failed: {r['failed']}")

flat_limit = 2**20  # bytes per added sequence; one sequence's ids and labels are ~4 KB, its logits ~311 MB


def slopes(col):
    """Peak RSS growth in bytes per added sequence: between consecutive sizes, and first to last."""
    points = [(n, row[col]) for n, *row in growth]
    if any("failed" in r for _, r in points):
        return None
    steps = [(b[1]["peak_rss_bytes"] - a[1]["peak_rss_bytes"]) / (b[0] - a[0]) for a, b in zip(points, points[1:])]
    overall = (points[-1][1]["peak_rss_bytes"] - points[0][1]["peak_rss_bytes"]) / (points[-1][0] - points[0][0])
    return steps, overall


summary = {}
sizes_text = " -> ".join(str(n) for n, *_ in growth)
print(f"\npeak RSS growth per added sequence ({sizes_text} sequences; flat: under {mib(flat_limit)} per sequence):")
for name, col in (("memtune eval", 0), ("Trainer full", 1), ("Trainer argmax", 2), ("Trainer batch", 3),
                  ("memtune.Trainer", 4)):
    g = slopes(col)
    if g is None:
        print(f"  {name:<15} n/a (a run failed)")
        summary[name] = None
        continue
    steps, overall = g
    summary[name] = overall
    each = ", ".join(f"{s / 2**20:+.1f}" for s in steps)
    print(f"  {name:<15} {overall / 2**20:+9.1f} MiB per sequence (between sizes: {each} MiB) -> "
          f"{'flat' if abs(overall) < flat_limit else 'grows'}")
m, f = summary["memtune eval"], summary["Trainer full"]
if m is not None and f is not None:
    holds = abs(m) < flat_limit <= f
    print(f"Trainer's peak grows with the eval set while memtune's stays flat: {'yes' if holds else 'NO'} "
          f"(Trainer full {f / 2**20:+.1f} MiB per sequence, memtune {m / 2**20:+.3f} MiB per sequence)")
p = summary["memtune.Trainer"]
if p is not None:
    print(f"memtune.Trainer with the user's compute_metrics and preprocess_logits_for_metrics unchanged: "
          f"{p / 2**20:+.3f} MiB per sequence -> {'flat' if abs(p) < flat_limit else 'grows'}")

rows = [{"run": f"eval {num} x ~510 tokens", "num_sequences": num, "memtune": mt,
         "reference": {"full": full, "argmax": argmax}}]
for n, g_mt, g_full, g_argmax, g_batch, g_py in growth:
    rows.append({"run": f"eval {n} x ~510 tokens, Trainer.evaluate", "num_sequences": n, "memtune": g_mt,
                 "hf_trainer": {"full": g_full, "argmax": g_argmax, "batch": g_batch},
                 "memtune_trainer": g_py})
rows.append({"run": f"peak RSS growth per added sequence, {sizes_text}",
             "growth_bytes_per_sequence": {"memtune": summary["memtune eval"],
                                           "hf_trainer_full": summary["Trainer full"],
                                           "hf_trainer_argmax": summary["Trainer argmax"],
                                           "hf_trainer_batch": summary["Trainer batch"],
                                           "memtune_trainer": summary["memtune.Trainer"]}})
settings = {"batch": batch, "max_length": seq, "num_sequences": num, "sizes": [n for n, *_ in growth]}
if hf:
    settings["hf_trainer"] = {k: hf[k] for k in ("transformers", "peft", "torch")}
subprocess.run(["/usr/bin/python3", f"{root}/scripts/bench_results.py", "record", "eval", json.dumps(settings),
                json.dumps(rows)], check=True)
EOF
