#!/usr/bin/env bash
# Runs the whole test suite: setup if needed (packages, npm tools), build everything (tests
# and benchmarks too; the CUDA backend where the toolkit is, even after a demo left it out),
# then ctest.
#   scripts/test.sh [extra ctest arguments, e.g. -R tokenizer]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD_DIR=${CONVEYOR_BUILD_DIR:-build}
exec ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" --timeout 900 "$@"
