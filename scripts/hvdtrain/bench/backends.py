"""What scripts/benchmark.py needs besides the trainers' own code.

Three ways to run the same training step, each launched the same way
(``horovodrun``, ``mpirun``, ``srun`` or a plain ``python``):

- ``HorovodBackend``: hvd.DistributedOptimizer, as the trainers run;
- ``DdpBackend``: torch.nn.parallel.DistributedDataParallel (Gloo on CPU, NCCL
  on GPU). Horovod is started only to agree on a rendezvous address and is shut
  down before training, so its background thread costs DDP nothing;
- ``SingleBackend``: no distribution at all (one process).

Plus the statistics and the environment record every result file carries.
"""
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as torch_dist
import horovod
import horovod.torch as hvd

from hvdtrain.runtime import dist
from hvdtrain.errors import UsageError
from hvdtrain.launch.mpi_world import launched_size


def threads_for(local_size, threads=None):
    """The trainers' rule: cores shared evenly by the ranks of a node."""
    if threads is None and "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    return threads or max(1, (os.cpu_count() or 1) // local_size)


def pick_device(cpu, local_rank):
    if not cpu and torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


class HorovodBackend:
    name = "horovod"

    def __init__(self, args):
        dist.request_diagnostics(args.horovod_timeline, args.horovod_autotune, args.horovod_autotune_log)
        self.ctx = dist.init(use_cuda=not args.cpu, threads=args.threads)  # Horovod: hvd.init()
        self.rank, self.size, self.local_size = self.ctx.rank, self.ctx.size, self.ctx.local_size
        self.device = self.ctx.device
        self.threads = torch.get_num_threads()
        self.compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        self.passes = args.accumulation_steps

    def wrap(self, module, named_parameters, optimizer):
        """(module to call, optimizer to step): gradients averaged by Horovod."""
        # Horovod: every rank starts from rank 0's weights; gradients are averaged
        # during backward, once per `passes` backward calls.
        hvd.broadcast_parameters(dict(named_parameters), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                             compression=self.compression, backward_passes_per_step=self.passes)
        return module, optimizer

    def beat(self):
        self.ctx.watchdog.step()

    def sum(self, values):
        tensor = torch.tensor(values, dtype=torch.float64)
        return hvd.allreduce(tensor, op=hvd.Sum, name="bench.sum").tolist()  # Horovod

    def barrier(self):
        hvd.allreduce(torch.zeros(1), name="bench.barrier")  # Horovod: a tiny collective

    def controller(self):
        return "mpi" if hvd.mpi_enabled() else "gloo"


class DdpBackend:
    name = "ddp"

    def __init__(self, args):
        if args.accumulation_steps != 1:
            raise UsageError("--baseline ddp runs one backward pass per allreduce: drop --accumulation-steps",
                             on_every_rank=True)
        self.fp16 = args.fp16_allreduce
        address, self.rank, self.size, self.local_rank, self.local_size = rendezvous_with_horovod()
        self.device = pick_device(args.cpu, self.local_rank)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        torch_dist.init_process_group(backend, init_method=f"tcp://{address}", rank=self.rank,
                                      world_size=self.size)
        self.threads = threads_for(self.local_size, args.threads)
        torch.set_num_threads(self.threads)

    def wrap(self, module, named_parameters, optimizer):
        ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's weights at construction and averages gradients during backward.
        ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)
        if self.fp16:  # DDP's counterpart of Horovod's fp16 compression
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, optimizer

    def beat(self):
        pass

    def sum(self, values):
        tensor = torch.tensor(values, dtype=torch.float64)
        torch_dist.all_reduce(tensor)
        return tensor.tolist()

    def barrier(self):
        torch_dist.barrier()

    def controller(self):
        return f"torch.distributed ({torch_dist.get_backend()})"


def rendezvous_with_horovod():
    """(host:port of a free port on rank 0, rank, size, local rank, local size), agreed
    through Horovod, which then shuts down: the DDP run uses only torch.distributed."""
    hvd.init()  # Horovod: only to learn ranks and share an address
    layout = (shared_rendezvous_address(), hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    hvd.shutdown()
    return layout


def shared_rendezvous_address():
    """A free host:port on rank 0 for torch.distributed, sent to every rank through Horovod.

    MASTER_ADDR overrides the host (rank 0's own address otherwise; loopback on one node).
    """
    address = None
    if hvd.rank() == 0:
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if hvd.local_size() == hvd.size() else socket.gethostbyname(socket.gethostname()))
        with socket.socket() as probe:
            probe.bind((host, 0))
            address = f"{host}:{probe.getsockname()[1]}"
    return dist.broadcast_object(address, root_rank=0, name="bench.rendezvous")  # Horovod


class SingleBackend:
    name = "none"
    rank, size, local_size = 0, 1, 1

    def __init__(self, args):
        if launched_size() > 1 or int(os.environ.get("HOROVOD_SIZE", "1")) > 1:
            raise UsageError("--baseline none is one process with no distribution: launch it with plain python",
                             on_every_rank=True)  # every rank finds the same
        self.device = pick_device(args.cpu, 0)
        self.threads = threads_for(1, args.threads)
        torch.set_num_threads(self.threads)

    def wrap(self, module, named_parameters, optimizer):
        return module, optimizer

    def beat(self):
        pass

    def sum(self, values):
        return list(values)

    def barrier(self):
        pass

    def controller(self):
        return "none"


