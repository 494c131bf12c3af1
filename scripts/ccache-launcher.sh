#!/usr/bin/env bash
# Prints the compiler launcher (a CMake list) that puts a build of this clone through ccache, or
# nothing where ccache is missing or MEMTUNE_CCACHE=0. scripts/build.sh and
# scripts/python-package-check.sh give it to CMake (CMAKE_<LANG>_COMPILER_LAUNCHER), so a second
# build of the same sources (the next CI run on a clean clone, a build tree made anew, the Python
# package beside the release build) takes its objects from the cache.
#   - The cache is ~/.cache/memtune/ccache-<key>, where the key hashes what the compiler makes of
#     -march=native on this CPU: ccache hashes that flag as written, so a cache carried to another
#     CPU would otherwise hand back objects with the first CPU's instructions.
#   - Paths under the clone are hashed relative to the build directory (CCACHE_BASEDIR), so clones
#     at different paths share their objects.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[[ "${MEMTUNE_CCACHE:-1}" != 0 ]] && command -v ccache > /dev/null || exit 0
key="$(c++ -march=native -Q --help=target 2> /dev/null | sha256sum | cut -c1-12)"
echo "env;CCACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/memtune/ccache-$key;CCACHE_BASEDIR=$root;ccache"
