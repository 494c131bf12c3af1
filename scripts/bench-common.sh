# Shared setup of the benchmark scripts (sourced, not run): sets `root`, `memtune` (built here
# unless MEMTUNE_BENCH_BIN names a binary), `tokenizer` (the real Qwen2.5 tokenizer directory)
# and `model`: the ~30M-parameter Qwen2-shaped model with the real vocabulary (151936), hidden 192,
# 4 layers, 3 query heads / 1 KV head, created once in out/bench/qwen2-30m.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
memtune="${MEMTUNE_BENCH_BIN:-}"
if [[ -z "$memtune" ]]; then
  "$root/scripts/install-deps.sh"
  "$root/scripts/build.sh" "$root/build" > /dev/null
  memtune="$root/build/memtune"
fi
tokenizer="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"
model="$root/out/bench/qwen2-30m"
if [[ ! -f "$model/model.safetensors" ]]; then
  "$memtune" init-model --preset tiny --out "$model" --seed 1 \
    --set vocab_size=151936 --set hidden_size=192 --set intermediate_size=512 \
    --set num_hidden_layers=4 --set num_attention_heads=3 --set num_key_value_heads=1
fi