BACKENDS = {None: HorovodBackend, "ddp": DdpBackend, "none": SingleBackend}


# ----------------------------------------------------------------------------- allreduce timing
CHUNKS = 5  # allreduce timings: the median of this many chunks of iterations


def time_allreduce(library, dtype, size, budget, backend, mpi):
    """Seconds per allreduce of ``size`` bytes: the slowest rank's median over chunks of iterations."""
    elements = max(1, size // (4 if dtype == "float32" else 2))
    tensor = torch.ones(elements, dtype=getattr(torch, dtype))
    array = tensor.numpy()

    def once():
        if library == "horovod":
            hvd.allreduce_(tensor, op=hvd.Sum, name="bench.allreduce")  # Horovod
        elif library == "mpi":
            mpi.Allreduce(mpi_in_place(), array)
        else:
            torch.distributed.all_reduce(tensor)

    for _ in range(3):
        once()
    # Every rank runs the same number of iterations: rank 0's estimate decides.
    started = time.perf_counter()
    once()
    estimate = backend.sum([time.perf_counter() - started if backend.rank == 0 else 0.0])[0]
    per_chunk = max(1, min(2_000, int(budget / CHUNKS / max(estimate, 1e-6))))
    backend.barrier()
    chunk_means = []
    for _ in range(CHUNKS):  # the median chunk: a scheduler hiccup on 2 busy cores spoils one chunk, not all
        started = time.perf_counter()
        for _ in range(per_chunk):
            once()
        chunk_means.append((time.perf_counter() - started) / per_chunk)
    return max_over_ranks(statistics.median(chunk_means))


def mpi_in_place():
    from mpi4py import MPI
    return MPI.IN_PLACE


def max_over_ranks(value):
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max,
                               name="bench.max").item())  # Horovod


# ----------------------------------------------------------------------------- timeline
def read_timeline(path):
    """A Horovod timeline's events. Horovod writes a JSON array that it closes only at
    shutdown, with a comma after each event: a run still going (or killed) is read too."""
    text = Path(path).read_text().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def summarize_timeline(events):
    """Time per activity (B/E pairs, nested per tensor), tensors and distinct collectives.

    A fused collective shows once per tensor in it, with the same start: counting
    distinct (activity, start) pairs gives the collectives the ranks really ran.
    """
    open_spans, seconds, counts, collectives = {}, {}, {}, {}
    tensors = set()
    for event in events:
        phase, lane = event.get("ph"), event.get("pid")
        if phase == "M" and event.get("name") == "process_name" and "name" in event.get("args", {}):
            tensors.add(lane)  # one lane per tensor name
        elif phase == "B":
            open_spans.setdefault(lane, []).append((event["name"], event["ts"]))
            if event["name"].startswith(("MPI_", "GLOO_", "NCCL_")):
                collectives.setdefault(event["name"], set()).add(event["ts"])
        elif phase == "E" and open_spans.get(lane):
            name, started = open_spans[lane].pop()
            seconds[name] = seconds.get(name, 0) + (event["ts"] - started) / 1e6
            counts[name] = counts.get(name, 0) + 1
    stamps = [event["ts"] for event in events if "ts" in event]
    activities = [{"activity": name, "seconds": total, "count": counts[name], "mean_us": total / counts[name] * 1e6}
                  for name, total in sorted(seconds.items(), key=lambda item: -item[1])]
    return {"span_seconds": (max(stamps) - min(stamps)) / 1e6 if stamps else 0.0, "tensors": len(tensors),
            "collectives": {name: len(starts) for name, starts in sorted(collectives.items())},
            "activities": activities}


# ----------------------------------------------------------------------------- statistics
def process_cpu_seconds():
    """User and system CPU seconds of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime



def summarize(values):
    """Median, spread and mean ± 1.96σ (as Horovod's synthetic benchmark reports)."""
    mean = statistics.fmean(values)
    sigma = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "mean": mean,
            "ci95": 1.96 * sigma, "values": values}


def bus_bandwidth(algorithm_bandwidth, size):
    """nccl-tests' bus bandwidth of an allreduce: what each link carries, 2(n-1)/n."""
    return algorithm_bandwidth * 2 * (size - 1) / size


# ----------------------------------------------------------------------------- environment
def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mpi_version():
    try:
        shown = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
        return shown.stdout.strip().splitlines()[0] if shown.returncode == 0 and shown.stdout else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def horovod_settings():
    """HOROVOD_* variables that tune or trace (not the launcher's rank bookkeeping)."""
    bookkeeping = ("RANK", "SIZE", "LOCAL_", "CROSS_", "HOSTNAME", "GLOO_", "CONTROLLER", "CPU_OPERATIONS")
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith("HOROVOD_") and not name[len("HOROVOD_"):].startswith(bookkeeping)}


def environment(backend, knobs):
    """What a result depends on, recorded with it."""
    gpu = torch.cuda.get_device_name() if backend.device.type == "cuda" else None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "gpu": gpu,
        "python": platform.python_version(), "torch": torch.__version__, "horovod": horovod.__version__,
        "mpi": mpi_version(), "backend": backend.name, "controller": backend.controller(),
        "world_size": backend.size, "threads_per_rank": backend.threads,
        "knobs": {**knobs, **horovod_settings()},
        "command": shlex.join([sys.executable, *sys.argv]),
    }
