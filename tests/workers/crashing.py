"""Elastic Horovod worker whose second slot keeps failing: the host failure window tests.

    horovodrun ... python tests/workers/crashing.py OUTPUT_DIR FAILURES LIFETIME_SECONDS

Every rank steps (one allreduce, a commit, 0.1 s apart). The process in local slot 1 exits 1
LIFETIME_SECONDS after its hvd.init() (0: at once, a worker that fails at its start-up),
leaving OUTPUT_DIR/failed-<PID>, until FAILURES such exits have happened. Once they have and
the world has taken EXTRA_STEPS steps at 2 ranks since, every rank exits 0; after
GIVE_UP_SECONDS, 1.
"""
import os
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd

EXTRA_STEPS = 5
GIVE_UP_SECONDS = 120


def failures(output_dir):
    return len(list(output_dir.glob("failed-*")))


def main():
    output_dir, wanted, lifetime = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    output_dir.mkdir(parents=True, exist_ok=True)
    hvd.init()
    born = time.monotonic()
    state = hvd.elastic.TorchState(steps_after_failures=0)  # Horovod: synced and restored on resets

    @hvd.elastic.run
    def train(state):
        while state.steps_after_failures < EXTRA_STEPS:
            if time.monotonic() - born > GIVE_UP_SECONDS:
                sys.exit(f"rank {hvd.rank()}: {failures(output_dir)} of {wanted} failures within {GIVE_UP_SECONDS} s")
            if hvd.local_rank() == 1 and failures(output_dir) < wanted and time.monotonic() - born >= lifetime:
                (output_dir / f"failed-{os.getpid()}").touch()
                os._exit(1)  # a crash: no goodbye to the peers
            # Horovod: a collective of every current rank, which also agrees on whether the
            # failures are over (the files are on one host, but a rank may look before another)
            over = hvd.allreduce(torch.tensor([float(failures(output_dir) >= wanted)]), op=hvd.Min, name="over").item()
            if over and hvd.size() == 2:
                state.steps_after_failures += 1
            time.sleep(0.1)
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
