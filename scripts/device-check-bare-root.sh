#!/usr/bin/env bash
# Proves here that scripts/device-check.sh --from works on a machine that has none of what it was
# built with: a bare Debian 12 root (debootstrap minbase plus python3: no compiler, no -dev
# packages, no Vulkan loader, no OpenBLAS, no Open MPI), entered with unshare and chroot, where
# the only Vulkan driver is Mesa's lavapipe, its files under /usr/local/nvidia as an NVIDIA
# driver's are on the GPU machine (manifest /usr/local/nvidia/share/vulkan/icd.d/, libraries in
# /usr/local/nvidia/lib through ld.so.conf), where no loader looks by itself. Runs the GPU check's
# small settings twice: with python3 alone, and with a python3 that imports torch and
# transformers (the pinned environment's site-packages, scripts/prepare-hf-env.sh). Each run must
# pass every stage and write out/device-check/device-check.json, whose driver must be that
# manifest, found by the search, with every stage's part (the model stage's both training runs,
# their ratio, the profiles and generation). Prints the archive's size and each run's time.
#
#   scripts/device-check-bare-root.sh          (as root; debootstrap from Debian's mirror, once)
#
# About 6 minutes on 2 cores once the root exists (each run's lavapipe op table and tiny training
# are most of it); the root takes a minute or two more the first time. Not part of CI.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[[ $(id -u) -eq 0 ]] || { echo "device-check-bare-root: needs root (debootstrap, chroot)" >&2; exit 1; }
"$root/scripts/install-deps.sh"
command -v debootstrap > /dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap > /dev/null
work="$root/out/bare-root"
fs="$work/fs"
mkdir -p "$work"

if [[ ! -f "$work/.complete" ]]; then
  rm -rf "$fs"
  echo "== debootstrap --variant=minbase bookworm (with python3)"
  debootstrap --variant=minbase --include=python3 bookworm "$fs" http://deb.debian.org/debian > "$work/debootstrap.log"
  touch "$work/.complete"
fi
for forbidden in /usr/bin/g++ /usr/bin/cc /usr/lib/x86_64-linux-gnu/libvulkan.so.1 /usr/include/stdio.h; do
  [[ ! -e "$fs$forbidden" ]] || { echo "device-check-bare-root: $forbidden exists in the bare root" >&2; exit 1; }
done

echo "== the bundle"
"$root/scripts/device-check.sh" --bundle "$work/bundle.tar.gz"
size=$(stat -c %s "$work/bundle.tar.gz")

# lavapipe as the GPU machine's driver is laid out: files under /usr/local/nvidia.
lvp=/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so
rm -rf "$fs/usr/local/nvidia"
mkdir -p "$fs/usr/local/nvidia/lib" "$fs/usr/local/nvidia/share/vulkan/icd.d"
cp -L "$lvp" "$fs/usr/local/nvidia/lib/"
ldd "$lvp" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
    *) [[ -e "$fs/usr/lib/x86_64-linux-gnu/$(basename "$lib")" ]] || cp -L "$lib" "$fs/usr/local/nvidia/lib/" ;;
  esac
done
cat > "$fs/usr/local/nvidia/share/vulkan/icd.d/lvp_icd.x86_64.json" <<'EOF'
{"file_format_version": "1.0.0", "ICD": {"library_path": "/usr/local/nvidia/lib/libvulkan_lvp.so", "api_version": "1.3.230"}}
EOF
echo /usr/local/nvidia/lib > "$fs/etc/ld.so.conf.d/nvidia.conf"
chroot "$fs" /sbin/ldconfig

# This tree (tracked and untracked-but-not-ignored files, as the GPU machine receives it).
rm -rf "$fs/work"
mkdir -p "$fs/work/memtune"
(cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$fs/work/memtune")
cp "$work/bundle.tar.gz" "$fs/work/bundle.tar.gz"

site=""
hf_python="$("$root/scripts/prepare-hf-env.sh" | tail -n 1)"
site="$("$hf_python" -c 'import site; print(site.getsitepackages()[0])')"

# run NAME [PYTHONPATH]: the check's small settings in the root, in new mount and PID namespaces.
run() {
  local name="$1" pythonpath="${2:-}" t0=$SECONDS rc=0
  echo "== the GPU check in the bare root: $name"
  unshare --mount --pid --fork --kill-child bash -c '
    set -e
    fs="$1" site="$2"
    mount -t proc proc "$fs/proc"
    mount --rbind /dev "$fs/dev"
    mount --rbind /sys "$fs/sys"
    if [[ -n "$site" ]]; then mkdir -p "$fs/hf-site"; mount --bind "$site" "$fs/hf-site"; fi
    exec chroot "$fs" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root ${site:+PYTHONPATH=/hf-site} \
      MEMTUNE_CHECK_PRESET=tiny MEMTUNE_CHECK_BATCH=1 MEMTUNE_CHECK_STEPS=2 MEMTUNE_CHECK_FP16_STEPS=2 \
      MEMTUNE_CHECK_NEW_TOKENS=4 MEMTUNE_CHECK_ALLOW_CPU=1 /bin/bash -c "cd /work/memtune && scripts/device-check.sh --from /work/bundle.tar.gz"
  ' _ "$fs" "$pythonpath" > "$work/$name.log" 2>&1 || rc=$?
  grep -E '^== |passed|failed|driver:' "$work/$name.log" || true
  ((rc == 0)) || { echo "device-check-bare-root: $name failed (exit $rc), $work/$name.log" >&2; exit 1; }
  python3 - "$fs/work/memtune/out/device-check/device-check.json" "$name" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
want = "/usr/local/nvidia/share/vulkan/icd.d/lvp_icd.x86_64.json"
problems = [k for k in ("devices", "peaks", "ops", "e2e", "model", "trainer") if k not in d]
problems += [f"model.{k}" for k in ("train_full_bf16", "train_full_fp16", "fp16_against_bf16", "profile_by_shader",
                                    "generate") if k not in d.get("model", {})]
if d.get("driver", {}).get("manifest") != want:
    problems.append(f"driver {d.get('driver')} (want {want}, found by the search)")
if d["ops"]["failed"] or d["e2e"]["failed"] or not d["ops"]["passed"]:
    problems.append(f"tests: ops {d['ops']}, e2e {d['e2e']}")
torch_wanted = sys.argv[2] == "python3-with-torch"
if bool(d.get("python3", {}).get("torch")) != torch_wanted or d["python3"].get("cuda"):
    problems.append(f"python3 {d.get('python3')} (torch wanted: {torch_wanted}, no CUDA here)")
if problems:
    sys.exit(f"device-check-bare-root: {sys.argv[2]}: {problems}")
print(f"{sys.argv[2]}: every stage in device-check.json; driver {d['driver']['manifest']} ({d['driver']['how']}); "
      f"python3 {d['python3']}")
EOF
  echo "$name: $((SECONDS - t0)) s"
}
run python3-alone
run python3-with-torch "$site"
echo "bundle: $((size / 1048576)) MiB ($size bytes)"
