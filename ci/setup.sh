#!/usr/bin/env bash
# Install the system packages rucx needs to build and test, when they are missing.
# Debian/Ubuntu only; on other systems it prints what is needed and exits non-zero.
set -euo pipefail

need=()
command -v cargo >/dev/null || { echo "rucx needs a Rust toolchain (cargo, rustc >= 1.90): see https://rustup.rs" >&2; exit 1; }
command -v ip >/dev/null || need+=(iproute2)
command -v cc >/dev/null || need+=(gcc)
# The ib component's verbs binding (sideway / rdma-mummy-sys) runs bindgen and a cmake build.
command -v cmake >/dev/null || need+=(cmake)
if ! ldconfig -p 2>/dev/null | grep -q 'libclang[-.0-9]*\.so'; then need+=(libclang-dev); fi
# The C ABI's tests run unmodified MPI programs under Open MPI's pml ucx (crates/ucx-abi).
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v mpicc >/dev/null || need+=(libopenmpi-dev)
# The C ABI's tests build UCX's own examples (ucp_hello_world, ucp_client_server) from the
# package's sources, with its headers, and run them over rucx (crates/ucx-abi/tests/examples.rs).
if [ ! -f /usr/share/doc/libucx-dev/examples/ucp_client_server.c ] || [ ! -f /usr/include/ucp/api/ucp.h ]; then
  need+=(libucx-dev)
fi
for pkg in ${RUCX_EXTRA_PACKAGES:-}; do need+=("$pkg"); done

if [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "ci/setup.sh: installing ${need[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "ci/setup.sh: please install: ${need[*]}" >&2
    exit 1
  fi
fi
