#!/usr/bin/env bash
# Tokenizer throughput with the real Qwen2.5 tokenizer: memtune's bench_tokenizer (one thread and
# all threads) against the JavaScript reference (@lenml/tokenizers on Node.js, one thread) on the
# same mixed corpus of a few MB (tools/make_tokenizer_corpus.py --size-mb). Both also report
# their token count, which must agree. Target: >= 10x the reference on one thread.
# Usage: scripts/bench-tokenizer.sh [size_mb=4]
# MEMTUNE_BENCH_TOKENIZER=PATH uses that bench_tokenizer binary instead of building build/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
size="${1:-4}"
tokenizer="$("$root/scripts/prepare-tokenizer.sh" | tail -1)"
bin="${MEMTUNE_BENCH_TOKENIZER:-}"
if [[ -z "$bin" ]]; then
  "$root/scripts/install-deps.sh"
  "$root/scripts/build.sh" "$root/build" > /dev/null
  bin="$root/build/bench_tokenizer"
fi
corpus="$root/out/bench/tokenizer-corpus-${size}mb.jsonl"
if [[ ! -f "$corpus" ]]; then
  mkdir -p "$(dirname "$corpus")"
  python3 "$root/tools/make_tokenizer_corpus.py" --size-mb "$size" --out "$corpus.tmp"
  mv "$corpus.tmp" "$corpus"
fi
threads="$(nproc)"

echo "== memtune (1 and $threads threads)"
# Passive waiting keeps idle OpenMP threads from spinning on the cores the others need.
mt="$(OMP_WAIT_POLICY=PASSIVE "$bin" --tokenizer "$tokenizer" --corpus "$corpus" --threads "$threads" | tee /dev/stderr | tail -1)"
echo "== reference: @lenml/tokenizers on Node.js $(node --version) (1 thread)"
js="$(node "$root/tools/tokenizer-reference/encode.mjs" --tokenizer "$tokenizer" --input "$corpus" --bench)"
echo "$js"
python3 - "$mt" "$js" <<'PY'
import json, sys
mt, js = json.loads(sys.argv[1]), json.loads(sys.argv[2])
if mt["tokens"] != js["tokens"]:
    sys.exit(f"token counts differ: memtune {mt['tokens']}, reference {js['tokens']}")
ratio = mt["mb_per_s_1_thread"] / js["mb_per_s"]
print(f"\nmemtune {mt['mb_per_s_1_thread']:.1f} MB/s on 1 thread ({mt['mb_per_s_all_threads']:.1f} MB/s on "
      f"{mt['threads']}) vs reference {js['mb_per_s']:.2f} MB/s: {ratio:.1f}x on one thread (target >= 10x)")
PY
