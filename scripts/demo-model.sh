#!/usr/bin/env bash
# The demo's model: a 20M-parameter Qwen2 with the real Qwen2.5 vocabulary (151936) and the real
# tokenizer's files, created once. Usage: scripts/demo-model.sh MEMTUNE TOKENIZER_DIR OUT_DIR
set -euo pipefail
memtune="$1" tokenizer="$2" model="$3"
if [[ ! -f "$model/model.safetensors" ]]; then
  "$memtune" init-model --preset tiny --out "$model" --seed 7 \
    --set vocab_size=151936 --set hidden_size=128 --set intermediate_size=384 \
    --set num_hidden_layers=4 --set num_attention_heads=4 --set num_key_value_heads=2
fi
cp "$tokenizer/tokenizer.json" "$tokenizer/tokenizer_config.json" "$model/"
