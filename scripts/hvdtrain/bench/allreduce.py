"""benchmark.py allreduce: a message-size sweep of hvd.allreduce, mpi4py's
Allreduce and torch.distributed's all_reduce on the same ranks.

Time, algorithm bandwidth and bus bandwidth (algbw x 2(n-1)/n) side by side,
as nccl-tests reports them.
"""
import statistics
import time

import torch
import horovod.torch as hvd

from hvdtrain.bench import backends
from hvdtrain.bench.record import environment, write_json
from hvdtrain.launch.mpi_world import launched_size

CHUNKS = 5  # allreduce timings: the median of this many chunks of iterations


def run(args):
    mpi = mpi_communicator() if "mpi" in args.libraries else None  # before Horovod starts MPI itself
    args.horovod_timeline = args.horovod_autotune_log = None
    args.horovod_autotune = args.fp16_allreduce = False
    args.accumulation_steps = 1
    backend = backends.HorovodBackend(args)
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
                seconds = time_allreduce(library, dtype, size, args.seconds, backend, mpi)
                algbw = size / seconds / 1e9
                rows.append({"library": library, "dtype": dtype, "bytes": size, "seconds": seconds,
                             "algbw_gbps": algbw, "busbw_gbps": bus_bandwidth(algbw, backend.size)})
            backend.beat()
    result = {"mode": "allreduce", "rows": rows, "unavailable": unavailable,
              "environment": environment(backend, {"libraries": args.libraries, "dtypes": args.dtypes})}
    if backend.rank == 0:
        report(result)
        write_json(result, args.output)


def mpi_communicator():
    if launched_size() < 2:
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD


def start_torch_distributed(backend):
    """torch.distributed (Gloo) beside Horovod, on the same ranks."""
    address = backends.shared_rendezvous_address()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://{address}", rank=backend.rank,
                                         world_size=backend.size)


def message_sizes(smallest, largest, factor):
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= factor
    return sizes


def time_allreduce(library, dtype, size, budget, backend, mpi):
    """Seconds per allreduce of ``size`` bytes: the slowest rank's median over chunks of iterations."""
    elements = max(1, size // (4 if dtype == "float32" else 2))
    tensor = torch.ones(elements, dtype=getattr(torch, dtype))
    array = tensor.numpy()

    def once():
        if library == "horovod":
            hvd.allreduce_(tensor, op=hvd.Sum, name="bench.allreduce")  # Horovod: in place, summed
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
                               name="bench.max").item())  # Horovod: the largest over ranks


def bus_bandwidth(algorithm_bandwidth, size):
    """nccl-tests' bus bandwidth of an allreduce: what each link carries, 2(n-1)/n."""
    return algorithm_bandwidth * 2 * (size - 1) / size


def report(result):
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
