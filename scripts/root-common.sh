# The pieces scripts/fresh-root-check.sh and scripts/coopmat-root.sh share to enter a Debian root
# kept under ~/.cache/memtune. Sourced, not run:
#
#   source "$root/scripts/root-common.sh"
#
# It defines mounted_under and run_in and sets network_ca; both scripts run as root.

# Nothing may be mounted under a root that is deleted or reused.
mounted_under() { grep -q " $1" /proc/mounts; }

# run_in FS LOG SCRIPT [OVERLAY_DIR [REPO]]: SCRIPT (bash) in the root FS, as root, with a bare
# environment, in new mount and PID namespaces (every mount vanishes with them); its output goes
# to LOG. With OVERLAY_DIR, FS is the lower layer of an overlay whose upper layer is
# OVERLAY_DIR/upper (what is already there shows through), and with REPO as well, REPO is cloned
# into it at /root/memtune first.
run_in() {
  unshare --mount --pid --fork --kill-child bash -c '
    set -euo pipefail
    fs="$1" script="$2" overlay="${3:-}" repo="${4:-}"
    if [[ -n "$overlay" ]]; then
      mount -t overlay overlay -o "lowerdir=$fs,upperdir=$overlay/upper,workdir=$overlay/work" "$overlay/fs"
      fs="$overlay/fs"
      [[ -z "$repo" ]] || git clone --quiet --no-hardlinks "$repo" "$fs/root/memtune"
    fi
    mount -t proc proc "$fs/proc"
    mount --rbind /dev "$fs/dev"
    mount --rbind /sys "$fs/sys"
    cp /etc/resolv.conf "$fs/etc/resolv.conf"
    trust=()
    if [[ -n "$5" ]]; then
      cp "$5" "$fs/etc/host-network-ca.crt"
      for v in SSL_CERT_FILE PIP_CERT REQUESTS_CA_BUNDLE NODE_EXTRA_CA_CERTS; do trust+=("$v=/etc/host-network-ca.crt"); done
    fi
    exec chroot "$fs" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      HOME=/root LANG=C.UTF-8 TERM=dumb "${trust[@]}" /bin/bash -c "$script"
  ' _ "$1" "$3" "${4:-}" "${5:-}" "$network_ca" > "$2" 2>&1
}

# The network's own certificate authority where this machine's traffic to PyPI and npm passes a
# TLS-inspecting proxy (the host names its bundle in SSL_CERT_FILE / PIP_CERT /
# NODE_EXTRA_CA_CERTS): the root gets that bundle and those variables, as any machine on this
# network needs them. Nothing else of the host's configuration goes in.
network_ca="${SSL_CERT_FILE:-${PIP_CERT:-${NODE_EXTRA_CA_CERTS:-}}}"
[[ -z "$network_ca" || -f "$network_ca" ]] || network_ca=""
