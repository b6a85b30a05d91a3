#!/usr/bin/env bash
# Latency and bandwidth of tests/c/osu.c between two ranks of this host under the same
# Open MPI (pml ucx), once with the system's UCX and once with rucx's libraries, one after the
# other in one sitting. Extra arguments go to mpirun (e.g. -x RUCX_TLS=posix).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
libs=$("$here/build-libs.sh")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc -O2 -o "$work/osu" "$here/tests/c/osu.c"
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
run() {
  mpirun -np 2 "${root[@]}" --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any \
    --mca btl self "$@" "$work/osu" "${OSU_SCALE:-1}"
}
echo "== system UCX ($(ucx_info -v 2>/dev/null | grep -o 'version=[^ ]*' || echo 'libucp.so.0 of the system'))"
run "$@" | tee "$work/system.txt"
echo "== rucx ($libs)"
run -x LD_LIBRARY_PATH="$libs" "$@" | tee "$work/rucx.txt"
echo "== side by side (system | rucx)"
paste -d'|' "$work/system.txt" "$work/rucx.txt" | awk -F'|' '{ printf "%-40s | %s\n", $1, $2 }'
