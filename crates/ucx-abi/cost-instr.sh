#!/usr/bin/env bash
# Instructions per 8-byte message and per idle ucp_worker_progress of rucx libucp builds,
# counted by valgrind's callgrind while examples/ucp_cost.rs drives them (MESSAGES, default
# 20000, through both of its loops: blocking calls, then windows of 64). Instruction counts do
# not depend on what else the machine runs, so two builds compare on a busy machine where even
# CPU time moves by several percent between runs. Without arguments: this tree's build; or
# name=/path/to/libucp.so.0 pairs (e.g. a copy of an earlier build). The system's UCX does not
# run under valgrind (it waits forever): compare with it in CPU time, cost-compare.sh.
#   [KEEP=DIR] bash crates/ucx-abi/cost-instr.sh [name=LIB ...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
n=${MESSAGES:-20000}
command -v valgrind >/dev/null || { echo "cost-instr.sh: valgrind is not installed" >&2; exit 1; }
cargo build --release -p rucx-ucx-abi --example ucp_cost --manifest-path "$root/Cargo.toml" >&2
bin=$target/release/examples/ucp_cost
specs=("$@")
[ ${#specs[@]} -eq 0 ] && specs=("rucx=$("$here/build-libs.sh")/libucp.so.0")
# KEEP=DIR keeps the profiles there (NAME.busy, NAME.prog) for callgrind_annotate.
if [ -n "${KEEP:-}" ]; then
  mkdir -p "$KEEP"
  work=$(cd "$KEEP" && pwd)
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
# The loops send this many messages: n/10 + n blocking (warm-up included), and as many again
# in windows of 64 (n/64 rounds plus a tenth of them for warm-up, 64 messages each).
rounds=$(( n / 64 > 0 ? n / 64 : 1 ))
msgs=$(( n / 10 + n + (rounds / 10 + rounds) * 64 ))
idle=2000000
# callgrind_annotate run from outside any source tree: run inside the one a build came from, it
# names that build's files by relative path and splits their functions' inclusive counts.
total() { (cd / && callgrind_annotate "$1") 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }'; }
incl() {
  (cd / && callgrind_annotate --inclusive=yes "$1") 2>/dev/null |
    awk -v f=":$2 \\\\[" '$0 ~ f && !done { gsub(",", "", $1); print $1; done = 1 }'
}
printf '%-10s %12s %12s %12s\n' "" "per message" "progress in" "idle progress"
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  lib=${spec#*=}
  run() {
    env -u LD_LIBRARY_PATH RUCX_TLS="${RUCX_TLS:-posix}" valgrind --tool=callgrind \
      --toggle-collect="$1" --callgrind-out-file="$2" "$bin" "$lib" "$n" >/dev/null 2>&1
  }
  # Only inside the message loops, then only inside progress (the loops' and the idle calls').
  run 'ucp_cost::main::{{closure}}' "$work/$name.busy"
  run 'ucp_worker_progress' "$work/$name.prog"
  busy=$(total "$work/$name.busy")
  busy_prog=$(incl "$work/$name.busy" ucp_worker_progress)
  prog=$(total "$work/$name.prog")
  printf '%-10s %12d %12d %12d\n' "$name" $((busy / msgs)) $((busy_prog / msgs)) \
    $(((prog - busy_prog) / idle))
done
