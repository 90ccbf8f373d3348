"""Every collective the package makes, each one named call: the one module that calls Horovod's.

Agreement (every rank's verdict on a check, one line and the same exit everywhere),
votes (all, any, which ranks), sums and averages over the ranks, gathers (to every
rank, to rank 0), and broadcasts from one rank: the model's parameters, a small
object, a nested state whose tensors travel as raw bytes. Every function here is
collective: every rank calls it, in the same order, with the same ``name`` (the
name Horovod matches the ranks' requests by, and the one a hang report shows).
The scripts make their own Horovod calls in plain sight (hvd.init,
hvd.DistributedOptimizer, hvd.elastic.run) and call these for the rest.
"""
import os
import pickle
import sys

import torch
import horovod.torch as hvd

from hvdtrain.errors import Agreement
from hvdtrain.liveness.recorder import GRADIENT

_OPTIMIZER = os.path.join("horovod", "torch", "optimizer.py")

# Bytes of tensors packed into one broadcast by broadcast_state: Horovod negotiates every
# collective, so one broadcast a tensor took 0.48 s for ResNet-20's model and momentum (175
# tensors, 2.2 MB) at 16 ranks on 2 cores, packed 0.05-0.10 s: the survivors wait for it in
# every elastic reset. The root packs a buffer at a time: a 4 GB state costs it 64 MiB more.
_BROADCAST_BYTES = 64 << 20


def _allgather_verdicts(message):
    # Horovod: every rank's verdict. The name must be explicit: allgather_object
    # defaults it to the object's type, so None on one rank and a message on
    # another would be two different collectives and both ranks would wait forever.
    return hvd.allgather_object(message, name="agree_on_errors")


# ``agree_on_errors(check, *args)``: check's result on every rank, or the one line of the first
# rank's UsageError on every rank (errors.Agreement over one allgather_object).
agree_on_errors = Agreement(_allgather_verdicts)
# The same checks on this rank alone: an --elastic worker may join a running job, whose
# ranks are in the elastic sync; a collective before that sync would never be matched.
ALONE = Agreement()


def agreement(alone=False):
    """The start checks' agreement: ``agree_on_errors``, or ``ALONE`` (--elastic)."""
    return ALONE if alone else agree_on_errors


def all_ranks_true(flag, name="all_ranks_true"):
    """True when ``flag`` is true on every rank (one tiny allreduce)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return int(hvd.allreduce(value, op=hvd.Min, name=name).item()) == 1  # Horovod


def any_rank_true(flag, name="any_rank_true"):
    """True when ``flag`` is true on at least one rank (one tiny allreduce)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return int(hvd.allreduce(value, op=hvd.Max, name=name).item()) == 1  # Horovod


def ranks_where(flag, name="ranks_where"):
    """The ranks where ``flag`` is true, the same list on every rank (one tiny allgather)."""
    return [rank for rank, bit in enumerate(every_ranks_int(1 if flag else 0, name)) if bit]


def every_ranks_int(value, name):
    """Every rank's ``value`` (an int32), in rank order, the same list on every rank (one tiny allgather)."""
    return hvd.allgather(torch.tensor([value], dtype=torch.int32), name=name).tolist()  # Horovod


def barrier(name):
    """Every rank waits here until all have arrived (one tiny allreduce)."""
    all_ranks_true(True, name=name)


def sum_over_ranks(tensor, name):
    """The elementwise sum of every rank's ``tensor`` (float64 sums stay exact to the last count)."""
    return hvd.allreduce(tensor, op=hvd.Sum, name=name)  # Horovod


def sum_packed_over_ranks(tensors, name):
    """Every rank's ``tensors`` (any shapes and dtypes) summed elementwise in one float64 allreduce;
    the sums back as float64 tensors of their shapes: one negotiation and one wait for the slowest
    rank for many small tensors (float64 keeps sums of counts exact)."""
    if not tensors:
        return []
    packed = torch.cat([tensor.detach().reshape(-1).to(torch.float64) for tensor in tensors])
    total = hvd.allreduce(packed, op=hvd.Sum, name=name)  # Horovod
    parts = torch.split(total, [tensor.numel() for tensor in tensors])
    return [part.view(tensor.shape) for part, tensor in zip(parts, tensors)]


def max_over_ranks(tensor, name):
    """The elementwise maximum of every rank's ``tensor``."""
    return hvd.allreduce(tensor, op=hvd.Max, name=name)  # Horovod


def allgather(tensor, name):
    """Every rank's ``tensor`` (same shape but the first dimension), concatenated in rank order."""
    return hvd.allgather(tensor, name=name)  # Horovod


def allgather_object(obj, name):
    """Every rank's ``obj`` (pickled), a list in rank order on every rank."""
    return hvd.allgather_object(obj, name=name)  # Horovod


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


def broadcast_object(obj, root_rank=0, name=None):
    """Horovod: rank 0's object on every rank (pickled over the wire)."""
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


class _TensorSlot:
    """Stands for one tensor in the skeleton that ``broadcast_state`` pickles."""

    def __init__(self, index, shape, dtype):
        self.index, self.shape, self.dtype = index, shape, dtype


