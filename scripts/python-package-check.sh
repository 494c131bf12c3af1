#!/usr/bin/env bash
# Proves the Python package as a user installs it: a fresh virtual environment (Debian's python3),
# `pip install .` from this repository (the build tools pinned in pyproject.toml, from PyPI; numpy
# and tqdm pinned here), then the README's first Python example (examples/python/trainer.py) on
# the demo's model shape, checking that its evaluation printed the user's metric.
#
#   scripts/python-package-check.sh
#
# The package's CMake build directory is build-pip/ in the clone, so a second run compiles only what
# changed, and its compiles go through ccache as scripts/build.sh's do (scripts/ccache-launcher.sh):
# the same flags and the same paths relative to the build directory, so after a release build the
# package's layers come from the cache. The virtual environment is made anew every time.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build_dir="$root/build-pip"
launcher="$("$root/scripts/ccache-launcher.sh")"
settings=("--config-settings=build-dir=$build_dir")
# (The compilers CMake itself picks, where the build backend would take Python's: ccache tells
# compilers apart by the name they are called by.)
[[ -z "$launcher" ]] || settings+=("--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=$launcher"
                                   "--config-settings=cmake.define.CMAKE_C_COMPILER_LAUNCHER=$launcher"
                                   "--config-settings=cmake.define.CMAKE_CXX_COMPILER=$(command -v "${CXX:-c++}")"
                                   "--config-settings=cmake.define.CMAKE_C_COMPILER=$(command -v "${CC:-cc}")")
work="$(mktemp -d -t memtune-python-package.XXXXXX)"
trap 'rm -rf "$work"' EXIT
tokenizer="${MEMTUNE_TOKENIZER_DIR:-}"
[[ -n "$tokenizer" ]] || tokenizer="$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)"

/usr/bin/python3 -m venv "$work/venv"
py="$work/venv/bin/python3"
"$py" -m pip install --quiet --disable-pip-version-check --only-binary=:all: numpy==2.2.5 tqdm==4.70.1
echo "python-package-check: pip install . (build directory $build_dir)"
start=$SECONDS
"$py" -m pip install --quiet --disable-pip-version-check "$root" "${settings[@]}"
echo "python-package-check: installed in $((SECONDS - start)) s"
"$py" -c 'import memtune; print("import memtune:", memtune.__file__)'

"$root/scripts/demo-model.sh" "$work/venv/bin/memtune" "$tokenizer" "$work/model" > /dev/null
(cd "$work" && "$py" "$root/examples/python/trainer.py" "$work/model" "$work/out") > "$work/example.log" 2>&1 || {
  cat "$work/example.log" >&2
  echo "python-package-check: examples/python/trainer.py failed" >&2
  exit 1
}
last="$(tail -n 1 "$work/example.log")"
echo "python-package-check: examples/python/trainer.py -> $last"
"$py" - "$last" <<'PY'
import ast, math, sys
metrics = ast.literal_eval(sys.argv[1])
assert 0 <= metrics["eval_token_accuracy"] <= 1, metrics
assert math.isfinite(metrics["eval_loss"]), metrics
PY
