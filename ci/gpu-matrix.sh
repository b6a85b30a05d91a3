#!/usr/bin/env bash
# The GPU scenarios of rucx, for a machine with NVIDIA GPUs (run there; nothing here needs Rust).
# Usage: ci/gpu-matrix.sh [BIN_DIR]   (BIN_DIR holds gpu_exchange, exchange, rucx-info;
#        `cargo xtask gpu-pack` fills .device/ with them, under these names, next to the test
#        executables named <package>-<test>, e.g. rucx-uct-cuda-ipc-gpu).
# ONLY=REGEX runs the scenarios whose name matches. Every scenario runs two ranks on this host (GPU 0 and GPU 1 when there are two) and checks
# every byte; the script exits non-zero if any scenario fails.
set -u
B=${1:-.device}
fail=0
export RUST_BACKTRACE=1

pair() {
  local name=$1 env0=$2 env1=$3; shift 3
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then return; fi
  local port=$((20000 + RANDOM % 20000))
  echo "=== $name"
  env RUCX_RANK=0 RUCX_SIZE=2 RUCX_BOOTSTRAP=127.0.0.1:$port $env0 "$B/gpu_exchange" "$@" > /tmp/r0.$$ 2>&1 &
  local p0=$!
  env RUCX_RANK=1 RUCX_SIZE=2 RUCX_BOOTSTRAP=127.0.0.1:$port $env1 timeout 300 "$B/gpu_exchange" "$@" > /tmp/r1.$$ 2>&1
  local s1=$?
  wait $p0; local s0=$?
  cat /tmp/r0.$$ /tmp/r1.$$
  if [ $s0 -ne 0 ] || [ $s1 -ne 0 ]; then echo "=== FAILED: $name (rank 0: $s0, rank 1: $s1)"; fail=1; else echo "=== ok: $name"; fi
}

[ -n "${ONLY:-}" ] || "$B/rucx-info" -d --gpu -e 2>&1
pair "default (cuda_ipc zero-copy), one way, with bounds" "" "" --oneway --bounds
pair "default, both directions" "" "" --sizes 1,64M+1
pair "no cuda_ipc: staged through shared memory (posix), one way, with bounds" "RUCX_TLS=^cuda_ipc" "RUCX_TLS=^cuda_ipc" --oneway --bounds
pair "tcp + cuda_copy only: staged over the network path" "RUCX_TLS=tcp,cuda_copy,self" "RUCX_TLS=tcp,cuda_copy,self" --bw-size 16M --iters 3
pair "stream-ordered pool buffers: real cuda_ipc export failure, demoted at run time" "" "" --send-mem cuda-pool --oneway --bounds
pair "fault injected on the receiver's cuda_ipc registrations" "" "RUCX_FAULT_INJECT=md=cuda_ipc,mem=cuda,after=0" --oneway
pair "host sender, device receiver" "" "" --send-mem host --recv-mem cuda
pair "device sender, host receiver" "" "" --send-mem cuda --recv-mem host
if command -v mpirun >/dev/null && { [ -z "${ONLY:-}" ] || [[ mpirun =~ $ONLY ]]; }; then
  echo "=== mpirun -np 2 exchange (host buffers) and gpu_exchange"
  OMPI_MCA_plm=isolated timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$B/exchange" --bw-size 16M 2>&1 || { echo "=== FAILED: mpirun exchange"; fail=1; }
  OMPI_MCA_plm=isolated timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$B/gpu_exchange" --sizes 1,4097,1M 2>&1 || { echo "=== FAILED: mpirun gpu_exchange"; fail=1; }
fi
exit $fail
