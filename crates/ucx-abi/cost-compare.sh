#!/usr/bin/env bash
# CPU per 8-byte message through the system's libucp (UCX) and rucx's, alternating, REPS rounds
# (default 5), medians: examples/ucp_cost.rs drives each the way Open MPI's blocking calls do,
# both workers in one thread over shared memory, and counts thread CPU time, so the figures
# hold on a busy machine where two-process ping-pong latency does not. Extra libraries to
# compare: OTHER_LIBS="name=/path/to/libucp.so.0 ...".
#   bash crates/ucx-abi/cost-compare.sh [REPS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
reps=${1:-5}
cargo build --release -p rucx-ucx-abi --example ucp_cost --manifest-path "$root/Cargo.toml" >&2
libs=$("$here/build-libs.sh")
bin=$target/release/examples/ucp_cost
specs=("system=system" "rucx=$libs/libucp.so.0")
for o in ${OTHER_LIBS:-}; do specs+=("$o"); done
declare -A msg win idle
for r in $(seq 1 "$reps"); do
  for spec in "${specs[@]}"; do
    name=${spec%%=*}
    lib=${spec#*=}
    # UCX: shared memory between the two workers (self alone does not join them); rucx: posix.
    line=$(env -u LD_LIBRARY_PATH UCX_TLS="${UCX_TLS:-posix,self}" RUCX_TLS="${RUCX_TLS:-posix}" \
      "$bin" "$lib" "${MESSAGES:-200000}")
    echo "round $r $name: $line"
    read -r m w i < <(echo "$line" | sed -E 's/.*message ([0-9.]+) ns, in windows of [0-9]+ ([0-9.]+) ns, idle progress ([0-9.]+) ns.*/\1 \2 \3/')
    msg[$name]+="$m "
    win[$name]+="$w "
    idle[$name]+="$i "
  done
done
med() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo "== medians of $reps rounds, ns of CPU (8 B message | per message in windows of 64 | idle progress)"
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  printf '%-10s %6s | %6s | %5s\n' "$name" "$(echo "${msg[$name]}" | med)" \
    "$(echo "${win[$name]}" | med)" "$(echo "${idle[$name]}" | med)"
done
