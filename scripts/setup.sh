#!/usr/bin/env bash
# The first command: installs what is missing (Debian packages only), builds dtrain, and runs the
# demo: a byte-level GPT trained with DDP on 2 local ranks, started by dtrun.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --all
scripts/build.sh
echo
echo "== demo: build/bin/dtrun --standalone --nproc-per-node 2 build/bin/dtrain-gpt --strategy ddp --steps 200"
build/bin/dtrun --standalone --nproc-per-node 2 build/bin/dtrain-gpt --strategy ddp --steps 200 \
  --metrics build/demo-metrics.jsonl
echo "metrics: build/demo-metrics.jsonl"
