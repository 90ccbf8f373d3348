"""A resumable stand-in for a training script, for the launcher and Slurm tests.

    python tests/workers/preemptible.py OUTPUT_DIR TOTAL_STEPS [SECONDS_PER_STEP]

Like the real scripts it resumes from its checkpoint in OUTPUT_DIR, and on
SIGUSR1/SIGTERM every rank finishes its step, rank 0 checkpoints, all exit 0
(hvdtrain.signals.StopRequest). Each rank appends what happened to
OUTPUT_DIR/events-rank<R>.jsonl: start, stop (with the signal this rank got
itself, or null when it only followed the others) and done, with its host.
"""
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd

from hvdtrain.runtime import collectives, dist, signals


def record(output_dir, rank, **event):
    event.update(rank=rank, host=socket.gethostname(), pid=os.getpid(),
                 restart=int(os.environ.get("SLURM_RESTART_COUNT", 0)))
    with open(output_dir / f"events-rank{rank}.jsonl", "a") as handle:
        handle.write(json.dumps(event) + "\n")


def main():
    output_dir, total = Path(sys.argv[1]), int(sys.argv[2])
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
    stop = signals.StopRequest()
    ctx = dist.init()
    output_dir.mkdir(parents=True, exist_ok=True)
    state_path = output_dir / "state.json"
    saved = json.loads(state_path.read_text()) if ctx.is_main and state_path.exists() else None
    start = collectives.broadcast_object(saved, root_rank=0, name="state")  # Horovod: rank 0's checkpoint
    step = start["step"] if start else 0
    record(output_dir, ctx.rank, event="start", size=ctx.size, step=step)
    while step < total:
        time.sleep(seconds)
        # Horovod: one allreduce per step, as in training.
        hvd.allreduce(torch.ones(1), name="step")
        step += 1
        if stop.poll():  # the stop vote: an allreduce, then who was signalled
            if ctx.is_main:
                state_path.write_text(json.dumps({"step": step}))
            record(output_dir, ctx.rank, event="stop", step=step, signal=stop.received)
            return
    record(output_dir, ctx.rank, event="done", step=step)


if __name__ == "__main__":
    main()
