"""benchmark.py tune: the Horovod settings that train fastest on your own nodes, found once per cluster.

Launches `benchmark.py train` under horovodrun for every combination of fusion
threshold, cycle time and gradient compression (and Horovod's own defaults),
after one uncounted warm-up launch, in interleaved rounds as compare does, each
round starting at another place in the grid, so that drift hits every
combination alike; takes each one's median throughput over the rounds and writes the
fastest as a profile (the defaults, unless it beats them by more than the
spread between rounds of the same settings) that both trainers read with ``--horovod-profile FILE`` (or
HVDTRAIN_HOROVOD_PROFILE; runtime/horovod_profile.py):

    python scripts/benchmark.py tune --np 8 --horovodrun-args "-H a:4,b:4" -- --model resnet50
    horovodrun -np 8 -H a:4,b:4 python scripts/train_cnn.py --horovod-profile runs/tune/horovod-profile.json

Tune with the model, batch size and launch the training will use: the best
fusion threshold and cycle time follow the gradient sizes, the step time and
the link.
"""
import itertools
import shlex

from hvdtrain.bench.record import command_line, summarize, write_json
from hvdtrain.bench.scaling import launch_train
from hvdtrain.runtime import horovod_profile

DEFAULTS = "the defaults"  # no Horovod variable set: Horovod's own, and dist.init's under Gloo



def candidates(args):
    """{name: (fusion MiB or None, cycle ms or None, fp16)}: Horovod's defaults first, then the grid."""
    found = {DEFAULTS: (None, None, False)}
    for fusion, cycle, compression in itertools.product(args.fusion_mb, args.cycle_ms, args.compression):
        found[f"fusion {fusion} MiB, cycle {cycle:g} ms, {compression}"] = (fusion, cycle, compression == "fp16")
    return found


def knob_arguments(fusion, cycle, fp16):
    return [*(["--fusion-threshold-mb", str(fusion)] if fusion is not None else []),
            *(["--cycle-time-ms", f"{cycle:g}"] if cycle is not None else []),
            *(["--fp16-allreduce"] if fp16 else [])]


def run(args):
    args.output_dir.mkdir(parents=True, exist_ok=True)
    grid = candidates(args)
    names = list(grid)
    rates = {name: [] for name in grid}
    # One launch first, not counted: the first of a series is slower (files not yet cached,
    # a machine settling), and whichever settings came first would pay for it.
    launch_train(args, args.np, args.train_args, args.output_dir / "warmup.json")
    for repeat in range(args.repeats):
        # Each round starts elsewhere in the grid, so that no settings always run first or last.
        start = repeat * len(names) // args.repeats
        for index in [*range(start, len(names)), *range(start)]:
            name = names[index]
            result = launch_train(args, args.np, [*args.train_args, *knob_arguments(*grid[name])],
                                  args.output_dir / f"run{index}-{repeat}.json")
            rates[name].append(result["total"]["median"])
            unit, environment = result["unit"], result["environment"]
    rows = [{"name": name, "fusion_mb": grid[name][0], "cycle_ms": grid[name][1], "fp16_allreduce": grid[name][2],
             "rates": rates[name], "median": summarize(rates[name])["median"]} for name in grid]
    default = rows[0]["median"]
    for row in rows:
        row["of_defaults"] = row["median"] / default
    best, fastest, noise = choose(rows)
    tuned_on = {"np": args.np, "controller": args.controller, "horovodrun_args": args.horovodrun_args,
                "train_args": shlex.join(args.train_args), "unit": unit, "rate": best["median"],
                "of_defaults": best["of_defaults"], "host": environment["host"], "cpu": environment["cpu"],
                "date": environment["date"],
                "command": command_line()}
    profile = horovod_profile.write(args.output_dir / "horovod-profile.json", best["fusion_mb"], best["cycle_ms"],
                                    best["fp16_allreduce"], tuned_on)
    write_json({"mode": "tune", "rows": rows, "best": best["name"], "fastest": fastest["name"], "noise": noise,
                "profile": str(profile), "environment": {**environment, "command": command_line()}},
               args.output_dir / "tune.json")
    report(rows, best, unit)
    print(f"noise (the median spread between rounds of the same settings): {noise:.1%}"
          + ("" if args.repeats > 1 else "; one round measures none: use --repeats 2 or more"), flush=True)
    if best is not fastest:
        print(f"the fastest, {fastest['name']}, is {fastest['of_defaults'] - 1:.1%} above the defaults: within "
              f"the noise, so the profile keeps {DEFAULTS}", flush=True)
    print(f"wrote {profile} (read by the trainers' --horovod-profile) and {args.output_dir / 'tune.json'}",
          flush=True)


def choose(rows):
    """(the settings to write, the fastest by median, the noise). The noise is the typical
    spread between rounds of the same settings: the median over the rows of (max - min) /
    median. The fastest is taken only when it beats the defaults (rows[0]) by more than that;
    a smaller gain is this machine's run-to-run variation, and the defaults stay. With one
    round there is no spread to measure: the fastest is taken."""
    fastest = max(rows, key=lambda row: row["median"])
    spreads = [(max(row["rates"]) - min(row["rates"])) / row["median"] for row in rows if len(row["rates"]) > 1]
    noise = summarize(spreads)["median"] if spreads else 0.0
    gain = fastest["median"] / rows[0]["median"] - 1
    return (fastest if gain > noise else rows[0]), fastest, noise


def report(rows, best, unit):
    print(f"{'':2}{'settings':<40} {unit:>12} {'of defaults':>11}", flush=True)
    for row in sorted(rows, key=lambda row: -row["median"]):
        mark = "* " if row is best else "  "
        print(f"{mark}{row['name']:<40} {row['median']:>12.1f} {row['of_defaults']:>11.3f}", flush=True)
