#!/usr/bin/env bash
# Fuzzes every reader of user input with libFuzzer: builds the harnesses of fuzz/ with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer into build-fuzz/, then runs each target for
# SECONDS (default 240) from its seed corpus (tests/fuzz-seeds/<target>/) plus what earlier runs
# found (build-fuzz/corpus/<target>/). Prints executions and findings per target; a finding (a
# crash, sanitizer report, leak, timeout or out-of-memory) is saved under build-fuzz/findings/
# and makes the script exit non-zero.
# Usage: scripts/fuzz.sh [seconds_per_target] [target...]   (targets: the names of fuzz/*.cpp)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-240}"
shift || true
dir="${MEMTUNE_FUZZ_BUILD_DIR:-$root/build-fuzz}"
command -v clang++ > /dev/null || { echo "clang++ not found: run scripts/install-deps.sh"; exit 1; }
# The tokenizer, dataset and chat-template targets use the real Qwen2.5 tokenizer.
if [[ -z "${MEMTUNE_TOKENIZER_DIR:-}" ]]; then
  MEMTUNE_TOKENIZER_DIR="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"
fi
export MEMTUNE_TOKENIZER_DIR

targets=("$@")
if ((${#targets[@]} == 0)); then
  for f in "$root"/fuzz/*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi

# -O1 with line tables: fast enough to fuzz, quick to build, and findings come with file:line.
MEMTUNE_BUILD_TARGETS="${targets[*]/#/fuzz_}" "$root/scripts/build.sh" "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DMEMTUNE_FUZZ=ON

export OMP_NUM_THREADS=1
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
failed=()
printf '%-22s %12s %8s %9s  %s\n' target executions corpus findings result
for t in "${targets[@]}"; do
  corpus="$dir/corpus/$t" findings="$dir/findings/$t" log="$dir/logs/$t.log"
  mkdir -p "$corpus" "$findings" "$(dirname "$log")"
  status=0
  "$dir/fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=30 -print_final_stats=1 \
    -artifact_prefix="$findings/" "$corpus" "$root/tests/fuzz-seeds/$t" > "$log" 2>&1 || status=$?
  executions="$(grep -ao 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -n 1)"
  # crash-, leak-, timeout- and oom- inputs; slow-unit- inputs (over 10 s, e.g. on a loaded
  # machine) are kept but not counted.
  found="$(find "$findings" -type f ! -name 'slow-unit-*' | wc -l)"
  result=ok
  if ((status != 0)); then
    result="FAILED (exit $status, see $log)"
    failed+=("$t")
  fi
  printf '%-22s %12s %8s %9s  %s\n' "$t" "${executions:-?}" "$(find "$corpus" -type f | wc -l)" "$found" "$result"
done
if ((${#failed[@]})); then
  echo "fuzzing found problems in: ${failed[*]} (inputs under $dir/findings/)"
  exit 1
fi
