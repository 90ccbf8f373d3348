"""Distributed setup shared by every script: Horovod's variables, then this rank's device and watchdog.

    startup = dist.before_init(args)   # a trainer's: quiet Ctrl-C, a stop request, the variables hvd.init() reads
    hvd.init()                         # Horovod: start, in the script
    ctx = dist.after_init(startup)     # this rank's device, threads, watchdog and heartbeat
    ctx.print0("only rank 0 prints this")

Under them, ``configure_horovod(args)`` (the variables) and ``setup(...)`` (the context).
``dist.init()`` is configure, hvd.init() and setup in one call, for programs with nothing to
do in between (your own script, the benchmark's Horovod backend, the test workers).

Two of Horovod's settings suit only gradients sent in fixed buckets
(``fixed_gradient_buckets``): the Gloo controller's long cycle on a CPU and each
grouped allreduce fused on its own. The trainers ask for them (``buckets=True``);
a script that hands its optimizer to a plain ``hvd.DistributedOptimizer`` keeps
Horovod's own (the long cycle made such a script's steps slower than stock).
"""
import functools
import os
import socket
import sys
from dataclasses import dataclass, field

import torch
import horovod.torch as hvd

from hvdtrain import testhooks
from hvdtrain.errors import UsageError
from hvdtrain.liveness import failures, peers, recorder as flight, watchdog as watchdog_module
from hvdtrain.runtime import collectives, horovod_profile, host_memory, signals

# HOROVOD_CYCLE_TIME (ms) under the Gloo controller (horovodrun --gloo, --elastic) unless
# set. Gloo negotiates over TCP, about 1 ms of a rank's CPU a cycle; with the setup's
# patch a rank cycles only while it has collectives in flight, and at once when the step
# waits for them (hvd.synchronize), so a longer cycle fuses a CPU backward pass into a
# round or two without delaying the step's end: 0.91 of DDP at 5 ms, 1.0 at 50 on
# resnet20 (docs/performance.md, The Gloo controller). With CUDA the cores are not the
# model's, and a short cycle starts the gradients' NCCL allreduces during the backward pass.
GLOO_CYCLE_TIME_MS = {"cpu": "50", "cuda": "5"}


@dataclass
class Context:
    """This rank in the current world: rank and size, its device, its progress watchdog."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    watchdog: watchdog_module.Watchdog = field(repr=False)
    stop_request: signals.StopRequest = field(default=None, repr=False)  # SIGTERM/SIGUSR1 seen (after_init)
    gathered_placement: list = field(default=None, repr=False)  # see placement()

    @property
    def is_main(self):
        return self.rank == 0

    def print0(self, *args, **kwargs):
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def placement(self):
        """Where every rank of this world runs, in rank order: {rank, host, node, address, local_rank,
        local_size, threads, gpu} each. Collective the first time in a world (one allgather_object of a
        few bytes per rank); the GPU check, the heartbeat and the straggler report all read it."""
        if self.gathered_placement is None:
            # Horovod: every rank's host, node, local rank and size, threads and physical GPU
            self.gathered_placement = collectives.allgather_object(_this_rank(self), name="hvdtrain.dist.placement")
        return self.gathered_placement

    def follow_world(self):
        """This worker's rank and size in the current world: after an --elastic reset they change."""
        self.rank, self.size, self.local_rank, self.local_size = hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()
        self.watchdog.rank, self.watchdog.size = self.rank, self.size
        self.gathered_placement = None  # another world: gathered again where it is needed
        flight.note_world(self.rank)


def _this_rank(ctx):
    gpu = _gpu_id(ctx.device.index) if ctx.device.type == "cuda" else None
    return {"rank": ctx.rank, "host": peers.this_host(), "node": peers.this_node(), "address": peers.node_addresses()[0],
            "local_rank": ctx.local_rank, "local_size": ctx.local_size, "threads": torch.get_num_threads(), "gpu": gpu}


