#!/usr/bin/env bash
# The GPU scenarios of rucx, for a machine with NVIDIA GPUs (run there; nothing here needs Rust).
# Usage: ci/gpu-matrix.sh [BIN_DIR]   (BIN_DIR holds gpu_exchange, exchange, rucx-info;
#        `cargo xtask gpu-pack` fills .device/ with them, under these names, next to the test
#        executables named <package>-<test>, e.g. rucx-uct-cuda-ipc-gpu).
# ONLY=REGEX runs the scenarios whose name matches. Every scenario runs two ranks on this host (GPU 0 and GPU 1 when there are two) and checks
# every byte; the script exits non-zero if any scenario fails. `expect`/`reject` lines after a
# scenario check its output (both ranks) for extended regular expressions; TIMEOUT=S before a
# scenario bounds each rank (default 300 s: a hang is a failure).
set -u
B=${1:-.device}
fail=0
ran=0
last=""
export RUST_BACKTRACE=1

pair() {
  local name=$1 env0=$2 env1=$3; shift 3
  ran=0
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then return; fi
  ran=1; last=$name
  local port=$((20000 + RANDOM % 20000)) limit=${TIMEOUT:-300}
  echo "=== $name"
  env RUCX_RANK=0 RUCX_SIZE=2 RUCX_BOOTSTRAP=127.0.0.1:$port $env0 timeout "$limit" "$B/gpu_exchange" "$@" > /tmp/r0.$$ 2>&1 &
  local p0=$!
  env RUCX_RANK=1 RUCX_SIZE=2 RUCX_BOOTSTRAP=127.0.0.1:$port $env1 timeout "$limit" "$B/gpu_exchange" "$@" > /tmp/r1.$$ 2>&1
  local s1=$?
  wait $p0; local s0=$?
  cat /tmp/r0.$$ /tmp/r1.$$ | tee /tmp/rall.$$
  if [ $s0 -eq 124 ] || [ $s1 -eq 124 ]; then echo "=== FAILED (hang: still running after ${limit}s): $name (rank 0: $s0, rank 1: $s1)"; fail=1
  elif [ $s0 -ne 0 ] || [ $s1 -ne 0 ]; then echo "=== FAILED: $name (rank 0: $s0, rank 1: $s1)"; fail=1; else echo "=== ok: $name"; fi
}

# The last scenario's output must match every REGEX.
expect() {
  [ $ran -eq 1 ] || return 0
  local re
  for re in "$@"; do
    grep -Eq -- "$re" /tmp/rall.$$ || { echo "=== FAILED: $last: no line matches /$re/"; fail=1; }
  done
}

# The last scenario's output must match none of the REGEXes.
reject() {
  [ $ran -eq 1 ] || return 0
  local re
  for re in "$@"; do
    if grep -Eq -- "$re" /tmp/rall.$$; then echo "=== FAILED: $last: a line matches /$re/"; fail=1; fi
  done
}