def broadcast_state(state, root_rank=0):
    """Rank ``root_rank``'s nested state on every rank, with no pickle of its tensors.

    Only the structure (keys, plain values, tensor shapes and dtypes) is pickled;
    the tensors' raw bytes then follow, packed into buffers of up to 64 MiB on the
    host (``_BROADCAST_BYTES``), and are copied into tensors allocated in place.
    """
    tensors = []

    def strip(value):
        if torch.is_tensor(value):
            tensors.append(value)
            return _TensorSlot(len(tensors) - 1, tuple(value.shape), str(value.dtype).split(".")[-1])
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(item) for item in value)
        return value

    root = hvd.rank() == root_rank
    skeleton = strip(state) if root else None
    skeleton = broadcast_object(skeleton, root_rank=root_rank, name="checkpoint.skeleton")
    slots = []

    def fill(value):
        if isinstance(value, _TensorSlot):
            tensor = tensors[value.index] if root else torch.empty(value.shape, dtype=getattr(torch, value.dtype))
            slots.append(tensor)
            return tensor
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(item) for item in value)
        return value

    result = fill(skeleton)
    for index, group in enumerate(_packs([tensor for tensor in slots if tensor.numel()])):
        if root:  # (a GPU state is sent from the host: every rank receives on the host)
            views = [tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8) for tensor in group]
        else:
            views = [tensor.reshape(-1).view(torch.uint8) for tensor in group]
        sizes = [view.numel() for view in views]
        if len(views) == 1:  # a tensor alone (one over 64 MiB too): its own bytes, no copy
            packed = views[0]
        else:
            packed = torch.cat(views) if root else torch.empty(sum(sizes), dtype=torch.uint8)
        # Horovod: the bytes of a pack of tensors (any dtypes), in place.
        hvd.broadcast_(packed, root_rank, name=f"checkpoint.tensors.{index}")
        if not root and len(views) > 1:
            for view, piece in zip(views, packed.split(sizes)):
                view.copy_(piece)
    return result


def _packs(tensors):
    """``tensors`` in order, in groups of up to ``_BROADCAST_BYTES`` (a larger tensor alone)."""
    group, size = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > _BROADCAST_BYTES:
            yield group
            group, size = [], 0
        group.append(tensor)
        size += nbytes
    if group:
        yield group


# ----------------------------------------------------------------------------- the flight recorder
_SUBMITTERS = {  # horovod.torch.mpi_ops' private submission functions: every collective passes one
    "_allreduce_async": "allreduce", "_grouped_allreduce_async": "grouped_allreduce",
    "_allgather_async": "allgather", "_grouped_allgather_async": "grouped_allgather",
    "_broadcast_async": "broadcast", "_alltoall_async": "alltoall",
    "_reducescatter_async": "reducescatter", "_grouped_reducescatter_async": "grouped_reducescatter",
}


def record_into(recorder):
    """Every collective of this process into ``recorder`` (liveness/recorder.py), once: Horovod's
    own (DistributedOptimizer's gradients, a user's hvd.allreduce) and this module's alike.

    Each of horovod.torch's functions submits through one private function of its
    mpi_ops module and completes in ``synchronize``; those are wrapped, in mpi_ops and
    where Horovod imported them by name (its optimizer, its functions).
    """
    from horovod.torch import mpi_ops
    if getattr(mpi_ops, "_hvdtrain_recorded", False):
        return None
    swapped = []  # (module, attribute, original): what ``undo`` puts back (tools/measure_flight_recorder.py)
    for function, op in _SUBMITTERS.items():
        if hasattr(mpi_ops, function):
            swapped.append((mpi_ops, function, getattr(mpi_ops, function)))
            setattr(mpi_ops, function, _recorded_submission(getattr(mpi_ops, function), op, recorder))
    original = mpi_ops.synchronize
    synchronize = _recorded_completion(original, recorder)
    for name, module in list(sys.modules.items()):  # mpi_ops, and where it was imported by name
        if name.startswith("horovod.torch") and getattr(module, "synchronize", None) is original:
            swapped.append((module, "synchronize", original))
            module.synchronize = synchronize
    mpi_ops._hvdtrain_recorded = True
    recorded = [(module, attribute, getattr(module, attribute)) for module, attribute, _ in swapped]

    def switch(on):
        """The hooks in (True) or out (False): the recorder's cost, measured in one job."""
        for module, attribute, function in (recorded if on else swapped):
            setattr(module, attribute, function)
    return switch


_NAME_AT = {"broadcast": 2, "alltoall": 3}  # the name's position after the tensor; 1 for the others
_BUCKET_SPAN = " ... "


def bucket_name(names):
    """A bucket of gradients' name for Horovod (dist.fixed_gradient_buckets): its first and last parameter's."""
    return names[0] if len(names) == 1 else f"{names[0]}{_BUCKET_SPAN}{names[-1]}"


def _recorded_submission(submit, op, recorder):
    at = _NAME_AT.get(op, 1)

    def recorded(tensor, *args, **kwargs):
        handle = submit(tensor, *args, **kwargs)
        name = kwargs["name"] if "name" in kwargs else args[at] if len(args) > at else None
        gradient = (sys._getframe(2).f_code.co_filename.endswith(_OPTIMIZER)
                    or sys._getframe(3).f_code.co_filename.endswith(_OPTIMIZER))
        first = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
        more = len(tensor) - 1 if first is not tensor else 0
        name, last, kind = name if isinstance(name, str) else str(name), None, op
        if gradient:
            # DistributedOptimizer's: Horovod names them by parameter; a bucket of them is one
            # grouped allreduce, named by its first and last (dist.fixed_gradient_buckets)
            name, _, last = name.partition(_BUCKET_SPAN)
            name, last, kind = f"{GRADIENT}{name}", f"{GRADIENT}{last}" if last else None, "allreduce"
        recorder.submitted(handle, kind, name, (first.dtype, first.shape, more), burst=gradient,
                           count=more + 1 if gradient else 1, last=last)
        return handle
    return recorded


def _recorded_completion(synchronize, recorder):
    def recorded(handle):
        recorder.wait_started()
        try:
            output = synchronize(handle)
        except Exception:
            recorder.failed_at(handle)
            raise
        finally:
            recorder.wait_ended()
        recorder.completed(handle)
        return output
    return recorded
