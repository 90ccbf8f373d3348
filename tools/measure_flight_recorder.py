#!/usr/bin/env python
"""What the flight recorder costs a training step: blocks of steps with it and without it, in turn,
in one job (both ranks switch at the same step), so the machine's drift cancels out.

    horovodrun -np 2 python tools/measure_flight_recorder.py --model resnet20 --blocks 8 --steps 20

The step is the trainers' own (benchmark.py's workloads: the CNN's and BERT's Trainer on synthetic
data); the recorder hooks horovod.torch's submissions and synchronize (runtime/collectives.py
record_into) and is switched in and out between blocks. Prints each model's step time with and
without, the median of the blocks' ratios, and the collectives a step records.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import os  # noqa: E402

os.environ["HVDTRAIN_FLIGHT_RECORDER"] = "0"  # dist.init installs none: this tool switches its own

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

from hvdtrain.bench import backends, workloads  # noqa: E402
from hvdtrain.liveness import recorder as flight  # noqa: E402
from hvdtrain.runtime import collectives  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet20", help="a benchmark.py model: resnet20, bert-tiny, ...")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, help="the CNN's input size (default: the model's own)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of each kind, in turn")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    return parser.parse_args()


def main():
    args = parse_args()
    options = SimpleNamespace(model=args.model, batch_size=args.batch_size, seq_length=128, vocab_size=30522,
                              image_size=args.image_size, channels_last=False, precision="fp32", amp=False, compile=False,
                              accumulation_steps=1, seed=0, cpu=True, threads=None, fp16_allreduce=False,
                              horovod_timeline=None, horovod_autotune=False, horovod_autotune_log=None)
    backend = backends.HorovodBackend(options)  # Horovod: hvd.init(), the ranks' context
    torch.manual_seed(0)
    workload = workloads.build(options, backend)
    recorder = flight.install(backend.rank)
    spent = time_spent_in(recorder)
    switch = collectives.record_into(recorder)
    for _ in range(5):
        workload.step()
    seconds = {True: [], False: []}
    recorded_before, spent[0] = recorder.seq, 0.0
    for block in range(2 * args.blocks):
        on = block % 2 == 0
        switch(on)
        backend.barrier()
        started = time.perf_counter()
        for _ in range(args.steps):
            workload.step()
        seconds[on].append((time.perf_counter() - started) / args.steps)
    steps_on = args.blocks * args.steps
    per_step = (recorder.seq - recorded_before) / steps_on
    ratios = [with_ / without for with_, without in zip(seconds[True], seconds[False])]
    own = spent[0] / steps_on  # the recorder's own time per step, timed inside it
    if backend.rank == 0:
        print(f"{args.model}, {backend.size} ranks, batch {args.batch_size}: step "
              f"{1000 * statistics.median(seconds[True]):.1f} ms with the recorder, "
              f"{1000 * statistics.median(seconds[False]):.1f} ms without; median ratio {statistics.median(ratios):.4f} "
              f"(blocks: {', '.join(f'{r:.3f}' for r in ratios)}); {per_step:.0f} records per step, "
              f"{spent[1] / steps_on:.0f} calls; the recorder's own time {1e6 * own:.0f} us per step, "
              f"{100 * own / statistics.median(seconds[False]):.2f} % of the step")


def time_spent_in(recorder):
    """[seconds, calls] inside the recorder's submitted, completed, wait_started and wait_ended (the
    synchronize hook's two calls), each wrapped with a timer."""
    spent = [0.0, 0]
    for name in ("submitted", "completed", "wait_started", "wait_ended"):
        method = getattr(recorder, name)

        def timed(*args, _method=method, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
                spent[1] += 1
        setattr(recorder, name, timed)
    return spent


if __name__ == "__main__":
    main()