@dataclass
class Startup:
    """A trainer's start-up, carried across hvd.init() from ``before_init`` to ``after_init``."""
    args: object
    stop_request: signals.StopRequest
    profile_line: str = None


def before_init(args, imports_ahead=()):
    """A trainer's start-up before hvd.init(): Ctrl-C ends a rank without a traceback wall, SIGTERM and
    SIGUSR1 become a stop request (a checkpoint, exit 0: Run.step_done), and the variables hvd.init()
    reads are set (``configure_horovod``). ``args``: options.add_run_arguments' and the precision's.
    ``imports_ahead``: under --elastic, calls that import now what the trainer's set-up after hvd.init()
    would (``_import_ahead_of_standby``: torch's compiler always)."""
    exit_quietly_on_interrupt()
    stop_request = signals.StopRequest()
    startup = Startup(args, stop_request, configure_horovod(args))
    if args.elastic:
        for import_ahead in imports_ahead:
            import_ahead()
    return startup


def after_init(startup):
    """A trainer's start-up after hvd.init(): ``setup`` from its arguments (this rank's GPU, its share of
    the node's cores, its watchdog and heartbeat), the stop request kept on the context, a tuned
    profile said once."""
    args = startup.args
    ctx = setup(use_cuda=not args.cpu, threads=args.threads, elastic=args.elastic)
    ctx.stop_request = startup.stop_request
    if startup.profile_line:
        ctx.print0(startup.profile_line)
    return ctx


def configure_horovod(args):
    """Horovod's variables, read by hvd.init(): call before it. Its diagnostics (--horovod-timeline,
    --horovod-autotune), a tuned profile (--horovod-profile; returns the line that says what it set, or
    None) and the controller's settings (``configure``, for gradients in fixed buckets). The trainers' args."""
    request_diagnostics(args.horovod_timeline, args.horovod_autotune, args.horovod_autotune_log)
    profile = horovod_profile.apply(args)  # benchmark.py tune's variables
    configure(use_cuda=not args.cpu, elastic=args.elastic, buckets=True)
    return profile


