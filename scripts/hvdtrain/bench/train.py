"""benchmark.py train: training throughput of the trainers' own steps on synthetic data.

Warm-up steps are left out, then each timed window gives a rate; reported as
the median, the spread and mean ± 1.96σ over windows, per worker and in total,
with the CPU each rank kept busy and the mean loss of every step.
"""
import os
import resource
import time

import torch

from hvdtrain.bench import backends, workloads
from hvdtrain.bench.options import BERT_MODELS
from hvdtrain.bench.record import environment, summarize, write_json
from hvdtrain.durations import SECTIONS
from hvdtrain.runtime import stragglers

KNOB_VARIABLES = {"fusion_threshold_mb": "HOROVOD_FUSION_THRESHOLD", "cycle_time_ms": "HOROVOD_CYCLE_TIME"}


def run(args):
    for name, variable in KNOB_VARIABLES.items():  # Horovod: read at hvd.init()
        value = getattr(args, name)
        if value is not None:
            os.environ[variable] = str(int(value * 2**20) if name == "fusion_threshold_mb" else value)
    backend = backends.BACKENDS[args.baseline](args)
    torch.manual_seed(args.seed)  # the same initial weights under every backend
    workload = workloads.build(args, backend)
    losses = [workload.step() for _ in range(args.warmup_steps)]
    workload.timer.reset()  # the timed windows' steps only
    local_rates = []
    timed_wall, timed_cpu = -time.perf_counter(), -process_cpu_seconds()
    for _ in range(args.windows):
        backend.barrier()
        started = time.perf_counter()
        for _ in range(args.window_steps):
            losses.append(workload.step())
            workload.timer.steps += 1
            backend.beat()
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        local_rates.append(workload.samples * args.window_steps / (time.perf_counter() - started))
    timed_wall, timed_cpu = timed_wall + time.perf_counter(), timed_cpu + process_cpu_seconds()
    totals = backend.sum(local_rates)  # per window: the sum of every rank's rate
    # CPU seconds per second of every thread of the process (compute, Horovod's
    # background thread, MPI/Gloo progress), averaged over ranks: more than
    # --threads means something else takes cores from the computation.
    (cpu_cores,) = backend.sum([timed_cpu / timed_wall / backend.size])
    mean_losses = [value / backend.size for value in backend.sum(losses)]
    knobs = {"model": args.model, "batch_size": args.batch_size, "fp16_allreduce": args.fp16_allreduce,
             "accumulation_steps": args.accumulation_steps, "amp": args.amp, "precision": workload.precision,
             "compile": args.compile, "channels_last": args.channels_last,
             "image_size": args.image_size,
             "seq_length": args.seq_length if args.model in BERT_MODELS else None}
    result = {"mode": "train", "unit": f"{workload.unit}/s",
              "total": summarize(totals),
              "per_worker": summarize([total / backend.size for total in totals]),
              "cpu_cores_per_rank": cpu_cores, "losses": mean_losses,
              "ranks": rank_breakdown(backend, workload.timer),
              "environment": environment(backend, knobs)}
    if backend.rank == 0:
        report(result, args)
        write_json(result, args.output)


def rank_breakdown(backend, timer):
    """Every rank's seconds per step in data, compute, comm and optimizer, scored as the trainers'
    straggler report does (runtime/stragglers.py). DDP and one process have no separate wait: their
    allreduce runs inside backward (compute)."""
    mine = [timer.seconds[s] / max(timer.steps, 1) for s in SECTIONS]
    spread = [0.0] * (len(mine) * backend.size)
    spread[backend.rank * len(mine):(backend.rank + 1) * len(mine)] = mine
    gathered = backend.sum(spread)  # each rank's numbers in its own slots: a gather
    per_step = [dict(zip(SECTIONS, gathered[r * len(mine):(r + 1) * len(mine)]))
                for r in range(backend.size)]
    return stragglers.scores(per_step)


def process_cpu_seconds():
    """User and system CPU seconds of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def report(result, args):
    total, worker, env = result["total"], result["per_worker"], result["environment"]
    unit = result["unit"]
    print(f"{args.model} {env['backend']} ({env['controller']}), {env['world_size']} worker(s) x batch "
          f"{args.batch_size * args.accumulation_steps}, {env['threads_per_rank']} thread(s) per rank", flush=True)
    print(f"total:      median {total['median']:.1f} {unit} (min {total['min']:.1f}, max {total['max']:.1f}), "
          f"mean {total['mean']:.1f} +- {total['ci95']:.1f}", flush=True)
    print(f"per worker: median {worker['median']:.1f} {unit}, mean {worker['mean']:.1f} +- {worker['ci95']:.1f}; "
          f"CPU busy {result['cpu_cores_per_rank']:.2f} cores per rank", flush=True)
    for row in result["ranks"]:
        parts = ", ".join(f"{s} {1000 * row[s + '_s']:.1f}" for s in SECTIONS)
        print(f"rank {row['rank']}: ms per step: {parts}; relative {row['relative']['busy']:.2f}, "
              f"waiting {100 * row['waiting']:.0f} % of the step", flush=True)
