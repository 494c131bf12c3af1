#!/usr/bin/env bash
# A Debian sid root for the vulkan backend's cooperative-matrix shaders, which Debian 12 can
# neither compile (its glslc does not know GL_KHR_cooperative_matrix) nor run (its lavapipe has
# no VK_KHR_cooperative_matrix). Debian sid has both (when this was written: glslc 2026.4, and
# Mesa 26.2.6's lavapipe with 8 x 8 x 8 subgroup matrices). The build runs the root's glslc here, through the root's own
# dynamic loader and libraries (no chroot), and the tests that need such a device run inside the
# root, from scripts/device-check.sh's bundle of a Debian 12 build.
#
#   scripts/coopmat-root.sh path          makes the root once and prints its directory
#   scripts/coopmat-root.sh glslc-path    the same, but prints the path of a glslc that runs the
#                                         root's (what -DMEMTUNE_COOPMAT_GLSLC=... takes)
#   scripts/coopmat-root.sh test BUILD_DIR [GTEST_FILTER]
#       bundles BUILD_DIR's memtune and memtune_tests as they are (device-check.sh --bundle) and
#       runs memtune_tests on the root's lavapipe, every test required (MEMTUNE_REQUIRE_ALL_TESTS),
#       by default the vulkan tests: every test named *VulkanCoopmat* (they need cooperative
#       matrices), VulkanOps.*, VulkanShaders.*, VulkanDevice.*, BackendOps.*, VulkanGeometry.*,
#       QuantizedOps.* (int8 activations on the int8 matrices), MatmulGroup.SixteenBit* (float16
#       gate / up and the activation in one pass) and the end-to-end
#       TrainCliTest.EveryCommandRunsOnVulkanAndAgreesWithCpu. Its log is out/coopmat-root/test.log.
#   scripts/coopmat-root.sh check BUILD_DIR
#       the GPU check (scripts/device-check.sh --from) with its small settings (MEMTUNE_CHECK_*
#       as given, else the tiny preset, batch 1, 2 steps of each run, 4 new tokens) on the
#       root's lavapipe, with BUILD_DIR's bundle and a copy of this tree, python3 installed from
#       the mirror into the throw-away overlay first: the model stage's --fp16 run takes
#       gemm_coopmat.comp there. Its log is out/coopmat-root/check.log, the check's files
#       out/coopmat-root/device-check/.
#
# As root (debootstrap, chroot, mount). The root is kept under
# ~/.cache/memtune/coopmat-root-<key>/fs, where the key hashes the suite, the mirror and the
# package list below (a change makes it again from nothing; sid moves on, the kept root does
# not: remove the directory to take today's sid). Beside it, coopmat-root-<key>/mesa-shader-cache
# keeps lavapipe's compiled shaders from one run to the next. Making the root takes 35 to 50 s on 2 cores
# (debootstrap, then the packages), once; `test` with the default filter about 105 s from a full
# shader cache, a few minutes more with an empty one (the bundle, then the tests on lavapipe); `check` about 3 minutes (the bundle, python3 from the mirror, then
# the check). Progress goes to stderr, so `path` and `glslc-path` print only the
# path on stdout.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage="usage: scripts/coopmat-root.sh path | glslc-path | test BUILD_DIR [GTEST_FILTER] | check BUILD_DIR"
command="${1:-}"
case "$command" in
  path|glslc-path|test|check) ;;
  *) echo "coopmat-root: unknown or missing subcommand '$command'; $usage" >&2; exit 2 ;;
esac
[[ $(id -u) -eq 0 ]] || { echo "coopmat-root: needs root (debootstrap, chroot, mount); run it as root or with sudo" >&2; exit 1; }
for tool in debootstrap unshare chroot flock; do
  command -v "$tool" > /dev/null || { echo "coopmat-root: $tool is missing (scripts/install-deps.sh installs debootstrap)" >&2; exit 1; }
