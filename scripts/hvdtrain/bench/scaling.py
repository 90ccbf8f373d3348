"""benchmark.py scaling and compare: `benchmark.py train` launched for several
world sizes or backends, each launch bounded in time, and the results side by side.

scaling: `horovodrun -np N ... train` for each N; a table, scaling.json and
scaling.png (throughput and efficiency T(N) / (N T(1))).
compare: Horovod and DDP on N workers, Horovod on one, the plain loop and N
plain loops at once (the machine's own weak-scaling ceiling), interleaved for
--repeats rounds; medians and their ratios in compare.json.
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from hvdtrain.bench.record import command_line, summarize, write_json
from hvdtrain.errors import UsageError


# ============================================================================= launching
def launch_train(args, size, train_args, output, launcher=True):
    """One `benchmark.py train` run, under horovodrun (or plain python); its result."""
    output.unlink(missing_ok=True)
    command = train_command(args.script, train_args, output)
    if launcher:
        command = [horovodrun(), "-np", str(size), f"--{args.controller}", *shlex.split(args.horovodrun_args),
                   *command]
    print(f"$ {shlex.join(command)}", flush=True)
    if not run_bounded(command, args.timeout) or not output.is_file():
        raise UsageError(f"a benchmark run failed (command above); no {output}")
    return json.loads(output.read_text())


def launch_independent(args, size, train_args, output):
    """``size`` plain `--baseline none` processes at once, each alone: the machine's own
    ceiling for weak scaling (shared cores, memory bandwidth, caches; no communication).
    Their medians summed, as one result."""
    outputs = [output.with_name(f"{output.stem}-{index}.json") for index in range(size)]
    for path in outputs:
        path.unlink(missing_ok=True)
    commands = [train_command(args.script, train_args, path) for path in outputs]
    print(f"$ {size} at once: {shlex.join(commands[0])}", flush=True)
    processes = [subprocess.Popen(command, start_new_session=True) for command in commands]
    finished = [wait_bounded(process, args.timeout) for process in processes]
    if not all(finished) or not all(path.is_file() for path in outputs):
        raise UsageError(f"a benchmark run failed (command above); no {outputs[0]}")
    results = [json.loads(path.read_text()) for path in outputs]
    total = sum(result["total"]["median"] for result in results)
    cpu = sum(result["cpu_cores_per_rank"] for result in results) / len(results)
    return {**results[0], "total": {**results[0]["total"], "median": total}, "cpu_cores_per_rank": cpu,
            "independent_runs": len(results)}


def train_command(script, train_args, output):
    return [sys.executable, str(script), "train", *train_args, "--output", str(output)]


def horovodrun():
    """horovodrun from PATH, else the one installed beside this Python (an unactivated venv)."""
    found = shutil.which("horovodrun") or shutil.which("horovodrun", path=str(Path(sys.executable).parent))
    if found is None:
        raise UsageError("horovodrun not found on PATH or beside this Python: activate the venv "
                         "(source .venv/bin/activate) or install Horovod")
    return found


def run_bounded(command, timeout):
    """Run a launch in its own process group; kill the whole group after ``timeout`` s."""
    return wait_bounded(subprocess.Popen(command, start_new_session=True), timeout)


def wait_bounded(process, timeout):
    """True if ``process`` (a group leader) ended well within ``timeout`` s; else its group is killed."""
    try:
        return process.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        return False


# ============================================================================= scaling
def run_scaling(args):
    args.output_dir.mkdir(parents=True, exist_ok=True)
    runs = [launch_train(args, size, args.train_args, args.output_dir / f"train-np{size}.json") for size in args.np]
    table = scaling_table(runs)
    result = {"mode": "scaling", "rows": table, "runs": [str(args.output_dir / f"train-np{n}.json") for n in args.np],
              "environment": {**runs[0]["environment"], "command": command_line()}}
    report_scaling(result)
    write_json(result, args.output_dir / "scaling.json")
    plot_scaling(table, runs[0]["unit"], args.output_dir / "scaling.png")
    print(f"wrote {args.output_dir / 'scaling.json'} and {args.output_dir / 'scaling.png'}", flush=True)


def scaling_table(runs):
    """Throughput and efficiency T(n) / (n T(smallest n) / smallest n) for each world size."""
    base = runs[0]
    base_per_worker = base["total"]["median"] / base["environment"]["world_size"]
    rows = []
    for run in runs:
        size = run["environment"]["world_size"]
        total = run["total"]["median"]
        rows.append({"workers": size, "total": total, "per_worker": total / size,
                     "spread": [run["total"]["min"], run["total"]["max"]],
                     "efficiency": total / (size * base_per_worker)})
    return rows


def report_scaling(result):
    print(f"{'workers':>7} {'total':>10} {'per worker':>11} {'efficiency':>10}", flush=True)
    for row in result["rows"]:
        print(f"{row['workers']:>7} {row['total']:>10.1f} {row['per_worker']:>11.1f} {row['efficiency']:>10.3f}",
              flush=True)


def plot_scaling(rows, unit, path):
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    workers = [row["workers"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(workers, [row["total"] for row in rows], "o-", label="measured")
    left.plot(workers, [rows[0]["per_worker"] * n for n in workers], "--", color="gray", label="linear")
    left.set(xlabel="workers", ylabel=unit, title="throughput")
    left.legend()
    right.plot(workers, [row["efficiency"] for row in rows], "o-")
    right.set(xlabel="workers", ylabel="T(n) / (n T(1))", title="scaling efficiency", ylim=(0, 1.1))
    for axis in (left, right):
        axis.set_xticks(workers)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# ============================================================================= compare
def run_compare(args):
    """The issue every Horovod user asks first, answered side by side: ratios of medians."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if "--threads" not in args.train_args:
        # Every run gets one worker's share of the cores, so that one worker is the
        # fair base of the N-worker runs (weak scaling), not a worker with N times the threads.
        args.train_args = [*args.train_args, "--threads", str(max(1, (os.cpu_count() or 1) // args.np))]
    horovod_args = [*args.train_args, *shlex.split(args.horovod_args)]
    plain = [*args.train_args, "--baseline", "none"]
    kinds = {  # name: how to run it once; each returns a train result
        "horovod": lambda out: launch_train(args, args.np, horovod_args, out),
        "ddp": lambda out: launch_train(args, args.np, [*args.train_args, "--baseline", "ddp"], out),
        "horovod_1": lambda out: launch_train(args, 1, horovod_args, out),
        "none": lambda out: launch_train(args, 1, plain, out, launcher=False),
        "independent": lambda out: launch_independent(args, args.np, plain, out),
    }
    rates, cpu = {kind: [] for kind in kinds}, {kind: [] for kind in kinds}
    for repeat in range(args.repeats):
        for kind, run_once in kinds.items():
            result = run_once(args.output_dir / f"{kind}-{repeat}.json")
            rates[kind].append(result["total"]["median"])
            cpu[kind].append(result["cpu_cores_per_rank"])
            unit, environment = result["unit"], result["environment"]
    medians = {kind: summarize(values)["median"] for kind, values in rates.items()}
    n = args.np
    ratios = {"horovod / ddp": medians["horovod"] / medians["ddp"],
              "horovod_1 / none": medians["horovod_1"] / medians["none"],
              f"weak scaling 1 -> {n}": medians["horovod"] / (n * medians["horovod_1"]),
              f"ddp weak scaling 1 -> {n}": medians["ddp"] / (n * medians["none"]),
              # No communication at all: what sharing the machine alone leaves of n x one.
              f"ceiling: {n} independent / ({n} x none)": medians["independent"] / (n * medians["none"]),
              # Each against that ceiling, its bound: how much of what is left each one reaches.
              f"horovod / {n} independent": medians["horovod"] / medians["independent"],
              f"ddp / {n} independent": medians["ddp"] / medians["independent"]}
    # Drift between rounds hits the kinds of one round alike: the spread of the
    # per-round ratios says how far the median ratio can be trusted.
    per_round = [horovod / ddp for horovod, ddp in zip(rates["horovod"], rates["ddp"])]
    result = {"mode": "compare", "unit": unit, "rates": rates, "medians": medians, "ratios": ratios,
              "horovod_over_ddp_per_round": per_round, "cpu_cores_per_rank": cpu,
              "environment": {**environment, "command": command_line()}}
    for kind, values in rates.items():
        print(f"{kind:>11}: median {medians[kind]:.1f} {unit} over {len(values)} runs "
              f"({', '.join(f'{value:.1f}' for value in values)}); CPU busy "
              f"{summarize(cpu[kind])['median']:.2f} cores per rank", flush=True)
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}", flush=True)
    print(f"horovod / ddp per round: {', '.join(f'{value:.3f}' for value in per_round)}", flush=True)
    write_json(result, args.output_dir / "compare.json")
