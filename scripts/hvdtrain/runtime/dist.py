"""Distributed setup shared by every script: one call gives rank, size, device.

    ctx = dist.init()            # Horovod: hvd.init(), device pinning, threads
    ctx.print0("only rank 0 prints this")
"""
import os
import pickle
import random
import socket
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import horovod.torch as hvd

from hvdtrain import cli, testhooks
from hvdtrain.errors import UsageError
from hvdtrain.liveness import failures, peers, watchdog as watchdog_module

# HOROVOD_CYCLE_TIME (ms) under the Gloo controller (horovodrun --gloo, --elastic) unless
# set: Gloo negotiates over TCP every cycle, and at Horovod's 1 ms that costs the
# training threads CPU time (README, Performance: scripts/benchmark.py compare).
GLOO_CYCLE_TIME_MS = "5"


@dataclass
class Context:
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    watchdog: watchdog_module.Watchdog = field(repr=False)

    @property
    def is_main(self):
        return self.rank == 0

    def print0(self, *args, **kwargs):
        if self.is_main:
            print(*args, **kwargs, flush=True)


def request_diagnostics(timeline=None, autotune=False, autotune_log=None):
    """Horovod's own diagnostics, read at hvd.init(): call before ``init``.

    ``timeline``: a Chrome trace (chrome://tracing, Perfetto) of every tensor's
    negotiation, fusion and allreduce, written by rank 0. ``autotune``: Horovod
    tunes fusion threshold, cycle time and caching while training
    (``autotune_log``: a CSV of what it tried and scored).
    """
    for path in (timeline, autotune_log):
        if path:  # Horovod silently writes nothing into a missing directory
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if timeline:
        os.environ["HOROVOD_TIMELINE"] = str(timeline)
    if autotune or autotune_log:
        os.environ["HOROVOD_AUTOTUNE"] = "1"
    if autotune_log:
        os.environ["HOROVOD_AUTOTUNE_LOG"] = str(autotune_log)