done
suite=sid
mirror=http://deb.debian.org/debian
bootstrap=(debootstrap --variant=minbase "$suite")
# lavapipe and the loader, glslc, and vulkaninfo to check the device before the root is kept.
packages=(mesa-vulkan-drivers libvulkan1 glslc glslang-tools vulkan-tools)
# sid's Release files may be past their Valid-Until date on a mirror that lags; apt takes them.
apt=(apt-get -o Acquire::Check-Valid-Until=false)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/memtune"
key="$(echo "${bootstrap[*]} $mirror ${packages[*]}" | sha256sum | cut -c1-12)"
base="$cache/coopmat-root-$key"
fs="$base/fs"
glslc="$base/glslc"
work="$root/out/coopmat-root"
default_filter='*VulkanCoopmat*:TrainCliTest.EveryCommandRunsOnVulkanAndAgreesWithCpu:TrainCliTest.DecodingStepsReplayTheirRecordedCommandsOnVulkan:VulkanOps.*:VulkanShaders.*:VulkanDevice.*:BackendOps.*:VulkanGeometry.*:QuantizedOps.*:MatmulGroup.SixteenBit*'

# mounted_under, run_in (the root entered with unshare and chroot) and network_ca.
source "$root/scripts/root-common.sh"

fail() { echo "coopmat-root: $*" >&2; exit 1; }
# fail_log LOG MESSAGE: the end of LOG, then MESSAGE.
fail_log() { tail -n 30 "$1" >&2; fail "$2 ($1)"; }

# The wrapper the build runs as glslc: the root's glslc through the root's loader, its libraries
# from the root (not from this machine's ld.so.cache). Rewritten only when it would change.
write_glslc() {
  local text
  text="$(cat <<EOF
#!/bin/sh
# Debian sid's glslc (GL_KHR_cooperative_matrix), from the root scripts/coopmat-root.sh made, run
# through that root's own dynamic loader and libraries. Takes glslc's arguments.
fs=$(printf %q "$fs")
exec "\$fs/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --inhibit-cache --library-path "\$fs/usr/lib/x86_64-linux-gnu" \\
  "\$fs/usr/bin/glslc" "\$@"
EOF
)"
  if [[ ! -x "$glslc" || "$(cat "$glslc")" != "$text" ]]; then
    echo "$text" > "$glslc.tmp"
    chmod 755 "$glslc.tmp"
    mv "$glslc.tmp" "$glslc"
  fi
}

