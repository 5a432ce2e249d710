#!/usr/bin/env bash
# The test suite: prepares the test data (scripts/setup.sh, instant when done) and runs every
# test of the workspace in release mode (the tests run real models). Ends with one summary
# line, "tests: N passed, M failed".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --release --lib --bins --tests 2>&1 | tee "$log" || status=${PIPESTATUS[0]}
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
