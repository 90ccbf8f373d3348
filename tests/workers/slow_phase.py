"""Run under horovodrun -np 2 with a short HVDTRAIN_WATCHDOG_SECONDS.

Rank 0 spends SECONDS in one legitimate long step of work (standing for a 4 GB
checkpoint write on a slow shared file system) while rank 1 waits for it in a
collective, as the trainers do around checkpoints. With ``phase`` both wait
inside ``watchdog.phase(...)`` and the job must survive; with ``bare`` the
watchdog must end it (the limit is really that short).
"""
import sys
import time
from contextlib import nullcontext

from hvdtrain.runtime import collectives, dist


def main():
    mode, seconds = sys.argv[1], float(sys.argv[2])
    ctx = dist.init()
    for step in range(3):
        with ctx.watchdog.phase("writing a checkpoint") if mode == "phase" else nullcontext():
            if ctx.is_main:
                time.sleep(seconds)
            collectives.all_ranks_true(True)  # the others wait here for rank 0
        ctx.watchdog.beat()
        print(f"rank {ctx.rank}: step {step} done", flush=True)


if __name__ == "__main__":
    main()
