#!/usr/bin/env python
"""Measure Horovod against DDP and raw MPI, on your machines, with the collection's own code.

    horovodrun -np 2 python scripts/benchmark.py train --model resnet20                 # Horovod
    horovodrun -np 2 python scripts/benchmark.py train --model resnet20 --baseline ddp  # the same under DDP
    python scripts/benchmark.py train --model resnet20 --baseline none                  # no distribution
    mpirun -np 2 python scripts/benchmark.py allreduce          # hvd.allreduce vs mpi4py vs torch.distributed
    python scripts/benchmark.py scaling --np 1 2 --output-dir runs/scaling -- --model resnet20
    python scripts/benchmark.py compare --np 2 --repeats 3 -- --model bert-mini   # side by side, with ratios
    python scripts/benchmark.py timeline runs/timeline.json   # where the time went (--horovod-timeline)

train: synthetic data through the trainers' own models and training steps
(train_cnn.Trainer.train_step, pretrain_bert.train_step); warm-up steps are
left out, then each timed window gives a rate; reported as the median, the
spread and mean ± 1.96σ over windows, per worker and in total.
allreduce: a message-size sweep with time, algorithm bandwidth and bus
bandwidth (algbw x 2(n-1)/n) side by side, as nccl-tests reports them.
scaling: launches `horovodrun -np N ... train` for each N and writes a table,
scaling.json and scaling.png (throughput and efficiency T(N) / (N T(1))).
compare: Horovod and DDP on N workers, Horovod on one, the plain loop and N
plain loops at once (the machine's own weak-scaling ceiling), interleaved for
--repeats rounds; medians and their ratios in compare.json.
timeline: totals per activity (negotiation, allreduce, fusion-buffer copies)
and the number of collectives in a Horovod timeline.
Every result file records the environment and the exact command.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from hvdtrain.bench import backends as bench, workloads as workloads
from hvdtrain import cli
from hvdtrain.errors import UsageError
from hvdtrain.runtime.run import add_horovod_diagnostics

KNOB_VARIABLES = {"fusion_threshold_mb": "HOROVOD_FUSION_THRESHOLD", "cycle_time_ms": "HOROVOD_CYCLE_TIME"}


# ============================================================================= arguments
def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE",
                                  parser_class=cli.ArgumentParser)
    train = modes.add_parser("train", help="training throughput: Horovod, or --baseline ddp|none")
    add_train_arguments(train)
    sweep = modes.add_parser("allreduce", help="allreduce message-size sweep: Horovod, mpi4py, torch.distributed")
    sweep.add_argument("--min-bytes", type=size_in_bytes, default="1K", help="smallest message (K, M suffixes)")
    sweep.add_argument("--max-bytes", type=size_in_bytes, default="256M", help="largest message")
    sweep.add_argument("--factor", type=cli.positive_int, default=4, help="size step between messages")
    sweep.add_argument("--dtypes", nargs="+", choices=["float32", "float16"], default=["float32", "float16"],
                       help="element types")
    sweep.add_argument("--libraries", nargs="+", choices=["horovod", "mpi", "torch"],
                       default=["horovod", "mpi", "torch"],
                       help="mpi: mpi4py's Allreduce (needs an MPI launch); torch: torch.distributed (Gloo)")
    sweep.add_argument("--seconds", type=cli.positive_float, default=0.5,
                       help="timed seconds per size and library, roughly (at least 5 iterations)")
    add_common_arguments(sweep)
    scaling = modes.add_parser("scaling", help="run train for several world sizes with horovodrun",
                               epilog="Arguments after -- go to `benchmark.py train`.")
    scaling.add_argument("--np", nargs="+", type=cli.positive_int, default=[1, 2], help="world sizes")
    scaling.add_argument("--controller", choices=["gloo", "mpi"], default="mpi",
                         help="horovodrun --mpi (horovodrun's own default where MPI is installed) or --gloo")
    scaling.add_argument("--horovodrun-args", default="",
                         help="more horovodrun options, e.g. '-H a:2,b:2 --network-interface eth0'")
    scaling.add_argument("--output-dir", type=Path, default=Path("runs/scaling"),
                         help="train-np<N>.json per size, scaling.json, scaling.png")
    scaling.add_argument("--timeout", type=cli.positive_int, default=1800, help="seconds per launch")
    compare = modes.add_parser("compare", help="Horovod, DDP, one Horovod worker and no distribution, "
                                               "interleaved, with their ratios",
                               epilog="Arguments after -- go to every `benchmark.py train` run.")
    compare.add_argument("--np", type=cli.positive_int, default=2, help="workers of the Horovod and DDP runs")
    compare.add_argument("--controller", choices=["gloo", "mpi"], default="mpi",
                         help="horovodrun --mpi (horovodrun's own default where MPI is installed) or --gloo")
    compare.add_argument("--repeats", type=cli.positive_int, default=3,
                         help="rounds of the four runs, one after another (drift hits all four alike)")
    compare.add_argument("--horovod-args", default="",
                         help="train options for the Horovod runs only, e.g. '--cycle-time-ms 5'")
    compare.add_argument("--horovodrun-args", default="", help="more horovodrun options")
    compare.add_argument("--output-dir", type=Path, default=Path("runs/compare"),
                         help="one JSON per run, compare.json")
    compare.add_argument("--timeout", type=cli.positive_int, default=1800, help="seconds per launch")
    timeline = modes.add_parser("timeline", help="where the time went in a Horovod timeline "
                                                 "(--horovod-timeline): totals per activity")
    timeline.add_argument("file", type=Path, help="the timeline JSON (a run still writing it is fine)")
    timeline.add_argument("--output", type=Path, metavar="FILE", help="also write the summary as JSON here")
    argv = sys.argv[1:] if argv is None else argv
    passed = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.train_args = passed
    if args.mode == "train":
        check_train_arguments(args)
    if args.mode == "allreduce" and args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")
    return args


def add_common_arguments(parser):
    parser.add_argument("--output", type=Path, metavar="FILE", help="also write the results as JSON here")
    parser.add_argument("--cpu", action="store_true", help="ignore GPUs")
    parser.add_argument("--threads", type=cli.positive_int, help="CPU threads per rank; unset: cores / ranks")


def add_train_arguments(parser):
    parser.add_argument("--model", choices=workloads.MODELS, default="resnet20", help="what to train")
    parser.add_argument("--baseline", choices=["ddp", "none"],
                        help="instead of Horovod: DistributedDataParallel, or one process without distribution")
    parser.add_argument("--batch-size", type=cli.positive_int, default=32,
                        help="images or sequences per rank and backward pass")
    parser.add_argument("--image-size", type=cli.positive_int, help="CNN input size (default: the model's own)")
    parser.add_argument("--seq-length", type=cli.positive_int, default=128, help="BERT sequence length")
    parser.add_argument("--vocab-size", type=cli.positive_int, default=30522, help="BERT vocabulary size")
    parser.add_argument("--warmup-steps", type=cli.non_negative_int, default=5, help="untimed steps first")
    parser.add_argument("--window-steps", type=cli.positive_int, default=10, help="steps per timed window")
    parser.add_argument("--windows", type=cli.positive_int, default=5, help="timed windows")
    parser.add_argument("--seed", type=cli.non_negative_int, default=42, help="weights and synthetic data")
    parser.add_argument("--amp", action="store_true", help="CUDA: mixed precision (fp16 CNN, bf16 BERT)")
    parser.add_argument("--channels-last", action="store_true", help="CNN: channels_last memory layout")
    knobs = parser.add_argument_group("Horovod")
    knobs.add_argument("--fp16-allreduce", action="store_true", help="send gradients as fp16")
    knobs.add_argument("--accumulation-steps", type=cli.positive_int, default=1,
                       help="backward passes per allreduce (Horovod's batches per allreduce)")
    knobs.add_argument("--fusion-threshold-mb", type=cli.non_negative_int,
                       help="HOROVOD_FUSION_THRESHOLD in MiB (Horovod's default: 128)")
    knobs.add_argument("--cycle-time-ms", type=cli.positive_float,
                       help="HOROVOD_CYCLE_TIME in ms (Horovod's default: 1)")
    add_horovod_diagnostics(knobs)
    add_common_arguments(parser)


def check_train_arguments(args):
    if args.baseline and (args.horovod_timeline or args.horovod_autotune or args.horovod_autotune_log
                          or args.fusion_threshold_mb is not None or args.cycle_time_ms is not None):
        cli.fail("Horovod's knobs and diagnostics apply to Horovod runs only (drop --baseline)")


def size_in_bytes(text):
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        value = int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 256M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return value


# ============================================================================= train
def train(args):
    for name, variable in KNOB_VARIABLES.items():  # Horovod reads these at hvd.init()
        value = getattr(args, name)
        if value is not None:
            os.environ[variable] = str(int(value * 2**20) if name == "fusion_threshold_mb" else value)
    backend = bench.BACKENDS[args.baseline](args)
    torch.manual_seed(args.seed)  # the same initial weights under every backend
    workload = workloads.build(args, backend)
    losses = [workload.step() for _ in range(args.warmup_steps)]
    local_rates = []
    timed_wall, timed_cpu = -time.perf_counter(), -bench.process_cpu_seconds()
    for _ in range(args.windows):
        backend.barrier()
        started = time.perf_counter()
        for _ in range(args.window_steps):
            losses.append(workload.step())
            backend.beat()
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        local_rates.append(workload.samples * args.window_steps / (time.perf_counter() - started))
    timed_wall, timed_cpu = timed_wall + time.perf_counter(), timed_cpu + bench.process_cpu_seconds()
    totals = backend.sum(local_rates)  # per window: the sum of every rank's rate
    # CPU seconds per second of every thread of the process (compute, Horovod's
    # background thread, MPI/Gloo progress), averaged over ranks: more than
    # --threads means something else takes cores from the computation.
    (cpu_cores,) = backend.sum([timed_cpu / timed_wall / backend.size])
    mean_losses = [value / backend.size for value in backend.sum(losses)]
    knobs = {"model": args.model, "batch_size": args.batch_size, "fp16_allreduce": args.fp16_allreduce,
             "accumulation_steps": args.accumulation_steps, "amp": args.amp, "channels_last": args.channels_last,
             "image_size": args.image_size, "seq_length": args.seq_length if args.model in workloads.BERT_MODELS else None}
    result = {"mode": "train", "unit": f"{workload.unit}/s",
              "total": bench.summarize(totals),
              "per_worker": bench.summarize([total / backend.size for total in totals]),
              "cpu_cores_per_rank": cpu_cores, "losses": mean_losses,
              "environment": bench.environment(backend, knobs)}
    if backend.rank == 0:
        report_train(result, args)
        write_json(result, args.output)


def report_train(result, args):
    total, worker, env = result["total"], result["per_worker"], result["environment"]
    unit = result["unit"]
    print(f"{args.model} {env['backend']} ({env['controller']}), {env['world_size']} worker(s) x batch "
          f"{args.batch_size * args.accumulation_steps}, {env['threads_per_rank']} thread(s) per rank", flush=True)
    print(f"total:      median {total['median']:.1f} {unit} (min {total['min']:.1f}, max {total['max']:.1f}), "
          f"mean {total['mean']:.1f} +- {total['ci95']:.1f}", flush=True)
    print(f"per worker: median {worker['median']:.1f} {unit}, mean {worker['mean']:.1f} +- {worker['ci95']:.1f}; "
          f"CPU busy {result['cpu_cores_per_rank']:.2f} cores per rank", flush=True)


# ============================================================================= allreduce
def allreduce(args):
    mpi = mpi_communicator() if "mpi" in args.libraries else None  # before Horovod starts MPI itself
    args.horovod_timeline = args.horovod_autotune_log = None
    args.horovod_autotune = args.fp16_allreduce = False
    args.accumulation_steps = 1
    backend = bench.HorovodBackend(args)
    if "torch" in args.libraries:
        start_torch_distributed(backend)
    unavailable = {}
    if "mpi" in args.libraries and (mpi is None or mpi.Get_size() != backend.size):
        unavailable["mpi"] = "mpi4py needs an MPI launch (mpirun, srun, horovodrun --mpi)"
    rows = []
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    for dtype in args.dtypes:
        for size in sizes:
            for library in args.libraries:
                if library in unavailable:
                    continue
                if library == "mpi" and dtype == "float16":
                    continue  # MPI has no standard half-precision sum
                seconds = bench.time_allreduce(library, dtype, size, args.seconds, backend, mpi)
                algbw = size / seconds / 1e9
                rows.append({"library": library, "dtype": dtype, "bytes": size, "seconds": seconds,
                             "algbw_gbps": algbw, "busbw_gbps": bench.bus_bandwidth(algbw, backend.size)})
            backend.beat()
    result = {"mode": "allreduce", "rows": rows, "unavailable": unavailable,
              "environment": bench.environment(backend, {"libraries": args.libraries, "dtypes": args.dtypes})}
    if backend.rank == 0:
        report_allreduce(result)
        write_json(result, args.output)


def mpi_communicator():
    from hvdtrain.launch.mpi_world import launched_size
    if launched_size() < 2:
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD


def start_torch_distributed(backend):
    """torch.distributed (Gloo) beside Horovod, on the same ranks."""
    address = bench.shared_rendezvous_address()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://{address}", rank=backend.rank,
                                         world_size=backend.size)


def message_sizes(smallest, largest, factor):
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= factor
    return sizes


def report_allreduce(result):
    env = result["environment"]
    print(f"allreduce on {env['world_size']} ranks, Horovod controller {env['controller']}; "
          f"busbw = algbw x 2(n-1)/n", flush=True)
    print(f"{'bytes':>11} {'dtype':>8} {'library':>8} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}",
          flush=True)
    for row in result["rows"]:
        print(f"{row['bytes']:>11} {row['dtype']:>8} {row['library']:>8} {row['seconds'] * 1e6:>11.1f} "
              f"{row['algbw_gbps']:>11.3f} {row['busbw_gbps']:>11.3f}", flush=True)
    for library, why in result["unavailable"].items():
        print(f"{library}: not measured: {why}", flush=True)


# ============================================================================= scaling
def launch_train(args, size, train_args, output, launcher=True):
    """One `benchmark.py train` run, under horovodrun (or plain python); its result."""
    output.unlink(missing_ok=True)
    command = train_command(train_args, output)
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
    commands = [train_command(train_args, path) for path in outputs]
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


def train_command(train_args, output):
    return [sys.executable, str(Path(__file__).resolve()), "train", *train_args, "--output", str(output)]


def horovodrun():
    """horovodrun from PATH, else the one installed beside this Python (an unactivated venv)."""
    found = shutil.which("horovodrun") or shutil.which("horovodrun", path=str(Path(sys.executable).parent))
    if found is None:
        raise UsageError("horovodrun not found on PATH or beside this Python: activate the venv "
                         "(source .venv/bin/activate) or install Horovod")
    return found


def scaling(args):
    args.output_dir.mkdir(parents=True, exist_ok=True)
    runs = [launch_train(args, size, args.train_args, args.output_dir / f"train-np{size}.json") for size in args.np]
    table = scaling_table(runs)
    result = {"mode": "scaling", "rows": table, "runs": [str(args.output_dir / f"train-np{n}.json") for n in args.np],
              "environment": {**runs[0]["environment"], "command": shlex.join([sys.executable, *sys.argv])}}
    report_scaling(result)
    write_json(result, args.output_dir / "scaling.json")
    plot_scaling(table, runs[0]["unit"], args.output_dir / "scaling.png")
    print(f"wrote {args.output_dir / 'scaling.json'} and {args.output_dir / 'scaling.png'}", flush=True)


def compare(args):
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
    medians = {kind: bench.summarize(values)["median"] for kind, values in rates.items()}
    n = args.np
    ratios = {"horovod / ddp": medians["horovod"] / medians["ddp"],
              "horovod_1 / none": medians["horovod_1"] / medians["none"],
              f"weak scaling 1 -> {n}": medians["horovod"] / (n * medians["horovod_1"]),
              f"ddp weak scaling 1 -> {n}": medians["ddp"] / (n * medians["none"]),
              # No communication at all: what sharing the machine alone leaves of n x one.
              f"ceiling: {n} independent / ({n} x none)": medians["independent"] / (n * medians["none"])}
    # Drift between rounds hits the kinds of one round alike: the spread of the
    # per-round ratios says how far the median ratio can be trusted.
    per_round = [horovod / ddp for horovod, ddp in zip(rates["horovod"], rates["ddp"])]
    result = {"mode": "compare", "unit": unit, "rates": rates, "medians": medians, "ratios": ratios,
              "horovod_over_ddp_per_round": per_round, "cpu_cores_per_rank": cpu,
              "environment": {**environment, "command": shlex.join([sys.executable, *sys.argv])}}
    for kind, values in rates.items():
        print(f"{kind:>11}: median {medians[kind]:.1f} {unit} over {len(values)} runs "
              f"({', '.join(f'{value:.1f}' for value in values)}); CPU busy "
              f"{bench.summarize(cpu[kind])['median']:.2f} cores per rank", flush=True)
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}", flush=True)
    print(f"horovod / ddp per round: {', '.join(f'{value:.3f}' for value in per_round)}", flush=True)
    write_json(result, args.output_dir / "compare.json")


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


# ============================================================================= timeline
def timeline(args):
    try:
        events = bench.read_timeline(args.file)
    except (OSError, ValueError) as error:
        raise UsageError(f"{args.file}: not a readable Horovod timeline ({error})") from None
    summary = bench.summarize_timeline(events)
    print(f"{args.file}: {summary['span_seconds']:.2f} s, {summary['tensors']} tensors; "
          f"collectives: {', '.join(f'{n} {name}' for name, n in summary['collectives'].items()) or 'none'}",
          flush=True)
    print(f"{'activity':>28} {'total s':>9} {'count':>7} {'mean us':>10}", flush=True)
    for row in summary["activities"]:
        print(f"{row['activity']:>28} {row['seconds']:>9.3f} {row['count']:>7} {row['mean_us']:>10.1f}", flush=True)
    write_json(summary, args.output)


# ============================================================================= main
def write_json(result, path):
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


def main():
    args = parse_args()
    {"train": train, "allreduce": allreduce, "scaling": scaling, "compare": compare,
     "timeline": timeline}[args.mode](args)


if __name__ == "__main__":
    cli.run_main(main)
