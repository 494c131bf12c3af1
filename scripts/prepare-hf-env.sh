#!/usr/bin/env bash
# Installs the pinned Python environment of the Hugging Face oracles and anchors
# (tools/hf-oracle/requirements.txt: torch, transformers, PEFT, tokenizers, tensorboard, ...) from
# PyPI into a virtual environment outside the clone, with the Python package's build tools and
# pytest (tools/hf-oracle/requirements-python-package.txt), and prints its python3 on the last line.
#
#   scripts/prepare-hf-env.sh            # install if needed; print the interpreter
#
# The environment lives in ${MEMTUNE_HF_ENV:-~/.cache/memtune/hf-env-<hash of the requirements>}:
# a second run (or a second clone) with the same requirements downloads nothing and takes a
# second. Its marker file is written only after every package imports, so an interrupted install
# is never taken for a finished one (the next run starts it over). Debian's python3 (3.11) and its
# venv module make it (scripts/install-deps.sh installs them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
requirements="$root/tools/hf-oracle/requirements.txt"
hash="$(sha256sum "$requirements" | cut -c1-12)"
env_dir="${MEMTUNE_HF_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/memtune/hf-env-$hash}"
check='import torch, transformers, peft, tokenizers, safetensors, accelerate, tensorboard, numpy, optimum, auto_gptq, gguf'

if [[ ! -f "$env_dir/.memtune-complete" ]]; then
  echo "prepare-hf-env: installing tools/hf-oracle/requirements.txt into $env_dir (about 3 GB from PyPI)" >&2
  mkdir -p "$(dirname "$env_dir")"
  if [[ -e "$env_dir" && ! -f "$env_dir/pyvenv.cfg" ]]; then
    echo "prepare-hf-env: $env_dir exists and is not a virtual environment; not touching it" >&2
    exit 1
  fi
  rm -rf "$env_dir"  # an interrupted install (no marker) starts over
  /usr/bin/python3 -m venv "$env_dir"
  # Wheels only (nothing is compiled); no pip cache: the environment itself is the cache.
  "$env_dir/bin/python3" -m pip install --quiet --no-cache-dir --only-binary=:all: --disable-pip-version-check \
    -r "$requirements" >&2
  "$env_dir/bin/python3" -c "$check"
  touch "$env_dir/.memtune-complete"
fi
# The Python package's build tools and pytest, on top (their own marker, named by their file's hash).
package_requirements="$root/tools/hf-oracle/requirements-python-package.txt"
package_marker="$env_dir/.memtune-python-package-$(sha256sum "$package_requirements" | cut -c1-12)"
if [[ ! -f "$package_marker" ]]; then
  echo "prepare-hf-env: installing tools/hf-oracle/requirements-python-package.txt into $env_dir" >&2
  "$env_dir/bin/python3" -m pip install --quiet --no-cache-dir --only-binary=:all: --disable-pip-version-check \
    -r "$package_requirements" >&2
  "$env_dir/bin/python3" -c 'import pybind11, scikit_build_core, pytest'
  touch "$package_marker"
fi
echo "$env_dir/bin/python3"
