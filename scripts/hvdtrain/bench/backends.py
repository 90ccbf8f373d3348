"""The ways benchmark.py runs a workload: Horovod, DDP and one process.

Three ways to run the same training step, each launched the same way
(``horovodrun``, ``mpirun``, ``srun`` or a plain ``python``):

- ``HorovodBackend``: hvd.DistributedOptimizer, as the trainers run;
- ``DdpBackend``: torch.nn.parallel.DistributedDataParallel (Gloo on CPU, NCCL
  on GPU). Horovod is started only to agree on a rendezvous address and is shut
  down before training, so its background thread costs DDP nothing;
- ``SingleBackend``: no distribution at all (one process).

Each reads the options ``add_common_arguments`` adds (``--cpu``, ``--threads``;
``--output`` is where the mode writes its result).
"""
import os
import socket

import torch
import torch.distributed as torch_dist
import horovod.torch as hvd

from hvdtrain.runtime import collectives, dist, host_memory
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
        self.ctx = dist.init(use_cuda=not args.cpu, threads=args.threads, buckets=True)  # Horovod: hvd.init()
        self.rank, self.size, self.local_size = self.ctx.rank, self.ctx.size, self.ctx.local_size
        self.device = self.ctx.device
        self.threads = torch.get_num_threads()
        # Horovod: gradients sent as fp16 with --fp16-allreduce
        self.compression = dist.gradient_compression(args.fp16_allreduce)
        self.passes = args.accumulation_steps

    def wrap(self, module, named_parameters, optimizer):
        """(module to call, optimizer to step): gradients averaged by Horovod."""
        # Horovod: every rank starts from rank 0's weights; gradients are averaged
        # during backward, once per `passes` backward calls.
        collectives.broadcast_parameters(named_parameters, root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                             compression=self.compression, backward_passes_per_step=self.passes)
        dist.fixed_gradient_buckets(optimizer)  # as the trainers: fused the same way every step
        return module, optimizer

    def beat(self):
        self.ctx.watchdog.step()

    def sum(self, values):
        tensor = torch.tensor(values, dtype=torch.float64)
        return hvd.allreduce(tensor, op=hvd.Sum, name="bench.sum").tolist()  # Horovod: sum over ranks

    def barrier(self):
        hvd.allreduce(torch.zeros(1), name="bench.barrier")  # Horovod: a tiny collective

    def controller(self):
        return "mpi" if hvd.mpi_enabled() else "gloo"  # Horovod: which controller runs


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
        host_memory.keep_freed_memory()  # as dist.setup does for Horovod: compare measures the communication

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
    # Horovod: this rank's place in the world, then Horovod stops
    layout = (shared_rendezvous_address(), hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    hvd.shutdown()
    return layout


def shared_rendezvous_address():
    """A free host:port on rank 0 for torch.distributed, sent to every rank through Horovod.

    MASTER_ADDR overrides the host (rank 0's own address otherwise; loopback on one node).
    """
    address = None
    if hvd.rank() == 0:  # Horovod: rank 0 picks; local_size == size means one node
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if hvd.local_size() == hvd.size() else socket.gethostbyname(socket.gethostname()))
        with socket.socket() as probe:
            probe.bind((host, 0))
            address = f"{host}:{probe.getsockname()[1]}"
    return collectives.broadcast_object(address, root_rank=0, name="bench.rendezvous")  # Horovod: from rank 0


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
        host_memory.keep_freed_memory()  # as every other kind of the comparison

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
