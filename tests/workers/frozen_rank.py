"""Run under horovodrun -np 2: rank 1 freezes (alive, silent) after init.

Rank 0 then waits in an allreduce that rank 1 never joins. hvdtrain.dist.init
starts the progress watchdog, so the job must end instead of hanging.
"""
import time

import torch
import horovod.torch as hvd

from hvdtrain.runtime import dist


def main():
    ctx = dist.init()
    if ctx.rank == 1:
        time.sleep(3600)  # frozen: alive, never calls a collective again
    print("rank 0 waiting in allreduce", flush=True)
    hvd.allreduce(torch.ones(1), name="never_completes")
    print("allreduce returned: should not happen", flush=True)


if __name__ == "__main__":
    main()