def request_diagnostics(timeline=None, autotune=False, autotune_log=None):
    """Horovod's own diagnostics, read at hvd.init(): call before it.

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


def _import_ahead_of_standby():
    """What the set-up after hvd.init() would import, imported before it. A spare (an elastic worker
    started ahead of its slot, HOROVOD_ELASTIC_SPARES) stands by inside hvd.init(), and the world that
    takes it waits in the state sync for all it does after: torch imports its compiler at the first
    optimizer's construction (torch._compile's disable-dynamo wrapper), 1.0 of the trainers' 1.05 s
    of set-up after hvd.init() on a 2-core AMD EPYC, more with 16 ranks on its cores. A trainer's own
    (a model library's): ``before_init(args, imports_ahead=...)``."""
    import torch._dynamo  # noqa: F401


def configure(use_cuda=True, stall_shutdown_seconds=None, elastic=False, buckets=False):
    """The controller's settings hvd.init() reads (an explicit environment setting wins). ``buckets``:
    the gradients will go in fixed buckets (``fixed_gradient_buckets``), and the controller is set for them."""
    testhooks.check_environment()  # a malformed test-only variable: one line, exit 2, before any step
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
    # The installed build's hvd.init() sets it too (patch 0024); here for a build without it.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    if elastic:
        # Horovod's response cache refers to tensors by bit positions agreed in earlier
        # cycles; a worker that joins after a reset starts with an empty cache. Seen here
        # under load after a host rejoined: gloo "op.preamble.length <= op.nbytes" aborts
        # (each rank fusing other tensors). Without the cache every cycle negotiates.
        os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
        _import_ahead_of_standby()
    if buckets:
        # Each bucket of gradients fused on its own (fixed_gradient_buckets): the same buffers every step.
        os.environ.setdefault("HOROVOD_DISABLE_GROUP_FUSION", "1")
        if os.environ.get("HOROVOD_CONTROLLER") == "gloo":  # horovodrun --gloo sets it
            device = "cuda" if use_cuda and torch.cuda.is_available() else "cpu"
            os.environ.setdefault("HOROVOD_CYCLE_TIME", GLOO_CYCLE_TIME_MS[device])


def init(use_cuda=True, threads=None, stall_shutdown_seconds=None, elastic=False, buckets=False):
    """``configure``, hvd.init() and ``setup`` in one call (``buckets``: see ``configure``)."""
    configure(use_cuda, stall_shutdown_seconds, elastic, buckets)
    hvd.init()  # Horovod: start the background communication thread.
    return setup(use_cuda, threads, elastic)


def setup(use_cuda=True, threads=None, elastic=False):
    """After hvd.init(): pin this rank to its GPU, share the CPU cores fairly, start the watchdog.

    ``ctx.watchdog.step(n)`` after every step (see liveness/watchdog.py;
    HVDTRAIN_WATCHDOG_SECONDS sets a fixed limit, 0 turns it off). With 2+ ranks (not
    --elastic, whose joining workers make no collective before their sync): the GPU layout
    checked on every rank, and the heartbeat that names lost ranks started.
    """
    # Horovod: one GPU per process (see cuda_device_index); a collective on every
    # rank, CUDA or not, so that a bad GPU layout stops all ranks with one line.
    agree = collectives.agreement(alone=elastic)
    index = agree(_cuda_device_for_this_rank, use_cuda)
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
    # A step's freed host memory kept for the next one, not given back to the kernel and faulted
    # in again (host_memory.py; a user's MALLOC_* setting wins). The installed build's hvd.init()
    # does the same (patch 0025, HOROVOD_KEEP_FREED_MEMORY=0 turns both off); here for a build without it.
    host_memory.keep_freed_memory()

    ctx = Context(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size(),
                  device=device, watchdog=watchdog_module.from_env(hvd.rank()))
    ctx.watchdog.size = ctx.size  # a rank alone holds nobody up (watchdog.Watchdog._holds)
    # Every collective from here on (Horovod's, the gradients', a user's) in the flight recorder
    if flight.enabled(os.environ):
        collectives.record_into(flight.install(ctx.rank))
    if not elastic and ctx.size > 1:
        placement = ctx.placement()  # collective
        # Ranks that each see one GPU, the same one, would fail in NCCL's first collective,
        # blaming a lost peer.
        problem = shared_gpus([(place["host"], place["node"], place["gpu"]) for place in placement])
        if problem:
            raise UsageError(problem, on_every_rank=True)
        # Who else is alive, so a hang can name the lost ranks and hosts (collective: the listeners' addresses).
        ctx.watchdog.peers = peers.start(ctx.rank, [place["host"] for place in placement],
                                         [place["node"] for place in placement],
                                         step=lambda: ctx.watchdog.step_number, broadcast=collectives.broadcast_object,
                                         status=flight.RECORDER.status if flight.RECORDER else None)
        failures.set_peer_witness(ctx.watchdog.peers)  # a lost peer: one line, rank 0's, naming it
    return ctx


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


def world_rank():
    """This worker's rank in the current world, as Horovod knows it now (after an --elastic reset
    the context follows it in ``Context.follow_world``)."""
    return hvd.rank()


def world_size():
    """The number of ranks in the current world, as Horovod knows it now."""
    return hvd.size()


def mpi_controller():
    """Whether Horovod runs its MPI controller (mpirun, horovodrun --mpi), not Gloo."""
    return hvd.mpi_enabled()


def nccl_built():
    """Whether this Horovod build reduces GPU tensors with NCCL."""
    return hvd.nccl_built()


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


def fixed_gradient_buckets(optimizer, bucket_bytes=horovod_profile.BUCKET_BYTES):
    """Horovod: DistributedOptimizer's gradients allreduced in fixed buckets, the same buffers every step.

    Horovod fuses the gradients that happen to be ready in a cycle into one buffer; which
    ones is a matter of timing. From three ranks on, an element's place in that buffer
    decides the order in which the ring (Gloo's, Open MPI's) sums the ranks' values, so
    two identical runs differ by float32 rounding wherever the buffers came out
    differently, and the differences grow: 3e-8 in the weights after 20 steps of a
    3-rank job at a 1 s and a 0.1 ms cycle; 4e-3 after 450 steps of a 4-rank elastic
    job whose resets' first steps negotiated while the new worker was warming up. Like DDP's buckets, each group
    of parameters (in the order backward produces their gradients, up to ``bucket_bytes``)
    goes as one grouped allreduce once all of its gradients are ready, fused on its own
    (HOROVOD_DISABLE_GROUP_FUSION, set by ``configure``): every step sums every element
    in the same order, so results are bit for bit what the same job gives at the same size.

    Horovod's own ``groups=`` argument would broadcast the parameter order when the
    optimizer is built, a collective a worker joining an elastic job must not make
    before the sync (elastic.py); here every rank builds the same model, so the order
    is known. Adasum's optimizer has no groups: it is returned as it is.
    """
    if not hasattr(optimizer, "_p_to_group"):
        return optimizer
    if os.environ.get("HOROVOD_DISABLE_GROUP_FUSION") != "1":  # buckets fused together: timing decides again
        raise UsageError("dist.fixed_gradient_buckets needs Horovod configured for them before hvd.init(): "
                         "dist.configure(buckets=True), dist.init(buckets=True) or dist.configure_horovod(args)")
    params = list(reversed([p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]))
    sizes = [p.numel() * p.element_size() for p in params]
    optimizer._groups = [tuple(params[i] for i in bucket) for bucket in horovod_profile.packed(sizes, bucket_bytes)]
    optimizer._p_to_group = {p: bucket for bucket in optimizer._groups for p in bucket}
    optimizer._group_counts = dict.fromkeys(optimizer._groups, 0)
    # (a partial, not a lambda: no frame between Horovod's hook and the submission, which is how the
    # flight recorder tells a gradient, runtime/collectives.py)
    optimizer._grouped_allreduce_grad_async = functools.partial(_bucket_allreduce_async, optimizer)
    load_state_dict = optimizer.load_state_dict

    def load_state_dict_and_forget_counts(*args, **kwargs):
        # Horovod forgets a failed step's pending allreduces here, not how many gradients of
        # each bucket it had seen: a bucket would go out before its gradients were all ready.
        load_state_dict(*args, **kwargs)
        optimizer._group_counts = dict.fromkeys(optimizer._groups, 0)
    optimizer.load_state_dict = load_state_dict_and_forget_counts
    return optimizer


def _bucket_allreduce_async(optimizer, ps):
    """Horovod: one bucket's gradients as one grouped allreduce, as DistributedOptimizer sends one
    gradient (its own grouped path leaves out --gradient-predivide-factor's pre- and postscaling),
    named by its first and last parameter (the flight recorder shows "N gradients (first ... last)")."""
    tensors, contexts = zip(*[optimizer._compression.compress(p.grad) for p in ps])
    factor = optimizer.gradient_predivide_factor if optimizer.op == hvd.Average else 1.0
    names = [optimizer._parameter_names.get(p) for p in ps]
    handle = hvd.grouped_allreduce_async_(list(tensors), name=collectives.bucket_name(names), op=optimizer.op,
                                          prescale_factor=1.0 / factor, postscale_factor=factor,
                                          process_set=optimizer.process_set)
    return handle, contexts


def gradient_compression(fp16):
    """Horovod: gradients sent as fp16 (--fp16-allreduce) or as they are, in any layout."""
    return _AnyLayout(hvd.Compression.fp16 if fp16 else hvd.Compression.none)


def exit_quietly_on_interrupt():
    """Ctrl-C on a launcher kills ranks with SIGINT: no traceback wall."""
    sys.excepthook = _quiet_keyboard_interrupt(sys.excepthook)


def _quiet_keyboard_interrupt(previous):
    def hook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            sys.exit(130)
        previous(kind, value, traceback)
    return hook
