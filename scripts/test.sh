#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs every test under CTest.
# Every test has a timeout (tests/CMakeLists.txt), so nothing can hang.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j 2 --timeout 600
