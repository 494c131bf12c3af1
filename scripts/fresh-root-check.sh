#!/usr/bin/env bash
# Proves the README's two commands on a machine that has never seen memtune: a minimal Debian 12
# root (debootstrap --variant=minbase: no compiler, no cmake, no Python, no Node.js), entered with
# chroot in new mount and PID namespaces, gets a clone of this repository's committed HEAD and runs
#   MEMTUNE_DEMO_QUICK=1 scripts/demo.sh     (the first command, its quick setting), then
#   scripts/test.sh --build-only            (the second command up to its build: the packages,
#                                            the tokenizer, the client, the pinned Python
#                                            environment from PyPI, the configured release build)
# as a new user would, as root (install-deps.sh then needs no sudo). Nothing of this machine's
# caches reaches the root: every package, npm module and wheel comes from Debian, npm and PyPI.
#
#   scripts/fresh-root-check.sh          (as root; scripts/test.sh runs it last)
#
# What is kept between runs, as a user's machine would keep it: the Debian root after
# install-deps.sh's packages are installed, under ~/.cache/memtune/fresh-root-<key>, where the
# key hashes install-deps.sh and this script's debootstrap line, so any change to the package
# list makes the root again from nothing (debootstrap, then install-deps.sh inside it). Each run
# starts from that root through an overlay whose upper layer is thrown away afterwards: the
# clone, its build, the tokenizer, the Python environment and npm's caches are made anew every
# time. Mounts live only in the run's own mount namespace, so nothing stays bound into the root.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[[ $(id -u) -eq 0 ]] || { echo "fresh-root-check: needs root (debootstrap, chroot, mount)" >&2; exit 1; }
command -v debootstrap > /dev/null || { echo "fresh-root-check: debootstrap is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
suite=bookworm
mirror=http://deb.debian.org/debian
bootstrap=(debootstrap --variant=minbase "$suite")
cache="${XDG_CACHE_HOME:-$HOME/.cache}/memtune"
key="$( (cat "$root/scripts/install-deps.sh"; echo "${bootstrap[*]} $mirror") | sha256sum | cut -c1-12)"
base="$cache/fresh-root-$key"
work="$root/out/fresh-root"
t_start=$SECONDS

# mounted_under, run_in (the root entered with unshare and chroot) and network_ca.
source "$root/scripts/root-common.sh"

mkdir -p "$cache" "$work"
if [[ ! -f "$base/.complete" ]]; then
  for old in "$cache"/fresh-root-*; do
    [[ -d "$old" ]] || continue
    mounted_under "$old" && { echo "fresh-root-check: $old is still mounted; not touching it" >&2; exit 1; }
    rm -rf "$old"
  done
  echo "== a new Debian 12 root: ${bootstrap[*]} ($mirror)"
  t0=$SECONDS
  "${bootstrap[@]}" "$base/fs" "$mirror" > "$work/debootstrap.log" 2>&1 ||
    { tail -n 30 "$work/debootstrap.log" >&2; echo "fresh-root-check: debootstrap failed ($work/debootstrap.log)" >&2; exit 1; }
  cat > "$base/fs/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
EOF
  for forbidden in /usr/bin/g++ /usr/bin/cc /usr/bin/cmake /usr/bin/python3 /usr/bin/node /usr/bin/git; do
    [[ ! -e "$base/fs$forbidden" ]] || { echo "fresh-root-check: $forbidden exists in the minimal root" >&2; exit 1; }
  done
  echo "debootstrap: $((SECONDS - t0)) s"
  echo "== scripts/install-deps.sh in the new root (the package list as this commit has it)"
  t0=$SECONDS
  mkdir -p "$base/fs/tmp/deps"
  cp "$root/scripts/install-deps.sh" "$base/fs/tmp/deps/"
  run_in "$base/fs" "$work/install-deps.log" "/tmp/deps/install-deps.sh" ||
    { tail -n 30 "$work/install-deps.log" >&2; echo "fresh-root-check: install-deps.sh failed in the new root" >&2; exit 1; }
  rm -rf "$base/fs/tmp/deps" "$base/fs/var/cache/apt/archives/"*.deb
  echo "install-deps.sh: $((SECONDS - t0)) s"
  touch "$base/.complete"
else
  echo "== the Debian 12 root with install-deps.sh's packages, from $base (its key $key hashes the package list)"
fi

# This run's root: the kept one under a throw-away overlay.
echo "== a clone of $(git -C "$root" rev-parse --short HEAD) in the root: the README's two commands"
run_dir="$work/run"
mounted_under "$run_dir" && { echo "fresh-root-check: $run_dir is still mounted" >&2; exit 1; }
rm -rf "$run_dir"
mkdir -p "$run_dir/upper" "$run_dir/work" "$run_dir/fs"
t0=$SECONDS
commands='set -euo pipefail
cd /root/memtune
echo "== MEMTUNE_DEMO_QUICK=1 scripts/demo.sh"
t=$SECONDS
MEMTUNE_DEMO_QUICK=1 scripts/demo.sh
echo "demo (quick): $((SECONDS - t)) s"
echo "== scripts/test.sh --build-only"
t=$SECONDS
scripts/test.sh --build-only
echo "test.sh --build-only: $((SECONDS - t)) s"'
if ! run_in "$base/fs" "$work/commands.log" "$commands" "$run_dir" "$root"; then
  tail -n 60 "$work/commands.log" >&2
  echo "fresh-root-check: the README's commands failed in the fresh root ($work/commands.log)" >&2
  exit 1
fi
grep -E '^(== |demo \(quick\)|test.sh --build-only|demo finished)' "$work/commands.log"
rm -rf "$run_dir"
echo "fresh-root-check: passed; the two commands took $((SECONDS - t0)) s, $((SECONDS - t_start)) s in all"