[ -n "${ONLY:-}" ] || "$B/rucx-info" -d --gpu -e 2>&1
pair "default (cuda_ipc zero-copy), one way, with bounds" "" "" --oneway --bounds
pair "default, both directions" "" "" --sizes 1,64M+1
pair "no cuda_ipc: staged through shared memory (posix), one way, with bounds" "RUCX_TLS=^cuda_ipc" "RUCX_TLS=^cuda_ipc" --oneway --bounds
pair "tcp + cuda_copy only: staged over the network path" "RUCX_TLS=tcp,cuda_copy,self" "RUCX_TLS=tcp,cuda_copy,self" --bw-size 16M --iters 3
pair "stream-ordered pool buffers: real cuda_ipc export failure, refused per buffer (no demotion)" "" "" --send-mem cuda-pool --oneway --bounds
expect "refused buffer: cuda_ipc" "rendezvous receive pipelined through host staging"
reject "demotion: cuda_ipc"
pair "fault injected on the receiver's cuda_ipc registrations" "" "RUCX_FAULT_INJECT=md=cuda_ipc,mem=cuda,after=0" --oneway
pair "host sender, device receiver" "" "" --send-mem host --recv-mem cuda
expect "protocols: .*rendezvous receive by remote write into GPU memory"
pair "host sender, device receiver, the receiver's cuda_ipc refused: staged read" "" "RUCX_FAULT_INJECT=md=cuda_ipc,mem=cuda,after=0" --send-mem host --recv-mem cuda --oneway
expect "rendezvous receive by read, staged to the GPU"
pair "staged device to device, 64K fragments" "RUCX_TLS=^cuda_ipc RUCX_RNDV_FRAG_SIZE=64K" "RUCX_TLS=^cuda_ipc RUCX_RNDV_FRAG_SIZE=64K" --oneway --bw-size 64M
expect "staging fragments copied in runs" "staged fragments copied to the GPU in runs"
pair "staged device to device, 4K fragments" "RUCX_TLS=^cuda_ipc RUCX_RNDV_FRAG_SIZE=4K" "RUCX_TLS=^cuda_ipc RUCX_RNDV_FRAG_SIZE=4K" --oneway --bw-size 16M --iters 3
expect "staging fragments copied in runs"
pair "staged with 4K fragments, device into host" "RUCX_TLS=^cuda_ipc RUCX_RNDV_FRAG_SIZE=4K" "RUCX_TLS=^cuda_ipc RUCX_RNDV_FRAG_SIZE=4K" --send-mem cuda --recv-mem host --sizes 1,4097,1M+3 --bw-size 4M --iters 2
pair "device sender, host receiver" "" "" --send-mem cuda --recv-mem host

# Truncation through the staged pipeline (a send larger than the receive buffer): the receiver
# ends with a truncation error, the sender completes, neither hangs.
TIMEOUT=60 pair "hang A: pool sender (refused by cuda_ipc) 64K+1 into 64K, staged" "" "" --send-mem cuda-pool --sizes 64K+1 --recv-cap 64K --bw-size 0
expect "rank 0: 65537 bytes into a 65536-byte buffer: truncated as expected" "rank 1: 65537 bytes into a 65536-byte buffer: truncated as expected" "pipelined through host staging"
TIMEOUT=60 pair "hang A: cuda_ipc demoted first (injected bad address), then 64K+1 into 64K, staged" "RUCX_FAULT_INJECT=md=cuda_ipc,mem=cuda,after=0" "RUCX_FAULT_INJECT=md=cuda_ipc,mem=cuda,after=0" --sizes 1M,64K+1,4M+1 --recv-cap 64K --bw-size 0
expect "rank 0: 65537 bytes into a 65536-byte buffer: truncated as expected" "rank 1: 4194305 bytes into a 65536-byte buffer: truncated as expected" "demotion: cuda_ipc"
TIMEOUT=60 pair "hang A: no cuda_ipc, 64K+1 into 64K, staged" "RUCX_TLS=^cuda_ipc" "RUCX_TLS=^cuda_ipc" --sizes 64K+1,1M+1 --recv-cap 64K --bw-size 0
expect "rank 1: 1048577 bytes into a 65536-byte buffer: truncated as expected"
TIMEOUT=60 pair "truncation after a refused pool buffer: plain buffers 64K+1 into 64K over cuda_ipc" "" "" --warmup-mem cuda-pool --sizes 64K+1 --recv-cap 64K --bw-size 0
expect "rank 1: 65537 bytes into a 65536-byte buffer: truncated as expected" "GPU zero-copy"

