#!/usr/bin/env python
"""Horovod against DDP (Gloo) as a user compares them: the same plain step, launched each its own way.

    .venv/bin/python tools/measure_horovod_vs_ddp.py --controller mpi --rounds 5
    .venv/bin/python tools/measure_horovod_vs_ddp.py --controller gloo --rounds 5 --settings plain trainers

Written apart from benchmark.py: a plain loop, ResNet-20 (scripts/hvdtrain/models/resnet.py),
one fixed synthetic CIFAR-size batch per rank (--batch-size images, fp32), SGD with momentum,
``zero_grad, forward, loss, backward, step``. Both sides set the same torch threads
(--threads), run --warmup steps, then time --steps steps from a barrier to the last step's end
(each rank's wall clock; the slowest rank's counts): images/s = ranks x batch x steps / time.

- DDP: ``torchrun --standalone --nproc-per-node NP`` (env:// rendezvous), the Gloo backend,
  ``DistributedDataParallel(model)`` with its defaults;
- Horovod: ``horovodrun -np NP --mpi`` or ``--gloo`` (or ``mpirun -np NP`` with --launcher
  mpirun), ``hvd.DistributedOptimizer`` and ``hvd.broadcast_parameters``, in one of two
  --settings: ``plain``, a user's ``hvd.init()``, nothing else; ``startup``, a user's script
  started by the package's ``dist.init()`` (its optimizer a plain DistributedOptimizer); ``trainers``, Horovod started
  the way train_cnn.py and pretrain_bert.py start it (``hvdtrain.runtime.dist.init``: the
  controller's variables, hvd.init(), the threads rule, the host-memory setting, the watchdog
  and the heartbeat, the watchdog told of every step) and their gradients in fixed buckets
  (``dist.fixed_gradient_buckets``, which the Gloo controller's 50 ms cycle on a CPU assumes).

A round runs each kind once, the kinds taking turns going first; reported: every round's
images/s and Horovod / DDP ratio, the medians over rounds, and the CPU the rest of the machine
used during each run (from /proc/stat, less the run's own). On a shared machine each run first
waits (up to --patience s) until the rest of the machine uses under --quiet of a core, and the
medians are given over every round and over the quiet ones (no run disturbed).
``--env NAME=VALUE`` sets a variable for the Horovod runs (a Horovod knob: it wins over the
trainers' defaults, as in the trainers). ``--ddp-host-memory`` adds DDP with the trainers'
host-memory setting (runtime/host_memory.py) as a third kind: Horovod against it is the
communication's difference alone. The ``horovod`` and ``ddp`` modes are the programs
the rounds launch (one JSON line from rank 0).
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve()
PREFIX = "RESULT "
KEPT = "ddp host-memory"  # DDP with the trainers' host-memory setting (--ddp-host-memory)


# ============================================================================= the two programs
def plain_step(model, optimizer, images, targets):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(images), targets)
    loss.backward()
    optimizer.step()


def thread_cpu():
    """CPU seconds of this process so far: (its main thread, its other threads), from /proc."""
    main = other = 0.0
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a thread that just ended
            continue
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if int(task.name) == os.getpid():
            main += seconds
        else:
            other += seconds
    return main, other


def run_loop(args, model, optimizer, rank, size, barrier, slowest, mean, beat=lambda: None):
    """--warmup steps, then --steps timed from a barrier; rank 0 prints the result."""
    generator = torch.Generator().manual_seed(1000 + rank)
    images = torch.randn(args.batch_size, 3, 32, 32, generator=generator)
    targets = torch.randint(0, 10, (args.batch_size,), generator=generator)
    for _ in range(args.warmup):
        plain_step(model, optimizer, images, targets)
        beat()
    barrier()
    cpu, started = thread_cpu(), time.perf_counter()
    for _ in range(args.steps):
        plain_step(model, optimizer, images, targets)
        beat()
    seconds = slowest(time.perf_counter() - started)
    # CPU ms per step, mean over ranks: the main thread's (the step) and the other threads' (communication)
    cpu_ms = mean([1000 * (after - before) / args.steps for after, before in zip(thread_cpu(), cpu)])
    if rank == 0:
        result = {"images_per_sec": size * args.batch_size * args.steps / seconds, "seconds": seconds,
                  "cpu_ms_per_step": {"main thread": cpu_ms[0], "other threads": cpu_ms[1]},
                  "ranks": size, "threads": torch.get_num_threads(),
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                  "horovod": {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_CYCLE", "HOROVOD_FUSION",
                                                                                   "HOROVOD_CACHE", "OMPI_MCA_mpi_yield"))}}
        print(PREFIX + json.dumps(result), flush=True)


def build(args):
    from hvdtrain.models import resnet
    torch.manual_seed(0)
    model = resnet.build("resnet20", 10)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def horovod_main(args):
    import horovod.torch as hvd
    beat = lambda: None  # noqa: E731
    if args.settings[0] in ("trainers", "startup"):
        from hvdtrain.runtime import dist
        # configure, hvd.init(), setup; the trainers' gradients go in fixed buckets, a user's script's may not
        ctx = dist.init(use_cuda=False, threads=args.threads or None, buckets=args.settings[0] == "trainers")
        beat = ctx.watchdog.step
    else:
        hvd.init()
        if args.threads:
            torch.set_num_threads(args.threads)
    model, optimizer = build(args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    if args.settings[0] == "trainers":
        dist.fixed_gradient_buckets(optimizer)  # as train_cnn.py and pretrain_bert.py: the same buckets every step
    run_loop(args, model, optimizer, hvd.rank(), hvd.size(),
             barrier=lambda: hvd.allreduce(torch.zeros(1), name="barrier"),
             slowest=lambda s: hvd.allreduce(torch.tensor([s]), op=hvd.Max, name="seconds").item(),
             mean=lambda values: hvd.allreduce(torch.tensor(values), name="cpu").tolist(), beat=beat)
    hvd.shutdown()


def ddp_main(args):
    import torch.distributed as torch_dist
    torch_dist.init_process_group("gloo")  # env:// from torchrun
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ddp_host_memory:  # the trainers' host-memory setting (hvdtrain/runtime/host_memory.py), nothing else
        from hvdtrain.runtime import host_memory
        host_memory.keep_freed_memory()
    model, optimizer = build(args)
    model = torch.nn.parallel.DistributedDataParallel(model)

    def slowest(seconds):
        tensor = torch.tensor([seconds])
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
        return tensor.item()

    def mean(values):
        tensor = torch.tensor(values)
        torch_dist.all_reduce(tensor)
        return (tensor / torch_dist.get_world_size()).tolist()

    run_loop(args, model, optimizer, torch_dist.get_rank(), torch_dist.get_world_size(),
             barrier=torch_dist.barrier, slowest=slowest, mean=mean)
    torch_dist.barrier()
    torch_dist.destroy_process_group()
    # Out without the interpreter's teardown: a rank aborted in it about one run in six ("terminate called
    # without an active exception", after its result was printed), with or without the barrier above.
    sys.stdout.flush()
    os._exit(0)


# ============================================================================= the rounds
def beside_python(name):
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name) or name


def loop_args(args, settings=None):
    return ["--batch-size", str(args.batch_size), "--threads", str(args.threads), "--warmup", str(args.warmup),
            "--steps", str(args.steps), *(["--settings", settings] if settings else [])]


def commands(args):
    """{kind: (command, extra environment)} for one round."""
    if args.launcher == "mpirun":
        if args.controller != "mpi":
            sys.exit("--launcher mpirun runs the MPI controller: use --controller mpi")
        launcher = ["mpirun", "-np", str(args.np), *args.mpirun_args.split()]
    else:
        launcher = [beside_python("horovodrun"), "-np", str(args.np), f"--{args.controller}"]
    env = dict(item.split("=", 1) for item in args.env)
    kinds = {"ddp": ([beside_python("torchrun"), "--standalone", "--nproc-per-node", str(args.np), str(SCRIPT),
                      "ddp", *loop_args(args)], {})}
    if args.ddp_host_memory:
        kinds["ddp host-memory"] = ([*kinds["ddp"][0], "--ddp-host-memory"], {})
    for settings in args.settings:
        kinds[f"horovod {settings}"] = ([*launcher, sys.executable, str(SCRIPT), "horovod",
                                         *loop_args(args, settings)], env)
    return kinds


def busy_jiffies():
    """Busy CPU time of the whole machine so far, in seconds (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(quiet, settled=3.0, patience=120.0):
    """Wait (up to ``patience`` s) until the machine has used under ``quiet`` of a core for ``settled`` s."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        before = busy_jiffies()
        time.sleep(settled)
        if (busy_jiffies() - before) / settled < quiet:
            return


def launch(command, extra_env, timeout):
    """One launch: (its result, the cores the rest of the machine used meanwhile)."""
    env = {**os.environ, **extra_env}
    machine, own, wall = busy_jiffies(), children_cpu(), time.perf_counter()
    ran = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - wall
    others = max(0.0, (busy_jiffies() - machine) - (children_cpu() - own)) / wall
    lines = [line.split(PREFIX, 1)[1] for line in ran.stdout.splitlines() if PREFIX in line]
    if ran.returncode != 0 or not lines:
        sys.exit(f"{' '.join(command)} failed ({ran.returncode}):\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}")
    return json.JSONDecoder().raw_decode(lines[-1])[0], others  # a launcher may append to the line


def cpu_cell(result):
    cpu = result["cpu_ms_per_step"]
    return f"{cpu['main thread']:.0f}+{cpu['other threads']:.0f}"


def compare(args):
    kinds = commands(args)
    names = list(kinds)
    rates, quiet = {name: [] for name in names}, []
    print(f"{args.np} ranks x {args.threads} thread(s), resnet20, batch {args.batch_size}, fp32, "
          f"{args.warmup} warm-up + {args.steps} timed steps; controller {args.controller} "
          f"({args.launcher}); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    for name in names:
        print(f"  {name}: {' '.join(kinds[name][0])}" + (f"  [{kinds[name][1]}]" if kinds[name][1] else ""))
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        parts = {}
        for name in order:
            wait_for_quiet(args.quiet, patience=args.patience)
            result, others = launch(*kinds[name], timeout=args.timeout)
            rates[name].append(result["images_per_sec"])
            parts[name] = (result, others)
        ddp = rates["ddp"][-1]
        cells = [f"{name} {parts[name][0]['images_per_sec']:.1f} (CPU ms/step {cpu_cell(parts[name][0])}, "
                 f"others {parts[name][1]:.2f})" for name in names]
        ratios = ", ".join(f"{name}/ddp {rates[name][-1] / ddp:.3f}" for name in names if name != "ddp")
        ratios += "".join(f", {name}/ddp host-memory {rates[name][-1] / rates[KEPT][-1]:.3f}"
                          for name in names if KEPT in rates and name.startswith("horovod"))
        quiet.append(all(others < args.quiet for _, others in parts.values()))
        print(f"round {round_ + 1}{'' if quiet[-1] else ' (disturbed)'}: " + "; ".join(cells) + f"; {ratios}",
              flush=True)
    summary = {"rounds": args.rounds, "rates": rates, "quiet_rounds": quiet, "medians": {}, "ratios": {}}
    for name in names:
        summary["medians"][name] = statistics.median(rates[name])
        if name != "ddp":
            per_round = [h / d for h, d in zip(rates[name], rates["ddp"])]
            calm = [r for r, q in zip(per_round, quiet) if q]
            summary["ratios"][name] = {"median": statistics.median(per_round), "rounds": per_round,
                                       "quiet_median": statistics.median(calm) if calm else None}
    for name in (n for n in names if KEPT in rates and n.startswith("horovod")):
        per_round = [h / d for h, d in zip(rates[name], rates[KEPT])]
        summary["ratios"][f"{name} / {KEPT}"] = {"median": statistics.median(per_round), "rounds": per_round}
    print("medians: " + ", ".join(f"{name} {rate:.1f} images/s" for name, rate in summary["medians"].items()))
    for name, ratio in summary["ratios"].items():
        calm = (f"; quiet rounds ({sum(quiet)}) {ratio['quiet_median']:.3f}" if ratio.get("quiet_median") is not None
                else "; no quiet round" if "quiet_median" in ratio else "")
        print(f"{name}{'' if ' / ' in name else ' / ddp'}: median {ratio['median']:.3f} "
              f"(rounds {', '.join(f'{r:.3f}' for r in ratio['rounds'])}){calm}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **summary}, indent=1) + "\n")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "horovod", "ddp"],
                        help="compare (default): the rounds; horovod, ddp: one side (run by the rounds)")
    parser.add_argument("--controller", choices=["mpi", "gloo"], default="mpi", help="Horovod's controller")
    parser.add_argument("--launcher", choices=["horovodrun", "mpirun"], default="horovodrun",
                        help="what starts the Horovod ranks (mpirun: the MPI controller)")
    parser.add_argument("--mpirun-args", default="", help="more mpirun options with --launcher mpirun")
    parser.add_argument("--settings", nargs="+", choices=["plain", "startup", "trainers"], default=["trainers"],
                        help="Horovod started by a plain hvd.init(), by the package's start-up call with a plain "
                             "DistributedOptimizer (startup), or as the trainers start it; one run each a round")
    parser.add_argument("--ddp-host-memory", action="store_true",
                        help="also run DDP with the trainers' host-memory setting (runtime/host_memory.py), and "
                             "compare Horovod with it too: the difference left is the communication's")
    parser.add_argument("--np", type=int, default=2, help="ranks of each run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank, both sides (0: leave them)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank and step")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=60, help="timed steps")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of one run of each kind")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable for the Horovod runs (repeat)")
    parser.add_argument("--quiet", type=float, default=0.15,
                        help="a run waits until the rest of the machine uses under this much of a core, and a round "
                             "is quiet when it stayed so during all its runs")
    parser.add_argument("--patience", type=float, default=120, help="seconds a run waits for the quiet at most")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one launch may take")
    parser.add_argument("--json", help="also write the rounds and medians to this file")
    return parser.parse_args()


def main():
    args = parse_args()
    if args.mode == "compare":
        return compare(args)
    global torch
    import torch
    (horovod_main if args.mode == "horovod" else ddp_main)(args)


if __name__ == "__main__":
    main()
