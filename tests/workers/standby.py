"""Elastic Horovod worker for the standby tests: workers that are slow to start.

    horovodrun ... python tests/workers/standby.py OUTPUT_DIR START_SECONDS [SIZE]

Every rank steps (one allreduce, a commit, 0.1 s apart) and appends "TIME PID SIZE" to
OUTPUT_DIR/steps-rank<R>.txt. Each process writes OUTPUT_DIR/started-<PID>.txt: the rank
it was started as (-1: started ahead of its world by Horovod's driver, standing by for a
slot). A process started once the job trains sleeps START_SECONDS before hvd.init(), a
stand-in for Python and framework imports on a loaded node. Once the world has been through
a reset (a slot added, a worker lost) and taken EXTRA_STEPS steps at SIZE ranks (2) since,
every rank exits 0; after GIVE_UP_SECONDS, 1.
"""
import os
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd

EXTRA_STEPS = 5
GIVE_UP_SECONDS = 90


def main():
    output_dir, start_seconds = Path(sys.argv[1]), float(sys.argv[2])
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"started-{os.getpid()}.txt").write_text(os.environ["HOROVOD_RANK"])
    training = output_dir / "training"
    reset_seen = [training.exists()]  # a process started while the job trains joins after a reset
    if reset_seen[0]:
        time.sleep(start_seconds)
    hvd.init()
    state = hvd.elastic.TorchState(steps_after_reset=0)  # Horovod: synced and restored on resets
    state.register_reset_callbacks([lambda: reset_seen.__setitem__(0, True)])
    started = time.monotonic()

    @hvd.elastic.run
    def train(state):
        while state.steps_after_reset < EXTRA_STEPS:
            if time.monotonic() - started > GIVE_UP_SECONDS:
                sys.exit(f"rank {hvd.rank()}: no reset to a world of {size} within {GIVE_UP_SECONDS} s")
            # Horovod: a collective of every current rank; it also tells every rank whether any
            # has been through a reset (the state a reset restores is the last commit's).
            after_reset = hvd.allreduce(torch.tensor([float(reset_seen[0])]), op=hvd.Max, name="reset_seen").item()
            with open(output_dir / f"steps-rank{hvd.rank()}.txt", "a") as steps:
                steps.write(f"{time.time():.3f} {os.getpid()} {hvd.size()}\n")
            training.touch()
            if after_reset and hvd.size() == size:
                state.steps_after_reset += 1
            time.sleep(0.1)
            state.commit()  # Horovod: a new slot is let in at a commit

    train(state)


if __name__ == "__main__":
    main()
