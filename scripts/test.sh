#!/usr/bin/env bash
# The test suite: prepares the test data (scripts/setup.sh, instant when done) and runs every
# test of the workspace in release mode (the tests run real models).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cargo test --workspace --release
