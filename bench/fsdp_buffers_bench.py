#!/usr/bin/env python3
"""FSDP's buffers reused (issue 32 item 2; Design note [buffers reused], util/block_pool.h): peak RSS
per rank, the counted tensor peak and tokens/s of FSDP at W = 2 for this checkout against another
build (--old: a checkout built with scripts/build.sh, e.g. `git worktree add /tmp/old 297b3a6`),
runs interleaved. Issue 32's state-heavy GPT (8 layers, d_model 256, T 32, batch 2, 1 thread) and
the 25.5M one (d_model 512, units of 12.6 MiB, where FSDP fixes glibc's mmap threshold at 1 MiB:
Design note [freed memory]), under glibc (`--allocator system`) and tcmalloc; on glibc at d_model 512
also with the fix defeated (MALLOC_MMAP_THRESHOLD_=32 MiB, glibc's largest).

  python3 bench/fsdp_buffers_bench.py --old /tmp/old --repeats 3 --out bench/results/fsdp-buffers-w2.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import read_run  # noqa: E402


def one(root, allocator, dmodel, heads, env_extra, tag, steps=20):
    m = os.path.join(TMP, 'm-%s.jsonl' % tag)
    if os.path.exists(m): os.remove(m)
    env = dict(os.environ); env.update(env_extra)
    cmd = [root + '/build/bin/dtrun', '--standalone', '--nproc-per-node', '2', '--allocator', allocator, '--bind-cores', 'off',
           root + '/build/bin/dtrain-gpt', '--strategy', 'fsdp', '--layers', '8', '--d-model', str(dmodel), '--heads', str(heads),
           '--seq-len', '32', '--batch-size', '2', '--steps', str(steps), '--threads', '1', '--metrics', m]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode: print(r.stdout[-2000:]); sys.exit(1)
    start, st, final = read_run(m)
    timed = st[3:]
    tok = sum(s['tokens_per_s'] * s['step_time_s'] for s in timed) / sum(s['step_time_s'] for s in timed)
    return max(final['peak_rss_mib_per_rank']), max(final['peak_tensor_mib_per_rank']), tok, st[-1]['loss']

def main():
    global TMP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--old', required=True)
    ap.add_argument('--repeats', type=int, default=3)
    ap.add_argument('--out', default='')
    a = ap.parse_args()
    import tempfile
    TMP = tempfile.mkdtemp(prefix='dtrain-fsdp-buffers-')
    cells = []
    for dm, h in [(256, 4), (512, 8)]:
        for alloc in ['system', 'tcmalloc']:
            envs = [({}, 'fix')] + ([({'MALLOC_MMAP_THRESHOLD_': '33554432'}, 'nofix')] if alloc == 'system' and dm == 512 else [])
            for e, en in envs:
                for root, rn in [(ROOT, 'new'), (a.old, 'old')]:
                    cells.append((dm, h, alloc, e, en, root, rn))
    res = {}
    for rep in range(a.repeats):
        for c in cells:
            dm, h, alloc, e, en, root, rn = c
            key = '%d %s %s %s' % (dm, alloc, en, rn)
            r = one(root, alloc, dm, h, e, key.replace(' ', '_'))
            res.setdefault(key, []).append(r)
            print(key, 'RSS %.0f tensors %.1f tok/s %.0f loss %.4f' % r, flush=True)
    print()
    for k, v in res.items():
        print('%-28s RSS %.0f  tensors %.1f  tok/s median %.0f  (%s)' % (k, statistics.median(x[0] for x in v), v[0][1],
              statistics.median(x[2] for x in v), ', '.join('%.0f' % x[2] for x in v)))
    if a.out:
        with open(a.out, 'w') as f:
            json.dump({'old': a.old, 'repeats': a.repeats, 'runs': res}, f, indent=1)


TMP = ''
if __name__ == '__main__':
    main()
