"""BatchNorm running statistics across data-parallel ranks.

Without SyncBatchNorm each rank's running statistics follow its own shard. The
saved and evaluated model uses their average (rank 0's alone would make the
reported accuracy not the saved model's), while each rank keeps its own between
epochs, so that a resumed run continues exactly like an uninterrupted one. Under
--elastic every rank takes the average at each commit (a worker that replaces a
lost one can be given nothing else).
"""
import torch

from hvdtrain.runtime import collectives, dist


def _statistics(model):
    return [(f"{name}.{kind}", getattr(module, kind)) for name, module in model.named_modules()
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats
            for kind in ("running_mean", "running_var")]


def average_statistics(model):
    """Replace every rank's running statistics by their average. Collective."""
    buffers = [tensor for _, tensor in _statistics(model)]
    # Horovod: one allreduce for all of them
    _take_average(buffers, collectives.sum_packed_over_ranks(buffers, name="batchnorm_statistics"))


def _take_average(buffers, sums):
    """The ranks' sums (float64, collectives.sum_packed_over_ranks) divided by their number: the
    average of ranks that already agree is their own value again, bit for bit."""
    for tensor, total in zip(buffers, sums):
        tensor.copy_(total / dist.world_size())


class RankStatistics:
    """This rank's own running statistics: a per-rank checkpoint component.

    Around a save (checkpoint.around_save; collective) the model holds the ranks'
    average, which is what the checkpoint saves as the model, and this component
    this rank's own; after it, the model has this rank's own again. The average
    comes in the save's one allreduce (``to_sum``, ``summed``).
    """

    def __init__(self, model):
        self.model = model
        self.own = None  # this rank's statistics while the model holds the average

    def before_save(self):
        self.own = [tensor.clone() for _, tensor in _statistics(self.model)]

    def to_sum(self):
        return [tensor for _, tensor in _statistics(self.model)]

    def summed(self, sums):
        _take_average(self.to_sum(), sums)

    def at_commit(self, step, rank):
        """--elastic, at a commit (inside a save: the model holds the ranks' average): every rank
        takes the average as its own. A lost rank takes its own statistics with it, and the worker
        that replaces it gets those of the rank the state comes from; with every rank's the same
        at the commit, a reset that returns to the same size trains on exactly as the run without
        it (with each rank's own kept, the sync gave every rank that one rank's: other weights).
        Outside a save (the sync after a reset, the run's start) the model already holds what
        the commit holds."""
        if self.own is not None:
            self.own = [tensor.clone() for _, tensor in _statistics(self.model)]

    def after_save(self):
        for (_, tensor), value in zip(_statistics(self.model), self.own):
            tensor.copy_(value)
        self.own = None

    def state_dict(self):
        names = [name for name, _ in _statistics(self.model)]
        own = self.own if self.own is not None else [tensor for _, tensor in _statistics(self.model)]
        return {name: tensor.clone() for name, tensor in zip(names, own)}

    def load_state_dict(self, state):
        for name, tensor in _statistics(self.model):
            tensor.copy_(state[name])
