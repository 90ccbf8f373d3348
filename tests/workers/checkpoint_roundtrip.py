"""Run under horovodrun -np 2: save a checkpoint through hvdtrain's Checkpointer,
then restore it into freshly built (different) components on every rank.

    checkpoint_roundtrip.py DIR save|restore [--elements N] [--node-local]

The model is one flat parameter of N float32 elements (N = 600M makes a 2.4 GB
checkpoint, past the 2 GiB that hvd.broadcast_object cannot send) plus buffers
of other dtypes. ``--node-local``: each rank works in its own directory under
DIR, as on nodes with local disks, so only rank 0 sees the checkpoint file.
After restore every rank prints its peak RSS and the restore time, and checks
that its weights are rank 0's saved ones.
"""
import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd

from hvdtrain.runtime import collectives, dist
from hvdtrain.runtime.checkpoint import Checkpointer
from hvdtrain.runtime.rng import RngState


class Model(torch.nn.Module):
    def __init__(self, elements, fill):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((elements,), fill))
        self.register_buffer("bf16", torch.full((3, 5), fill, dtype=torch.bfloat16))
        self.register_buffer("count", torch.tensor(int(fill * 1000), dtype=torch.int64))
        self.register_buffer("mask", torch.arange(7) % 2 == 0)


class Counter:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("mode", choices=("save", "restore"))
    parser.add_argument("--elements", type=int, default=1000)
    parser.add_argument("--node-local", action="store_true")
    parser.add_argument("--write", choices=("sync", "async"), default="sync", help="--checkpoint-write")
    args = parser.parse_args()
    ctx = dist.init()
    directory = args.directory
    if args.node_local:  # a relative path that names another directory on each "node"
        node = args.directory / f"node{ctx.rank}"
        node.mkdir(parents=True, exist_ok=True)
        os.chdir(node)
        directory = Path("checkpoints")

    saving = args.mode == "save"
    # Restore into components that differ from the saved ones on every rank.
    fill = 0.25 if saving else -1.0 - ctx.rank
    model = Model(args.elements, fill)
    counter = Counter(7 if saving else 0)
    checkpointer = Checkpointer(ctx, directory, shared={"model": model}, per_rank={"rng": RngState(0),
                                "counter": Counter(100 + ctx.rank if saving else -1)}, keep=2,
                                write_mode=args.write)
    checkpointer.shared["counter"] = counter
    if saving:
        checkpointer.save(step=5, settings={"elements": args.elements})
        # Training goes on while an async write is in flight: the file holds what was saved.
        model.weight.data.fill_(9.0)
        checkpointer.wait_for_writes()
        print(f"rank {ctx.rank}: saved", flush=True)
        return

    started = time.perf_counter()
    state = checkpointer.restore()
    seconds = time.perf_counter() - started
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert state is not None, "no checkpoint restored"
    ok = (bool((model.weight == 0.25).all()) and bool((model.bf16 == 0.25).all())
          and int(model.count) == 250 and model.mask.tolist() == [True, False] * 3 + [True]
          and counter.value == 7 and checkpointer.per_rank["counter"].value == 100 + ctx.rank)
    # Horovod: every rank's verdict.
    all_ok = collectives.all_ranks_true(ok)
    print(f"rank {ctx.rank}: restored {'ok' if ok else 'WRONG'} in {seconds:.1f} s, "
          f"peak RSS {peak_gib:.2f} GiB, all ranks ok: {all_ok}", flush=True)
    hvd.shutdown()
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
