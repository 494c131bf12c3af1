#!/usr/bin/env bash
# The end-to-end example: create a small Qwen2-architecture model with the real Qwen2.5
# vocabulary, compute loss and every gradient for a packed batch inside a planned arena, and
# check the numbers against the independent PyTorch reference on the same checkpoint.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" "$root/build" > /dev/null
memtune="$root/build/memtune"
out="$root/out/demo"
mkdir -p "$out"

echo "== 1. a 30M-parameter Qwen2 with the Qwen2.5 vocabulary (151936 tokens), bfloat16 storage"
if [[ ! -f "$out/model/model.safetensors" ]]; then
  "$memtune" init-model --preset tiny --out "$out/model" --seed 7 --torch_dtype bfloat16 \
    --set vocab_size=151936 --set hidden_size=192 --set intermediate_size=512 \
    --set num_hidden_layers=4 --set num_attention_heads=3 --set num_key_value_heads=1
fi

echo "== 2. loss and gradients of 3 x 96 tokens (prompt tokens masked with -100)"
/usr/bin/python3 - "$out/batch.json" <<'PY'
import json, random, sys
rng = random.Random(0)
ids = [[rng.randrange(151936) for _ in range(96)] for _ in range(3)]
labels = [[-100 if t < 32 else x for t, x in enumerate(row)] for row in ids]
json.dump({"input_ids": ids, "labels": labels}, open(sys.argv[1], "w"))
PY
"$memtune" dump --model "$out/model" --input "$out/batch.json" --out "$out/memtune.safetensors" \
  --gradient_checkpointing --loss_workspace_bytes 8388608

echo "== 3. the same with the PyTorch reference (tools/qwen2_reference.py), and the differences"
/usr/bin/python3 "$root/tools/qwen2_reference.py" dump --model "$out/model" --input "$out/batch.json" \
  --out "$out/reference.safetensors"
/usr/bin/python3 - "$root/tools" "$out/memtune.safetensors" "$out/reference.safetensors" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import qwen2_reference as ref
got, want = ref.read_safetensors(sys.argv[2]), ref.read_safetensors(sys.argv[3])
worst = max(((got[k] - want[k]).abs().max().item() / max(want[k].abs().max().item(), 1e-30), k) for k in want)
print(f"loss memtune {got['loss'].item():.6f}  reference {want['loss'].item():.6f}")
print(f"{len(want)} tensors compared; largest error relative to the tensor's scale: {worst[0]:.2e} ({worst[1]})")
assert set(got) == set(want) and worst[0] < 1e-4, "memtune and the reference disagree"
PY
echo "demo finished: outputs in $out"
