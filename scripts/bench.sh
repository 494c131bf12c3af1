#!/usr/bin/env bash
# Benchmark of one training step (forward + loss + backward) on a ~30M-parameter Qwen2-shaped
# model with the real Qwen2.5 vocabulary (151936), sequence length 512: memtune against the GEMM
# ceiling and against the eager PyTorch reference on the same checkpoint and batch, in one run.
# Writes bench/results/step-*.json (scripts/bench_results.py tables turns them into the tables).
# Usage: scripts/bench.sh [batch=4] [seq=512] [steps=3]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
batch="${1:-4}" seq="${2:-512}" steps="${3:-3}"
unset MEMTUNE_BENCH_BIN  # bench_step comes from the build tree
source "$(dirname "$0")/bench-common.sh"
threads="$(nproc)"
echo "== memtune ($threads threads)"
mt="$(OMP_NUM_THREADS=$threads "$root/build/bench_step" --model "$model" --batch "$batch" --seq "$seq" --steps "$steps" | tee /dev/stderr | tail -1)"
echo "== PyTorch eager reference ($threads threads)"
pt="$(/usr/bin/python3 "$root/tools/qwen2_reference.py" bench --model "$model" --batch "$batch" --seq "$seq" --steps "$((steps + 1))" --threads "$threads" | tail -1)"
echo "$pt"
/usr/bin/python3 - "$mt" "$pt" "$batch" "$seq" "$steps" "$root" <<'PY'
import json, subprocess, sys
mt, pt = json.loads(sys.argv[1]), json.loads(sys.argv[2])
batch, seq, steps, root = sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
row = {"run": f"one step, {batch} x {seq} tokens", "memtune": mt, "reference": pt}
subprocess.run(["/usr/bin/python3", f"{root}/scripts/bench_results.py", "record", "step",
                json.dumps({"batch": int(batch), "seq": int(seq), "steps": int(steps)}), json.dumps([row])], check=True)
speed = mt["tokens_per_s"] / pt["tokens_per_s"]
mem = mt["peak_rss_bytes"] / pt["peak_rss_bytes"]
eff = mt["gflops"] / mt["gemm_ceiling_gflops"]
print(f"\nmemtune {mt['tokens_per_s']:.0f} tokens/s vs PyTorch {pt['tokens_per_s']:.0f} tokens/s: {speed:.2f}x (target >= 1.5x)")
print(f"peak RSS memtune {mt['peak_rss_bytes']/2**20:.0f} MiB vs PyTorch {pt['peak_rss_bytes']/2**20:.0f} MiB: {mem:.3f}x (target <= 0.25x)")
print(f"achieved {mt['gflops']:.1f} GFLOP/s = {100*eff:.0f}% of the GEMM ceiling {mt['gemm_ceiling_gflops']:.1f} (target >= 60%)")
PY
