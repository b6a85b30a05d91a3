#!/usr/bin/env bash
# The test suite: unit, property, conformance, two-process and two-namespace tests.
# Installs what it needs first (ci/setup.sh). GPU tests are separate: see docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/setup.sh
exec cargo test --workspace --release --features rucx/tokio "$@"