def init(use_cuda=True, threads=None, stall_shutdown_seconds=None, elastic=False):
    """Start Horovod, pin this rank to its GPU, and share the CPU cores fairly.

    Also starts the progress watchdog: ``ctx.watchdog.step(n)`` after every step
    (see liveness/watchdog.py; HVDTRAIN_WATCHDOG_SECONDS sets a fixed limit, 0 turns it off).
    """
    testhooks.check_environment()  # a malformed test-only variable: one line, exit 2, before any step
    # Horovod reads these at init; an explicit environment setting wins.
    # (horovodrun's --stall-check-shutdown-time-seconds sets the same variable.)
    # The watchdog finds hangs; Horovod's own shutdown (MPI only) is a backstop that
    # must not end a legitimate phase the watchdog allows.
    phase_seconds = watchdog_module.phase_seconds()
    shutdown = stall_shutdown_seconds or int(phase_seconds)
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(shutdown))
    # The warning time must not exceed the shutdown time, or Horovod ignores the shutdown.
    warning = min(60, int(os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"]))
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(warning))
    # Open MPI busy-polls while a rank waits in a collective, and that spinning takes
    # the core from the compute threads (or the rank being waited for). Yielding
    # made CNN epochs 2.5x faster under horovodrun --mpi on the 2-core test machine.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    if elastic:
        # Horovod's response cache refers to tensors by bit positions agreed in earlier
        # cycles; a worker that joins after a reset starts with an empty cache. Seen here
        # under load after a host rejoined: gloo "op.preamble.length <= op.nbytes" aborts
        # (each rank fusing other tensors). Without the cache every cycle negotiates.
        os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
    if os.environ.get("HOROVOD_CONTROLLER") == "gloo":  # horovodrun --gloo sets it
        os.environ.setdefault("HOROVOD_CYCLE_TIME", GLOO_CYCLE_TIME_MS)
    hvd.init()  # Horovod: start the background communication thread.

    # Horovod: one GPU per process (see cuda_device_index); a collective on every
    # rank, CUDA or not, so that a bad GPU layout stops all ranks with one line.
    if elastic:  # alone: a worker joining a running job must make no collective before its sync
        index = _cuda_device_for_this_rank(use_cuda)
    else:
        index = agree_on_errors(_cuda_device_for_this_rank, use_cuda)
        if hvd.size() > 1:
            # Horovod: which physical GPU each rank holds (none on a CPU): ranks that each see one GPU,
            # the same one, would fail in NCCL's first collective, blaming a lost peer.
            problem = shared_gpus(hvd.allgather_object((peers.this_host(), peers.this_node(), _gpu_id(index)),
                                                       name="hvdtrain.dist.gpus"))
            if problem:
                raise UsageError(problem, on_every_rank=True)
    if index is not None:
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")

    # Processes on one node share its cores; oversubscribed threads slow every rank.
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // hvd.local_size())
    if threads:
        torch.set_num_threads(threads)

    watchdog = watchdog_module.from_env(hvd.rank())
    if not elastic and hvd.size() > 1:  # who else is alive, so a hang can name the lost ranks and hosts
        watchdog.peers = peers.start(hvd.rank(), step=lambda: watchdog.step_number)
        failures.set_peer_witness(watchdog.peers)  # a lost peer: one line, rank 0's, naming it
    return Context(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                   local_size=hvd.local_size(), device=device, watchdog=watchdog)


def cuda_device_index(local_rank, local_size, visible_count):
    """The CUDA device this rank uses, among the ``visible_count`` it can see.

    Two layouts work: every rank of a node sees all of the node's GPUs (pick the
    local rank's), or each rank sees only its own (Slurm --gpus-per-task=1, a
    per-rank CUDA_VISIBLE_DEVICES: device 0). Fewer GPUs than ranks is refused
    rather than shared round robin: NCCL rejects two ranks of one job on one GPU
    ("Duplicate GPU detected") much later, with a far less clear error. One visible
    GPU per rank may still be the same one for all: ``shared_gpus`` tells by UUID.
    """
    if visible_count == 1:
        return 0
    if visible_count >= local_size:
        return local_rank
    raise UsageError(f"{socket.gethostname()}: {local_size} ranks share {visible_count} visible GPUs: "
                     f"start one rank per GPU (e.g. --ntasks-per-node={visible_count}), or give each "
                     f"rank its own GPU (--gpus-per-task=1)")


def shared_gpus(holders):
    """One line naming the ranks that would share one physical GPU, or None.

    ``holders``: per rank, in rank order, (host, node, GPU id or None). One visible GPU per
    rank is right when each sees its own (Slurm --gpus-per-task=1: each calls it device 0),
    wrong when all of a node's ranks see the same one: only the GPU's id tells them apart.
    """
    ranks_on = {}
    for rank, (_, node, gpu) in enumerate(holders):
        if gpu is not None:
            ranks_on.setdefault((node, gpu), []).append(rank)
    shared = [ranks for ranks in ranks_on.values() if len(ranks) > 1]
    if not shared:
        return None
    host = holders[shared[0][0]][0]
    more = f" (and {len(shared) - 1} more GPUs so shared)" if len(shared) > 1 else ""
    return (f"{host}: {peers.rank_list(shared[0])} would share one GPU{more}, which NCCL refuses: start one "
            "rank per GPU, or give each rank its own (--gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES)")


def _gpu_id(index):
    """The GPU's UUID (the same whatever index a rank knows it by), or None on a CPU."""
    if index is None:
        return None
    properties = torch.cuda.get_device_properties(index)
    return str(getattr(properties, "uuid", None) or getattr(properties, "pci_bus_id", index))


def _cuda_device_for_this_rank(use_cuda):
    """cuda_device_index for this process, or None for the CPU."""
    if not (use_cuda and torch.cuda.is_available()):
        return None
    return cuda_device_index(hvd.local_rank(), hvd.local_size(), torch.cuda.device_count())


def to_sync_batchnorm(module):
    """Horovod: replace every BatchNorm2d with hvd.SyncBatchNorm, keeping its state.

    Horovod has no convert_sync_batchnorm; its SyncBatchNorm runs on CUDA only.
    """
    if isinstance(module, torch.nn.BatchNorm2d):
        synced = hvd.SyncBatchNorm(module.num_features, module.eps, module.momentum,
                                   module.affine, module.track_running_stats)
        synced.load_state_dict(module.state_dict())
        return synced
    for name, child in module.named_children():
        setattr(module, name, to_sync_batchnorm(child))
    return module


def seed_everything(seed):
    """Seed Python, NumPy and torch the same way on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def agree_on_errors(check, *args, **kwargs):
    """``cli.agree_on_errors`` over Horovod: all ranks exit with the same one-line error."""
    return cli.agree_on_errors(_allgather_verdicts, check, *args, **kwargs)


def _allgather_verdicts(message):
    # Horovod: every rank's verdict. The name must be explicit: allgather_object
    # defaults it to the object's type, so None on one rank and a message on
    # another would be two different collectives and both ranks would wait forever.
    return hvd.allgather_object(message, name="agree_on_errors")


def all_ranks_true(flag):
    """True when ``flag`` is true on every rank (one tiny allreduce)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return int(hvd.allreduce(value, op=hvd.Min, name="all_ranks_true").item()) == 1


def any_rank_true(flag):
    """True when ``flag`` is true on at least one rank (one tiny allreduce)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return int(hvd.allreduce(value, op=hvd.Max, name="any_rank_true").item()) == 1


def ranks_where(flag):
    """The ranks where ``flag`` is true, the same list on every rank (one tiny allgather)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return [rank for rank, bit in enumerate(hvd.allgather(value, name="ranks_where").tolist()) if bit]


def rng_state():
    """This rank's random-number-generator states, as tensors and plain values.

    Plain types only, so that checkpoints load with ``weights_only=True``.
    """
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": _python_rng_to_plain(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"], numpy_state["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _python_rng_to_plain(python_state):
    version, internal, gauss = python_state
    return [version, list(internal), gauss]


def gather_object_to_root(obj, name):
    """Every rank's ``obj``, in rank order, on rank 0 (None on the other ranks).

    hvd.allgather_object would send every rank's entry to every rank: at 512 ranks
    each would receive and unpickle all 512 entries (per-rank checkpoint state,
    tens of KB each) at every checkpoint. Horovod has no gather, but an alltoall in
    which each rank sends all of its bytes to rank 0 and none to the others is one.
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    splits = torch.zeros(hvd.size(), dtype=torch.int32)
    splits[0] = payload.numel()
    received, sizes = hvd.alltoall(payload, splits=splits, name=name)  # Horovod
    if hvd.rank() != 0:
        return None
    return [pickle.loads(piece.numpy().tobytes()) for piece in torch.split(received, sizes.tolist())]


def broadcast_parameters(tensors, root_rank=0):
    """Horovod: rank 0's tensors (a name -> tensor mapping) on every rank, in place, any layout.

    Horovod moves only contiguous tensors ("Tensor is required to be contiguous"); a
    channels_last convolution's weights (the default with CUDA) are not. Those go as
    contiguous copies and are copied back; the others are broadcast in place, as
    hvd.broadcast_parameters does.
    """
    staged = {name: (tensor, tensor if tensor.is_contiguous() else tensor.contiguous())
              for name, tensor in dict(tensors).items()}
    hvd.broadcast_parameters({name: sent for name, (_, sent) in staged.items()}, root_rank=root_rank)
    with torch.no_grad():
        for tensor, sent in staged.values():
            if sent is not tensor:
                tensor.copy_(sent)


class _AnyLayout:
    """Horovod's gradient compression, for gradients of any memory layout.

    DistributedOptimizer allreduces ``compress(p.grad)`` in place and sets p.grad to the
    result; a channels_last convolution's gradient is not contiguous, which Horovod
    refuses. It goes as a contiguous copy (one copy of a gradient per update); every
    other gradient goes unchanged.
    """

    def __init__(self, compression):
        self.compression = compression

    def compress(self, tensor):
        return self.compression.compress(tensor.contiguous())

    def decompress(self, tensor, ctx):
        return self.compression.decompress(tensor, ctx)


def gradient_compression(fp16):
    """Horovod: gradients sent as fp16 (--fp16-allreduce) or as they are, in any layout."""
    return _AnyLayout(hvd.Compression.fp16 if fp16 else hvd.Compression.none)


def broadcast_object(obj, root_rank=0, name=None):
    """Horovod: rank 0's object on every rank (pickled over the wire)."""
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


def exit_quietly_on_interrupt():
    """Ctrl-C on a launcher kills ranks with SIGINT: no traceback wall."""
    sys.excepthook = _quiet_keyboard_interrupt(sys.excepthook)


def _quiet_keyboard_interrupt(previous):
    def hook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            sys.exit(130)
        previous(kind, value, traceback)
    return hook
