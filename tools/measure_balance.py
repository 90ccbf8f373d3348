#!/usr/bin/env python
"""train_cnn.py on 2 ranks with rank 1 held to a fraction of a core: equal split against --balance.

Each round runs three launches, alternated: healthy (no throttle, equal split),
throttled with the equal split, throttled with --balance. Rank 1 is throttled
with the cgroup v1 CPU controller once training has started (root). The bound
for a throttled run: rank 0 at one core and rank 1 at SHARE of one make
(1 + SHARE) / 2 of the healthy job's compute, so a perfect split trains at
about that fraction of the healthy rate; the equal split at about SHARE.

    .venv/bin/python tools/measure_balance.py --share 0.5 --rounds 2
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from support.commands import CNN
from support.launch import launch, wait_then
from support.ranks import cpu_share, rank_pids, require_cpu_cgroup


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share", type=float, default=0.5, help="rank 1's fraction of one core")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of the three launches")
    parser.add_argument("--model", default="resnet20", help="train_cnn.py --model")
    parser.add_argument("--epochs", type=int, default=2, help="train_cnn.py --epochs")
    parser.add_argument("--interval", type=int, default=20, help="--straggler-interval (re-split cadence)")
    return parser.parse_args()


def images_per_sec(args, out, throttle, balance):
    """One launch on 2 ranks (one thread each); its results.json images/s."""
    command = ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, CNN, "--model", args.model,
               "--epochs", str(args.epochs), "--threads", "1", "--output-dir", out, "--no-resume",
               "--straggler-interval", str(args.interval), *(["--balance"] if balance else [])]
    if not throttle:
        run = launch(command, timeout=900)
    else:
        with cpu_share(args.share) as share:
            wait_then(lambda: (out / "run.lock").exists() and rank_pids(str(out), rank=1),
                      lambda: [share.add(pid) for pid in rank_pids(str(out), rank=1)], timeout=300)
            run = launch(command, timeout=900)
    if run.returncode != 0:
        sys.exit(run.describe())
    return json.loads((out / "results.json").read_text())["images_per_sec"]


def main():
    args = parse_args()
    require_cpu_cgroup()
    kinds = {"healthy": (False, False), "throttled, equal split": (True, False), "throttled, --balance": (True, True)}
    rates = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for kind, (throttle, balance) in kinds.items():
                rate = images_per_sec(args, Path(scratch) / f"{round_}-{balance}-{throttle}", throttle, balance)
                rates[kind].append(rate)
                print(f"round {round_ + 1} {kind}: {rate:.1f} images/s", flush=True)
    healthy = statistics.median(rates["healthy"])
    bound = (1 + args.share) / 2
    print(f"\n{args.model}, 2 ranks x 1 thread, rank 1 at {args.share:g} of a core; median of {args.rounds} rounds")
    print("| run | images/s | of healthy | of the bound |\n|---|---|---|---|")
    for kind, values in rates.items():
        rate = statistics.median(values)
        of_bound = f"{rate / healthy / bound:.2f}" if kind != "healthy" else ""
        print(f"| {kind} | {rate:.1f} | {rate / healthy:.2f} | {of_bound} |")
    gain = statistics.median(rates["throttled, --balance"]) / statistics.median(rates["throttled, equal split"])
    print(f"--balance over the equal split: {gain:.2f}x (bound: {bound / args.share:.2f}x)")


if __name__ == "__main__":
    main()
