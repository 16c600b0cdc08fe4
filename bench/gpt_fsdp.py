"""The PyTorch FSDP peer of `dtrain-gpt --strategy fsdp` for bench/fsdp_bench.py: bench/gpt_ddp.py's
model, data, optimizer, training loop and metrics, with
torch.distributed.fsdp.FullyShardedDataParallel (one unit per GPTBlock, full shard) in place of
DistributedDataParallel.

PyTorch 1.13's FSDP does not run on CPU: with Debian's python3-torch it fails twice, and this
script reports each failure as one line on stderr, "gpt_fsdp: <stage>: <Type>: <message>
(<file>:<line> in <function>, ...)", so the benchmark can quote it:
  stage "import"  importing torch.distributed.fsdp on Python 3.11 (a dataclass with a mutable
                  default in torch.distributed._shard); the script then retries the import with
                  that worked around (dataclass defaults turned into default factories) to get
                  further;
  stage "wrap"    FullyShardedDataParallel(...) itself (its compute device is always a CUDA one).
Exit status 3 when it could not train; otherwise it trains and writes the metrics as gpt_ddp.py.

  /usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 --standalone \
      --nproc-per-node 2 bench/gpt_fsdp.py --threads 1 --steps 30 --metrics /tmp/py.jsonl
"""
import copy
import dataclasses
import functools
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_ddp  # noqa: E402
from gpt_model import GPTBlock  # noqa: E402


def one_line(stage, exc):
    """'<stage>: <Type>: <last line of the message> (<file>:<line> in <function>)' at the innermost
    frame, and at the innermost frame of torch.distributed when that is another one."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = [frames[-1]] + [f for f in reversed(frames) if "/torch/distributed/" in f.filename][:1]
    if len(where) == 2 and where[1] is where[0]:
        where.pop()
    message = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    return "%s: %s: %s (%s)" % (stage, type(exc).__name__, message, ", from ".join(
        "%s:%d in %s" % (os.path.basename(f.filename), f.lineno, f.name) for f in where))


def report(line):
    sys.stderr.write("gpt_fsdp: %s\n" % line)
    sys.stderr.flush()


def _defaults_as_factories(process_class):
    """dataclasses._process_class that turns unhashable field defaults into default factories (what
    Python 3.11 demands and torch 1.13's torch.distributed._shard does not do)."""
    def process(cls, *args, **kwargs):
        for name in cls.__dict__.get("__annotations__", {}):
            value = cls.__dict__.get(name, dataclasses.MISSING)
            if isinstance(value, dataclasses.Field):
                if value.default is not dataclasses.MISSING and type(value.default).__hash__ is None:
                    value.default_factory = functools.partial(copy.deepcopy, value.default)
                    value.default = dataclasses.MISSING
            elif value is not dataclasses.MISSING and type(value).__hash__ is None:
                setattr(cls, name, dataclasses.field(default_factory=functools.partial(copy.deepcopy, value)))
        return process_class(cls, *args, **kwargs)
    return process


def import_fsdp():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ValueError as e:
        report(one_line("import", e))
        for name in [m for m in sys.modules if m.startswith("torch.distributed.fsdp") or
                     m.startswith("torch.distributed._shard")]:
            del sys.modules[name]
        original = dataclasses._process_class
        dataclasses._process_class = _defaults_as_factories(original)
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel
        finally:
            dataclasses._process_class = original
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    return FullyShardedDataParallel, functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPTBlock})


def main():
    try:
        fsdp_class, policy = import_fsdp()
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        report(one_line("import", e))
        os._exit(3)

    def wrap(model, bucket_cap_mb):  # in place of gpt_ddp's DistributedDataParallel
        del bucket_cap_mb
        try:
            return fsdp_class(model, auto_wrap_policy=policy)
        except Exception as e:  # noqa: BLE001
            report(one_line("wrap", e))
            sys.stdout.flush()
            os._exit(3)

    gpt_ddp.DDP = wrap
    gpt_ddp.main()


if __name__ == "__main__":
    main()
