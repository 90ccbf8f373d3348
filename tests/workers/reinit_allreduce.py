"""Plain Horovod worker: one grouped allreduce of about 1.1 MB before and after hvd.shutdown() and
hvd.init() in the same process, as every survivor of an elastic reset does.

    horovodrun -np 3 python tests/workers/reinit_allreduce.py

Rank 0 prints one JSON line: how many elements of the second result differ from the first's.
The inputs are the same, so 0 when the second world sums them as the first did; from three
ranks on, the ring sums an element in an order set by its place in the fused buffer, so a group
fused otherwise (split at another fusion threshold) gives other bits.
"""
import json
import sys

import torch
import horovod.torch as hvd

SIZES = [36864] * 7 + [2304] * 10 + [16] * 20  # floats: 1.13 MB in all, as ResNet-20's 1.08 MB


def summed(tensors):
    handle = hvd.grouped_allreduce_async_([t.clone() for t in tensors], name="bucket", op=hvd.Sum)
    return torch.cat(hvd.synchronize(handle))


def main():
    hvd.init()
    generator = torch.Generator().manual_seed(hvd.rank())
    tensors = [torch.randn(n, generator=generator) for n in SIZES]
    first = summed(tensors)
    hvd.shutdown()
    hvd.init()  # an elastic reset's second world, here of the same ranks
    second = summed(tensors)
    if hvd.rank() == 0:
        sys.stdout.write(json.dumps({"differing": int((first != second).sum()), "elements": first.numel()}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
