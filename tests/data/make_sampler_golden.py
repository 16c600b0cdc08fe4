#!/usr/bin/python3
"""Writes tests/data/golden/distributed_sampler.json: the indices that PyTorch's
torch.utils.data.DistributedSampler yields for many (dataset size, num_replicas, rank, shuffle,
seed, epoch, drop_last) cases. dtrain's C++ DistributedSampler must reproduce every one.

Run once with the Debian torch (/usr/bin/python3 tests/data/make_sampler_golden.py) and check the
output in. Layout: {"torch": ..., "cases": [ {...}, ... ]}, one case object per line, keys
n, num_replicas, rank, shuffle, seed, epoch, drop_last, num_samples, total_size, indices.
"""
import json
import os

import torch
from torch.utils.data import DistributedSampler


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def case(n, replicas, rank, shuffle, seed, epoch, drop_last):
    s = DistributedSampler(Sized(n), num_replicas=replicas, rank=rank, shuffle=shuffle,
                           seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    idx = [int(i) for i in s]
    assert len(idx) == len(s)
    return {"n": n, "num_replicas": replicas, "rank": rank, "shuffle": shuffle, "seed": seed,
            "epoch": epoch, "drop_last": drop_last, "num_samples": len(s),
            "total_size": s.total_size, "indices": idx}


def main():
    cases = []
    for n in (0, 1, 7, 10, 100, 101):
        for replicas in (1, 2, 3, 4):
            for rank in range(replicas):
                for drop_last in (False, True):
                    for shuffle in (False, True):
                        seeds = (0, 1234) if shuffle else (0,)
                        epochs = (0, 1, 5) if shuffle else (0, 5)
                        for seed in seeds:
                            for epoch in epochs:
                                cases.append(case(n, replicas, rank, shuffle, seed, epoch,
                                                  drop_last))
    # Fewer replicas than samples needed, large / negative seeds, a bigger world.
    for n, replicas, seed, epoch in ((1, 4, 0, 0), (2, 7, 3, 2), (5, 16, 9, 1),
                                     (1000, 8, 2**33 + 5, 3), (37, 5, -1, 0), (37, 5, -7, 4)):
        for rank in range(replicas):
            for drop_last in (False, True):
                cases.append(case(n, replicas, rank, True, seed, epoch, drop_last))

    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(here, "golden", "distributed_sampler.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write('{"torch": %s,\n "cases": [\n' % json.dumps(torch.__version__))
        f.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
        f.write("\n]}\n")
    print("wrote %d cases to %s" % (len(cases), out))


if __name__ == "__main__":
    main()
