#!/usr/bin/env bash
# Configures and builds one build tree. Usage: scripts/build.sh [build-dir] [extra cmake args...]
#   MEMTUNE_BUILD_TARGETS="a b"  build only these targets (default: all)
#   MEMTUNE_BUILD_JOBS=N         parallel jobs (default: nproc)
# Progress goes to stdout; a failure goes to stderr as well (cmake's log, or the build's failed
# commands with the compiler's messages), so a caller that silences stdout still shows why.
#
# Compiles go through ccache where it is installed (scripts/ccache-launcher.sh says how and where).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/build}"
shift || true
mkdir -p "$(dirname "$dir")"
launcher="$("$root/scripts/ccache-launcher.sh")"
if [[ -n "$launcher" ]]; then
  launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher" "-DCMAKE_C_COMPILER_LAUNCHER=$launcher")
else
  launcher=(-UCMAKE_CXX_COMPILER_LAUNCHER -UCMAKE_C_COMPILER_LAUNCHER)
fi
if ! cmake -S "$root" -B "$dir" -G Ninja "${launcher[@]}" "$@" > "$dir.cmake.log" 2>&1; then
  echo "build.sh: configuring $dir failed; cmake said ($dir.cmake.log):" >&2
  cat "$dir.cmake.log" >&2
  exit 1
fi
status=0
targets=()
for t in ${MEMTUNE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$dir" -j "${MEMTUNE_BUILD_JOBS:-$(nproc)}" "${targets[@]}" 2>&1 | tee "$dir.build.log" || status=$?
if ((status != 0)); then
  # Ninja prints each failed command as "FAILED: ..." followed by the compiler's messages.
  echo "build.sh: building $dir failed (exit status $status); the failed steps ($dir.build.log):" >&2
  sed -n '/^FAILED: /,$p' "$dir.build.log" | head -n 200 >&2
  exit "$status"
fi
