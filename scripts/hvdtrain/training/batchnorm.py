"""BatchNorm running statistics across data-parallel ranks.

Without SyncBatchNorm each rank's running statistics follow its own shard. The
saved and evaluated model uses their average (rank 0's alone would make the
reported accuracy not the saved model's), while each rank keeps its own between
epochs, so that a resumed run continues exactly like an uninterrupted one.
"""
import contextlib

import torch
import horovod.torch as hvd


def _statistics(model):
    return [(f"{name}.{kind}", getattr(module, kind)) for name, module in model.named_modules()
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats
            for kind in ("running_mean", "running_var")]


def average_statistics(model):
    """Replace every rank's running statistics by their average. Collective."""
    buffers = [tensor for _, tensor in _statistics(model)]
    if buffers:
        # Horovod: one fused allreduce for all of them.
        for tensor, value in zip(buffers, hvd.grouped_allreduce(buffers, op=hvd.Average,
                                                                name="batchnorm_statistics")):
            tensor.copy_(value)


@contextlib.contextmanager
def averaged(model):
    """Inside: the ranks' average statistics (what a checkpoint saves); after: this rank's own."""
    own = [tensor.clone() for _, tensor in _statistics(model)]
    average_statistics(model)
    try:
        yield
    finally:
        for (_, tensor), value in zip(_statistics(model), own):
            tensor.copy_(value)


class OwnStatistics:
    """This rank's own running statistics: a per-rank checkpoint component."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {name: tensor.clone() for name, tensor in _statistics(self.model)}

    def load_state_dict(self, state):
        for name, tensor in _statistics(self.model):
            tensor.copy_(state[name])
