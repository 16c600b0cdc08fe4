#!/bin/sh
# Runs a command with a per-process memory limit: bench/memory_limit.sh MIB command args...
# Each invocation gets a cgroup (v1 memory controller, as root) of its own, so under dtrun every
# worker has its own limit; a worker that goes over it is killed by the kernel (SIGKILL), which dtrun
# names. Used by bench/pipeline_bench.py --part limit.
set -e
mib=$1
shift
cg=/sys/fs/cgroup/memory/dtrain-bench-$$
mkdir "$cg"
echo $((mib * 1024 * 1024)) > "$cg/memory.limit_in_bytes"
[ -f "$cg/memory.memsw.limit_in_bytes" ] && echo $((mib * 1024 * 1024)) > "$cg/memory.memsw.limit_in_bytes" || true
echo $$ > "$cg/cgroup.procs"
exec "$@"
