#!/usr/bin/env bash
# One sitting on the GPU machine: every GPU test executable, the scenario matrix and the GPU
# figures (perftest with its bounds, the first demoting transfer), in one run so the figures are
# side by side. Nothing here needs Rust; build here, carry BIN_DIR there.
#
#   here:  cargo xtask gpu-pack rucx rucx-cuda rucx-uct-cuda-copy rucx-uct-cuda-ipc   # -> .device/
#          (add a BASE/ folder with an older rucx-perftest and gpu_exchange to compare builds)
#   there: bash ci/gpu-sitting.sh .device [BASE_DIR]
#
# PARTS=tests,matrix,figures picks parts (default: all three). Output lines starting with
# "=== ok" / "=== FAILED" summarize the tests and scenarios; figures are printed as they come.
set -u
B=${1:-.device}
BASE=${2:-}
PARTS=${PARTS:-tests,matrix,figures}
fail=0
export RUST_BACKTRACE=1
has() { [[ ",$PARTS," == *",$1,"* ]]; }

nvidia-smi -L
if has tests; then
  for t in "$B"/*-gpu "$B"/*-gpu_*; do
    [ -x "$t" ] || continue
    echo "=== tests: $(basename "$t")"
    RUCX_GPU_TESTS=1 timeout 600 "$t" --test-threads=1 > /tmp/test.$$ 2>&1
    rc=$?
    tail -n 25 /tmp/test.$$
    if [ $rc -eq 0 ]; then echo "=== ok: $(basename "$t")"; else echo "=== FAILED: $(basename "$t") (exit $rc)"; fail=1; fi
  done
fi
if has matrix; then
  bash "$(dirname "$0")/gpu-matrix.sh" "$B" > /tmp/matrix.$$ 2>&1 || fail=1
  grep -E "^=== (ok|FAILED)" /tmp/matrix.$$
  echo "matrix: $(grep -c '^=== ok' /tmp/matrix.$$) ok, $(grep -c '^=== FAILED' /tmp/matrix.$$) failed"
fi
if has figures; then
  # The small-message floors of this machine (plain CUDA, tools/gpu-floor/floor.c): one copy
  # in one process, and two processes on GPU 0 ping-ponging through a cuda_ipc mapping.
  if [ -x /usr/local/cuda/bin/nvcc ] && /usr/local/cuda/bin/nvcc -O2 -o /tmp/floor.$$ \
       "$(dirname "$0")/../tools/gpu-floor/floor.c" -lcuda; then
    for s in 8 4096; do /tmp/floor.$$ single $s 2000; /tmp/floor.$$ pingpong $s 2000; done
    # The same copy as a kernel, and ends seen through a host word instead of an event.
    /usr/local/cuda/bin/nvcc -O2 -o /tmp/kinds.$$ "$(dirname "$0")/../tools/gpu-floor/copy-kinds.c" -lcuda &&
      for s in 8 4096; do /tmp/kinds.$$ $s 2000; done
  else
    echo "--- no nvcc: small-message floors not measured"
  fi
  for P in "$B" ${BASE:+"$BASE"}; do
    echo "=== figures of $P"
    pt="$P/rucx-perftest"
    for args in "-m cuda -t tag_lat -s 8" "-m cuda -t tag_lat -s 4096" "-m cuda -t tag_bw -s 64M" "-m host,cuda -t tag_bw -s 64M" "--pin-host -m host,cuda -t tag_bw -s 64M" \
                "-m cuda,host -t tag_bw -s 64M" "--pin-host -m cuda,host -t tag_bw -s 64M" \
                "-m cuda -t ucp_put_bw -s 64M" "-m cuda -t ucp_get -s 64M" "-m cuda,host -t ucp_put_bw -s 64M" \
                "-m cuda -t stream_bw -s 64M" "-m cuda,host -t am_bw -s 64M"; do
      echo "--- rucx-perftest --local -q --bounds $args"
      # The last lines: the protocols used, the CUDA driver calls per iteration of each side
      # (the server's may come before the client's table), the bounds.
      # shellcheck disable=SC2086
      timeout 120 "$pt" --local -q --bounds $args 2>&1 | tail -n 9
    done
    for f in 4M 64K; do
      echo "--- staged RUCX_RNDV_FRAG_SIZE=$f -m cuda -t tag_bw -s 64M"
      RUCX_TLS=^cuda_ipc RUCX_RNDV_FRAG_SIZE=$f timeout 120 "$pt" --local -q -m cuda -t tag_bw -s 64M 2>&1 | tail -n 6
    done
    echo "--- first demoting 1 GiB transfer (cuda_ipc budget 256M)"
    port=$((20000 + RANDOM % 20000))
    for r in 0 1; do
      RUCX_RANK=$r RUCX_SIZE=2 RUCX_BOOTSTRAP=127.0.0.1:$port RUCX_FAULT_INJECT=md=cuda_ipc,mem=cuda,budget=256M \
        timeout 120 "$P/gpu_exchange" --oneway --sizes 1 --bw-size 1G --iters 5 > /tmp/d$r.$$ 2>&1 &
    done
    wait
    grep -hE "first|steady|GB/s|ms" /tmp/d0.$$ /tmp/d1.$$ | head -n 12
  done
fi
echo "=== sitting: $([ $fail -eq 0 ] && echo all ok || echo FAILURES)"
exit $fail
