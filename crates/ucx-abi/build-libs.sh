#!/usr/bin/env bash
# Build rucx's libucp.so.0 and the thin libucs.so.0, libuct.so.0 and libucm.so.0 next to it
# (Open MPI's UCX components list all four; the symbols all live in libucp), into DIR
# (default: <target>/release/ucx), and print DIR. Then run any Open MPI program over rucx:
#   LD_LIBRARY_PATH=DIR mpirun --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any ...
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
out=${1:-$target/release/ucx}
cargo build --release -p rucx-ucx-abi --manifest-path "$root/Cargo.toml" >&2
mkdir -p "$out"
ln -sf "$(cd "$target/release" && pwd)/libucp.so" "$out/libucp.so.0"
for l in ucs uct ucm; do
  cc -shared -x c /dev/null -o "$out/lib$l.so.0" "-Wl,-soname,lib$l.so.0"
done
echo "$out"