# Registrations of the copy lane (cuda_cpy) fail with cuda_ipc left out: no path is left for
# device memory, so every transfer ends on both ranks with the reason (domain, buffer, knob)
# within seconds, or finishes through another path; none may hang.
for who in "both ranks" "the sender only" "the receiver only"; do
  f="RUCX_FAULT_INJECT=md=cuda_cpy,after=3"
  case $who in
    "both ranks") e0="RUCX_TLS=^cuda_ipc $f"; e1="RUCX_TLS=^cuda_ipc $f" ;;
    "the sender only") e0="RUCX_TLS=^cuda_ipc $f"; e1="RUCX_TLS=^cuda_ipc" ;;
    *) e0="RUCX_TLS=^cuda_ipc"; e1="RUCX_TLS=^cuda_ipc $f" ;;
  esac
  # Rank 0 sends to rank 1 and rank 1 to rank 0: with the fault on one rank, that rank is the
  # sender of one transfer and the receiver of the other.
  TIMEOUT=60 pair "hang B: no cuda_ipc, cuda_cpy fails after 3 registrations on $who, 1 MiB: both end, no hang" "$e0" "$e1" --sizes 1M,1M,4M --bw-size 0 --allow-error
  expect "rank 0: (ended with an error|all sizes verified)" "rank 1: (ended with an error|all sizes verified)"
  TIMEOUT=60 pair "hang B: no cuda_ipc, cuda_cpy fails after 3 registrations on $who, default sizes: both end, no hang" "$e0" "$e1" --sizes 1,4097,1M,64M+1 --bw-size 0 --allow-error
  expect "rank 0: (ended with an error|all sizes verified)" "rank 1: (ended with an error|all sizes verified)" "ended with an error.*cuda_cpy.*RUCX_"
done
TIMEOUT=60 pair "hang B: the sender's cuda_cpy refuses device memory at once: the receive ends with the sender's reason" "RUCX_TLS=^cuda_ipc RUCX_FAULT_INJECT=md=cuda_cpy,mem=cuda,after=0" "RUCX_TLS=^cuda_ipc" --sizes 1M --bw-size 0 --allow-error
expect "rank 1: ended with an error.*ended the transfer.*cuda_cpy.*RUCX_" "rank 0: ended with an error.*cuda_cpy"

# Demotion scoped to what failed: a pool buffer that cuda_ipc cannot export is steered to the
# staged pipeline alone; plain cudaMalloc buffers of the same GPU still move through cuda_ipc
# (GPU zero-copy reads, or on one GPU shared by both ranks the lower worker's writes into the
# receive buffer; bandwidth near the peer-copy bound), and cuda_ipc is not demoted.
pair "after a refused pool buffer, plain device buffers still move through cuda_ipc, with bounds" "" "" --warmup-mem cuda-pool --oneway --bounds --min-ratio 0.5
expect "refused buffer: cuda_ipc" "warm-up 1048576 bytes from CudaPool verified.*pipelined through host staging" "rank 1: protocols: .*rendezvous receive by (read \(GPU zero-copy\)|remote write on a shared GPU)" "bound peer copy GPU0->GPU1|bound pinned host->device"
reject "demotion: cuda_ipc"

# Put and get with GPU memory (rucx-perftest, two local ranks; the client's buffer is the first
# memory type, the server's mapped region the second): what was put into the region, or read
# by the last gets, is checked by the tool; --bounds prints the copy floors and marks the
# test's ("[this test's floor]": the peer copy for -m cuda).
if [ -x "$B/rucx-perftest" ]; then
  for t in ucp_put_bw ucp_get ucp_put_lat; do
    for m in cuda host,cuda cuda,host; do
      name="perftest $t -m $m"
      if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then continue; fi
      echo "=== $name"
      timeout 180 "$B/rucx-perftest" --local -t "$t" -m "$m" -s 8,1M,64M -n 100 --bounds > /tmp/rall.$$ 2>&1
      st=$?
      cat /tmp/rall.$$
      if [ $st -eq 0 ] && grep -q "this test's floor" /tmp/rall.$$; then
        echo "=== ok: $name"
      else
        echo "=== FAILED: $name"; fail=1
      fi
    done
  done
fi

if command -v mpirun >/dev/null && { [ -z "${ONLY:-}" ] || [[ mpirun =~ $ONLY ]]; }; then
  echo "=== mpirun -np 2 exchange (host buffers) and gpu_exchange"
  OMPI_MCA_plm=isolated timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$B/exchange" --bw-size 16M 2>&1 || { echo "=== FAILED: mpirun exchange"; fail=1; }
  OMPI_MCA_plm=isolated timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$B/gpu_exchange" --sizes 1,4097,1M 2>&1 || { echo "=== FAILED: mpirun gpu_exchange"; fail=1; }
fi
rm -f /tmp/r0.$$ /tmp/r1.$$ /tmp/rall.$$
exit $fail
