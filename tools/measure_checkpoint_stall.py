"""What a checkpoint costs the step that takes it: --checkpoint-write sync against async.

    python tools/measure_checkpoint_stall.py --model bert-large --batch-size 2 --output runs/ckpt-bert-large.json
    python tools/measure_checkpoint_stall.py --model resnet50 --batch-size 8

The trainers' own step (benchmark.py's workloads: train_cnn.py's or pretrain_bert.py's
``Trainer.forward_backward`` and ``step`` on synthetic data) and their own ``Checkpointer`` (model and
optimizer as shared components, one rank), every ``--every`` steps a checkpoint, in
one process per mode so that each mode's peak RSS is its own. Measured per mode:
the plain step, the checkpointing step (the step plus ``Checkpointer.write``; async:
the gather and the copy to host memory), the steps begun while a background write
was in flight, a whole cycle of --every steps with its checkpoint against as many plain steps, the copy alone and the file's write (durations), and the peak RSS. The
bound of a checkpointing step under async is a plain step plus the copy: its ratio to
that bound is printed. Medians over the checkpoints; modes alternate round by round.
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

MODES = ("sync", "async")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="a benchmark.py model (resnet50, bert-large, ...)")
    parser.add_argument("--batch-size", type=int, default=8, help="per step")
    parser.add_argument("--seq-length", type=int, default=128, help="BERT")
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints timed per round and mode")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the modes alternating")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--dir", type=Path, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--output", type=Path, help="the figures as JSON")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one measuring process
    return parser.parse_args()


def measure(args, directory):
    """One mode in this process: a dict of its figures."""
    import torch
    from hvdtrain import durations
    from hvdtrain.bench import backends, workloads
    from hvdtrain.runtime.checkpoint import Checkpointer

    options = SimpleNamespace(model=args.model, batch_size=args.batch_size, seq_length=args.seq_length,
                              vocab_size=30522, image_size=None, channels_last=False, precision="fp32", amp=False,
                              compile=False, accumulation_steps=1, seed=0, cpu=True, threads=None,
                              fp16_allreduce=False, horovod_timeline=None, horovod_autotune=False,
                              horovod_autotune_log=None)
    backend = backends.HorovodBackend(options)  # Horovod: hvd.init(), one rank
    workload = workloads.build(options, backend)
    trainer = workload.trainer
    checkpointer = Checkpointer(backend.ctx, directory, shared={"model": trainer.model, "optimizer": trainer.optimizer},
                                per_rank={}, keep=2, write_mode=args.mode)
    state_bytes = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
    for _ in range(args.warmup_steps):
        workload.step()
    plain, checkpointing, in_flight, cycles = [], [], [], []
    step = 0
    for _ in range(args.checkpoints):
        cycle_started = time.perf_counter()
        for index in range(args.every):
            step += 1
            started = time.perf_counter()
            busy = checkpointer.writer.busy
            workload.step()
            if index < args.every - 1:
                (in_flight if busy else plain).append(time.perf_counter() - started)
                continue
            checkpointer.write(step, {"model": args.model})
            checkpointing.append(time.perf_counter() - started)
        cycles.append(time.perf_counter() - cycle_started)
    started = time.perf_counter()
    checkpointer.wait_for_writes()
    final_wait = time.perf_counter() - started
    seen = durations.summary()
    copy = seen.get("copying the checkpoint to host memory", {})
    write = seen.get("writing a checkpoint file", {})
    return {"mode": args.mode, "model_bytes": state_bytes, "every": args.every,
            "checkpoint_bytes": max(p.stat().st_size for p in Path(directory).glob("step-*.pt")),
            "plain_step_s": plain, "checkpointing_step_s": checkpointing, "in_flight_step_s": in_flight,
            "cycle_s": cycles,
            "copy_s": copy.get("total_s", 0.0) / max(1, copy.get("count", 1)),
            "write_s": write.get("total_s", 0.0) / max(1, write.get("count", 1)),
            "final_wait_s": final_wait, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "threads": torch.get_num_threads()}


def args_every(runs):
    return runs[0]["every"]


def median(values):
    return statistics.median(values) if values else float("nan")


def summarise(runs):
    """Per mode: medians over every round."""
    by_mode = {}
    for run in runs:
        kept = by_mode.setdefault(run["mode"], {"plain_step_s": [], "checkpointing_step_s": [], "in_flight_step_s": [],
                                                "cycle_s": [], "copy_s": [], "write_s": [], "peak_rss_gib": []})
        for key in kept:
            kept[key] += run[key] if isinstance(run[key], list) else [run[key]]
    summary = {}
    for mode, kept in by_mode.items():
        figures = {key: median(values) for key, values in kept.items()}
        figures["peak_rss_gib"] = max(kept["peak_rss_gib"])
        bound = figures["plain_step_s"] + (figures["copy_s"] if mode == "async" else figures["write_s"])
        figures["checkpointing_step_over_plain_plus_copy"] = figures["checkpointing_step_s"] / bound
        figures["cycle_over_plain_steps"] = figures["cycle_s"] / (args_every(runs) * figures["plain_step_s"])
        summary[mode] = figures
    return summary


def main():
    args = parse_args()
    if args.mode:
        print(json.dumps(measure(args, args.dir)), flush=True)
        return
    runs = []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for round_index in range(args.rounds):
            for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
                directory = Path(scratch) / f"{mode}-{round_index}"
                command = [sys.executable, __file__, "--mode", mode, "--dir", str(directory),
                           *sum(([f"--{key.replace('_', '-')}", str(value)] for key, value in vars(args).items()
                                 if key not in ("mode", "dir", "output", "rounds") and value is not None), [])]
                done = subprocess.run(command, check=True, capture_output=True, text=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = summarise(runs)
    first = runs[0]
    print(f"{args.model} batch {args.batch_size}, checkpoint every {args.every} steps: "
          f"{first['checkpoint_bytes'] / 2**30:.2f} GiB checkpoint, {first['threads']} thread(s)")
    for mode, figures in summary.items():
        print(f"  {mode:5s}: plain step {figures['plain_step_s']:.3f} s, checkpointing step "
              f"{figures['checkpointing_step_s']:.3f} s (copy {figures['copy_s']:.3f} s, file write "
              f"{figures['write_s']:.3f} s), steps during a write {figures['in_flight_step_s']:.3f} s, "
              f"peak RSS {figures['peak_rss_gib']:.2f} GiB; checkpointing step / (plain step + "
              f"{'copy' if mode == 'async' else 'write'}) = {figures['checkpointing_step_over_plain_plus_copy']:.3f}; "
              f"{args.every} steps with a checkpoint / {args.every} plain steps = {figures['cycle_over_plain_steps']:.3f}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"runs": runs, "summary": summary, "arguments": vars(args)}, default=str,
                                          indent=1))


if __name__ == "__main__":
    main()
