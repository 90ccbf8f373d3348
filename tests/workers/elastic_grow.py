"""Elastic Horovod worker for the host-discovery test: runs until the job has grown.

    horovodrun -np 1 --min-np 1 --max-np 2 --host-discovery-script ... \
        python tests/workers/elastic_grow.py OUTPUT_DIR TARGET_SIZE

Every rank steps (one allreduce, a commit) and appends the world size it saw to
OUTPUT_DIR/sizes-rank<R>.txt; once the world has TARGET_SIZE ranks it takes a
few more steps and exits 0. It gives up (exit 1) after 120 s of waiting.
"""
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd

EXTRA_STEPS = 3
GIVE_UP_SECONDS = 120


def main():
    output_dir, target = Path(sys.argv[1]), int(sys.argv[2])
    output_dir.mkdir(parents=True, exist_ok=True)
    hvd.init()
    state = hvd.elastic.TorchState(steps_at_target=0)  # Horovod: synced and restored on resets
    started = time.monotonic()

    @hvd.elastic.run
    def train(state):
        while state.steps_at_target < EXTRA_STEPS:
            if time.monotonic() - started > GIVE_UP_SECONDS:
                sys.exit(f"rank {hvd.rank()}: world never reached {target} ranks")
            # Horovod: a collective that must include every current rank.
            total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="count").item()
            with open(output_dir / f"sizes-rank{hvd.rank()}.txt", "a") as handle:
                handle.write(f"{hvd.size()} {int(total)}\n")
            if hvd.size() == target:
                state.steps_at_target += 1
            time.sleep(0.2)
            state.commit()  # Horovod: new hosts are let in at a commit

    train(state)


if __name__ == "__main__":
    main()