# The root, made once: debootstrap, the packages, then the checks that it is what it is for.
make_root() {
  mkdir -p "$cache" "$work"
  exec 9> "$cache/coopmat-root.lock"
  flock 9  # one maker at a time; a second caller waits and then finds the root complete
  if [[ -f "$base/.complete" ]]; then
    write_glslc
    exec 9>&-
    return 0
  fi
  for old in "$cache"/coopmat-root-*/; do
    old="${old%/}"
    [[ -d "$old" ]] || continue
    mounted_under "$old" && fail "$old is still mounted; not touching it"
    rm -rf "$old"
  done
  local t0=$SECONDS t
  echo "coopmat-root: a new Debian sid root: ${bootstrap[*]} ($mirror)" >&2
  "${bootstrap[@]}" "$fs" "$mirror" > "$work/debootstrap.log" 2>&1 ||
    fail_log "$work/debootstrap.log" "debootstrap failed"
  echo "coopmat-root: debootstrap: $((SECONDS - t0)) s; installing ${packages[*]}" >&2
  t=$SECONDS
  run_in "$fs" "$work/packages.log" "set -euo pipefail
    export DEBIAN_FRONTEND=noninteractive
    ${apt[*]} update
    ${apt[*]} install -y --no-install-recommends ${packages[*]}
    apt-get clean" || fail_log "$work/packages.log" "installing ${packages[*]} in the root failed"
  echo "coopmat-root: packages: $((SECONDS - t)) s" >&2

  # lavapipe alone (its manifest named to the loader) must offer cooperative matrices.
  run_in "$fs" "$work/vulkaninfo.log" 'set -euo pipefail
    manifest="$(ls /usr/share/vulkan/icd.d/lvp_icd*.json | head -n 1)"
    echo "manifest: $manifest"
    VK_DRIVER_FILES="$manifest" VK_ICD_FILENAMES="$manifest" vulkaninfo' ||
    fail_log "$work/vulkaninfo.log" "vulkaninfo failed in the root"
  grep -q 'deviceName *= llvmpipe' "$work/vulkaninfo.log" && grep -q 'VK_KHR_cooperative_matrix' "$work/vulkaninfo.log" &&
    grep -q 'cooperativeMatrix *= true' "$work/vulkaninfo.log" ||
    fail "the root's lavapipe does not report VK_KHR_cooperative_matrix (vulkaninfo's output: $work/vulkaninfo.log)"
  echo "coopmat-root: $(grep -m 1 'driverInfo' "$work/vulkaninfo.log" | sed 's/.*= *//')'s lavapipe has VK_KHR_cooperative_matrix" >&2

  # The root's glslc, run here through the wrapper, must compile a cooperative-matrix shader.
  write_glslc
  local probe="$work/probe"
  mkdir -p "$probe"
  cat > "$probe/probe.comp" <<'EOF'
#version 460
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 32) in;
layout(std430, binding = 0) buffer Out { float c[]; };
shared float16_t s[256];
void main() {
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a;
  coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
  coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
  coopMatLoad(a, s, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
  coopMatLoad(b, s, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
  acc = coopMatMulAdd(a, b, acc);
  coopMatStore(acc, c, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
}
EOF
  "$glslc" --target-env=vulkan1.3 -O -o "$probe/probe.spv" "$probe/probe.comp" > "$work/glslc.log" 2>&1 ||
    fail_log "$work/glslc.log" "the root's glslc ($glslc) did not compile a GL_KHR_cooperative_matrix shader"
  echo "coopmat-root: $("$glslc" --version 2>&1 | head -n 1) compiles GL_KHR_cooperative_matrix" >&2
  rm -rf "$probe"
  touch "$base/.complete"
  exec 9>&-
  echo "coopmat-root: the root is made in $((SECONDS - t0)) s: $fs" >&2
}

# prepare_run WHAT BUILD_DIR: the root made, BUILD_DIR's binaries bundled into $work/bundle.tar.gz,
# and an empty overlay run directory at $run_dir (upper, work, fs); WHAT names the subcommand in
# messages.
prepare_run() {
  local what="$1" build_dir="$2"
  [[ -n "$build_dir" ]] || fail "$what needs a build directory; $usage"
  [[ -d "$build_dir" ]] || fail "$what: $build_dir is not a directory"
  build_dir="$(cd "$build_dir" && pwd)"
  make_root
  "$root/scripts/device-check.sh" --bundle "$work/bundle.tar.gz" "$build_dir" ||
    fail "$what: bundling $build_dir failed (scripts/device-check.sh --bundle)"
  run_dir="$work/run"
  mounted_under "$run_dir" && fail "$run_dir is still mounted"
  rm -rf "$run_dir"
  mkdir -p "$run_dir/upper" "$run_dir/work" "$run_dir/fs"
  # Lavapipe's compiled shaders (Mesa's on-disk cache, keyed by the shader, its constants and the
  # driver's build) kept beside the root, as a user's ~/.cache keeps them: compiling the
  # cooperative-matrix pipelines is most of the tests' time on lavapipe (attention's backward
  # passes on flexible matrices: 112 s at head_dim 64 compiled, 2.5 s from the cache).
  if [[ -d "$base/mesa-shader-cache" ]]; then
    mkdir -p "$run_dir/upper/root/.cache"
    cp -a "$base/mesa-shader-cache" "$run_dir/upper/root/.cache/mesa_shader_cache"
  fi
}

# keep_shader_cache: what the run added to lavapipe's cache, kept for the next run (replacing the
# kept one whole, so an interrupted copy leaves the old one).
keep_shader_cache() {
  local made="$run_dir/upper/root/.cache/mesa_shader_cache"
  [[ -d "$made" ]] || return 0
  rm -rf "$base/mesa-shader-cache.new"
  cp -a "$made" "$base/mesa-shader-cache.new"
  rm -rf "$base/mesa-shader-cache"
  mv "$base/mesa-shader-cache.new" "$base/mesa-shader-cache"
}

# test BUILD_DIR [FILTER]: BUILD_DIR's binaries, bundled, in a throw-away overlay of the root.
run_tests() {
  local filter="${2:-$default_filter}" t0=$SECONDS run_dir
  echo "== the cooperative-matrix tests of ${1:-} on the Debian sid root's lavapipe"
  prepare_run test "${1:-}"
  mkdir -p "$run_dir/upper/opt"
  tar -C "$run_dir/upper/opt" -xzf "$work/bundle.tar.gz"  # /opt/memtune-bundle in the overlay
  local script
  script="set -euo pipefail
filter=$(printf %q "$filter")
"'b=/opt/memtune-bundle
library_path="$("$b/library-path")"
echo "== memtune devices"
LD_LIBRARY_PATH="$library_path" "$b/bin/memtune" devices
LD_LIBRARY_PATH="$library_path" "$b/bin/memtune" devices --json > /tmp/devices.json
grep -q "\"cooperative_matrix\": true" /tmp/devices.json || {
  cat /tmp/devices.json
  echo "coopmat-root: memtune (of the bundle) sees no device with cooperative matrices in the root" >&2
  exit 1
}
echo "== memtune_tests --gtest_filter=$filter"
cd /tmp
env OMP_WAIT_POLICY=PASSIVE MEMTUNE_REQUIRE_ALL_TESTS=1 MEMTUNE_BINARY="$b/bin/memtune" \
  MEMTUNE_TOKENIZER_DIR="$b/tokenizer" LD_LIBRARY_PATH="$library_path" \
  "$b/bin/memtune_tests" --gtest_filter="$filter" || {
  status=$?
  ((status <= 128)) || echo "memtune_tests: killed by signal $((status - 128)) ($(kill -l "$status"))"
  exit "$status"
}'
  local status=0
  run_in "$fs" "$work/test.log" "$script" "$run_dir" || status=$?
  keep_shader_cache
  if ((status != 0)); then
    tail -n 60 "$work/test.log" >&2
    fail "test: failed in the root after $((SECONDS - t0)) s ($work/test.log)"
  fi
  grep -E '^(library-path: |\[==========\] [0-9]+ tests? from .* ran|\[  PASSED  \])' "$work/test.log" || true
  rm -rf "$run_dir"
  echo "coopmat-root: test passed in $((SECONDS - t0)) s ($work/test.log)"
}

# check BUILD_DIR: the GPU check's small settings in a throw-away overlay of the root.
run_check() {
  local t0=$SECONDS run_dir
  echo "== the GPU check's small settings with ${1:-} on the Debian sid root's lavapipe"
  prepare_run check "${1:-}"
  mkdir -p "$run_dir/upper/work/memtune"
  # This tree as the GPU machine receives it (tracked and untracked-but-not-ignored files).
  (cd "$root" && git ls-files -z --cached --others --exclude-standard |
    xargs -0 cp --parents -t "$run_dir/upper/work/memtune")
  cp "$work/bundle.tar.gz" "$run_dir/upper/work/bundle.tar.gz"
  local settings=() v
  for v in PRESET=tiny BATCH=1 STEPS=2 FP16_STEPS=2 NEW_TOKENS=4 SEQ= BUDGET_S=; do
    local name="MEMTUNE_CHECK_${v%%=*}"
    [[ -n "${!name:-${v#*=}}" ]] && settings+=("$name=${!name:-${v#*=}}")
  done
  local script
  script="set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
${apt[*]} update -qq
${apt[*]} install -y -qq --no-install-recommends python3 > /dev/null
cd /work/memtune
env MEMTUNE_CHECK_ALLOW_CPU=1 $(printf '%q ' "${settings[@]}")scripts/device-check.sh --from /work/bundle.tar.gz"
  local rc=0
  run_in "$fs" "$work/check.log" "$script" "$run_dir" || rc=$?
  keep_shader_cache
  rm -rf "$work/device-check"
  [[ ! -d "$run_dir/upper/work/memtune/out/device-check" ]] ||
    cp -r "$run_dir/upper/work/memtune/out/device-check" "$work/device-check"
  rm -rf "$work/device-check/memtune-bundle"
  grep -E '^== |^arithmetic: |^fp16 against|passed|failed|^driver:' "$work/check.log" || true
  ((rc == 0)) || fail "check: failed in the root after $((SECONDS - t0)) s ($work/check.log)"
  rm -rf "$run_dir"
  echo "coopmat-root: check passed in $((SECONDS - t0)) s ($work/device-check/device-check.json)"
}

case "$command" in
  path) make_root; echo "$fs" ;;
  glslc-path) make_root; echo "$glslc" ;;
  test) shift; run_tests "$@" ;;
  check) shift; run_check "$@" ;;
esac
