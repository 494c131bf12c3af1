#!/usr/bin/env bash
# Prints the library path (LD_LIBRARY_PATH) that memtune's processes need when they run from the
# bundle scripts/device-check.sh --bundle makes, which carries this script as its `library-path`:
#
#   LD_LIBRARY_PATH="$(memtune-bundle/library-path)" memtune-bundle/bin/memtune devices
#
# The bundle's lib/ always comes first (a driver the Vulkan loader opens finds libGLdispatch and
# the like there; a RUNPATH does not reach a dlopen'ed driver's own dependencies). The bundle's
# C++ runtime (libstdc++.so.6 and libgcc_s.so.1, in lib/cxx-runtime/, on no RUNPATH) follows
# only where this machine's libstdc++ is missing or older than the bundle's, compared by the
# highest GLIBCXX_3.4.N each provides: one libstdc++ serves the whole process, the driver
# included, and a newer system's driver (Mesa's lavapipe through LLVM and libz3, a GPU vendor's
# driver) needs the newer runtime, which the older one would shadow. Says on stderr which it took.
# Instant.
set -euo pipefail
bundle="$(cd "$(dirname "$0")" && pwd)"
cxx="$bundle/lib/cxx-runtime"

# glibcxx_level FILE: N of the highest GLIBCXX_3.4.N that FILE provides (0 when none).
glibcxx_level() {
  { grep -ao 'GLIBCXX_3\.4\.[0-9]*' "$1" || true; } | cut -d. -f3 | sort -n | tail -n 1 | grep . || echo 0
}

if [[ ! -f "$cxx/libstdc++.so.6" ]]; then
  echo "$bundle/lib"
  exit 0
fi
# (/sbin is on no unprivileged PATH on Debian; awk reads to the end: an early exit would leave
# ldconfig a broken pipe, fatal under pipefail)
ldconfig="$(command -v ldconfig || echo /sbin/ldconfig)"
host_lib="$("$ldconfig" -p 2> /dev/null | awk '!found && $1 == "libstdc++.so.6" && /x86-64/ {print $NF; found = 1}' || true)"
bundled=$(glibcxx_level "$cxx/libstdc++.so.6") host=0
[[ -n "$host_lib" && -f "$host_lib" ]] && host=$(glibcxx_level "$host_lib")
if ((host >= bundled)); then
  echo "library-path: this machine's C++ runtime ($host_lib, GLIBCXX_3.4.$host; the bundle's: 3.4.$bundled)" >&2
  echo "$bundle/lib"
else
  echo "library-path: the bundle's C++ runtime (GLIBCXX_3.4.$bundled; this machine's: ${host_lib:-none}${host_lib:+, 3.4.$host})" >&2
  echo "$bundle/lib:$cxx"
fi
