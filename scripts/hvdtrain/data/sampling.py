"""Data sharding by rank: resumable training samplers, unpadded validation split, shard rows per rank.

The three training samplers share one interface, whatever the mode: ``set_epoch(epoch,
start)`` begins the epoch at its sample ``start`` (of its order, the same on every rank),
``steps`` lists the global (start, stop) sample bounds of the steps left, and
``loader_batch_size`` says how a DataLoader takes them (a rank's batch size, or None for a
sampler that yields each step's indices).
"""
import torch
from torch.utils.data import Sampler


class ShardedSampler(Sampler):
    """Each rank's share of a shuffled epoch, resumable mid-epoch at any world size.

    The permutation depends only on (seed, epoch), so every rank agrees on it.
    Each step takes the next ``size * batch_size`` samples of it, rank r every
    ``size``-th of them starting at r, so the steps trained so far hold a prefix
    of the epoch's order whatever the world size was: ``start`` (samples) says
    where the epoch goes on, after a resume at the same size or another. What is
    left is cut to whole steps so every rank runs the same number of full steps:
    a rank with an extra step would wait forever in its allreduce.
    """

    def __init__(self, num_samples, rank, size, batch_size, seed, shuffle=True):
        self.num_samples = num_samples
        self.rank = rank
        self.size = size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start = 0
        self.global_batch = size * batch_size
        self.loader_batch_size = batch_size  # a DataLoader batches the indices it yields

    @property
    def steps_left(self):
        """Whole steps from ``start`` to the epoch's end."""
        return (self.num_samples - self.start) // self.global_batch

    @property
    def steps(self):
        """[(start, stop)] of the steps left, in samples of the epoch's order."""
        return [(self.start + k * self.global_batch, self.start + (k + 1) * self.global_batch)
                for k in range(self.steps_left)]

    def set_epoch(self, epoch, start=0):
        """Reseed for ``epoch``; begin at its sample ``start`` (a resume)."""
        self.epoch = epoch
        self.start = start

    def epoch_order(self):
        return epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)

    def __iter__(self):
        left = self.epoch_order()[self.start:self.start + self.steps_left * self.global_batch]
        return iter(left[self.rank::self.size].tolist())

    def __len__(self):
        return self.steps_left * self.batch_size


def epoch_order(num_samples, seed, epoch, shuffle=True):
    """The epoch's order of the samples: a function of (seed, epoch) only, the same on every rank."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator()
    generator.manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


class ElasticBatchSampler(Sampler):
    """--elastic: the rest of an epoch from a global sample position, at any world size.

    The epoch's order is ShardedSampler's. Each step takes the next
    ``size * batch_size`` samples of it (``global_steps``) and rank r the r-th
    of ``size`` near-equal slices of those, so after a reset the new world goes
    on from the committed sample and every sample of the epoch is trained
    exactly once, at whatever sizes the epoch ran. Nothing is cut: the last
    step takes what is left, so ranks' batches may differ by one sample.
    Yields each step's list of indices (a DataLoader ``batch_sampler``).
    """

    def __init__(self, num_samples, rank, size, batch_size, seed, min_share=1, global_batch=None):
        self.num_samples, self.rank, self.size = num_samples, rank, size
        self.batch_size, self.seed, self.min_share = batch_size, seed, min_share
        self.global_batch = global_batch or size * batch_size  # fixed: the same at every size
        self.epoch, self.steps = 0, []
        self.loader_batch_size = None  # yields each step's indices

    @property
    def steps_left(self):
        return len(self.steps)

    def set_epoch(self, epoch, start=0):
        """Reseed for ``epoch``; begin at its sample ``start``."""
        self.epoch = epoch
        self.steps = global_steps(start, self.num_samples, self.global_batch, self.size * self.min_share)

    def __iter__(self):
        order = epoch_order(self.num_samples, self.seed, self.epoch)
        for start, stop in self.steps:
            chunk = order[start:stop]
            yield chunk[self.rank * len(chunk) // self.size:(self.rank + 1) * len(chunk) // self.size].tolist()

    def __len__(self):
        return len(self.steps)


def global_steps(position, total, global_batch, smallest):
    """[(start, stop)] of the steps from sample ``position`` to ``total``, ``global_batch`` each.

    A last step of fewer than ``smallest`` samples (one per rank and backward
    pass: a rank with none would miss the allreduce) joins the step before.
    A remainder that small on its own (the world grew just before the end of
    the epoch) is left out.
    """
    bounds = list(range(position, total, global_batch)) + [total]
    if len(bounds) > 2 and total - bounds[-2] < smallest:
        del bounds[-2]
    steps = list(zip(bounds, bounds[1:]))
    return [(start, stop) for start, stop in steps if stop - start >= smallest]


class UnpaddedShardSampler(Sampler):
    """Validation: rank r takes samples r, r+size, ...; each sample counted once.

    Unlike DistributedSampler nothing is padded or repeated, so ranks may hold
    one sample more or less; metrics must then be reduced by sums and counts.
    """

    def __init__(self, num_samples, rank, size):
        self.indices = list(range(rank, num_samples, size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def assign_rows(sizes, rank, size, seed, epoch):
    """This rank's share of an epoch over files of ``sizes`` rows: [(file index, start, stop)].

    The files are shuffled by seed+epoch (as NVIDIA's shard assignment) and laid
    end to end; rank r takes rows [r*N/size, (r+1)*N/size) of that sequence. Every
    row belongs to exactly one rank and ranks hold N//size or N//size + 1 rows,
    whether or not the number of files divides by the number of ranks; a file
    that straddles two ranks' ranges is read in part by each.
    """
    order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    total = sum(sizes)
    low, high = rank * total // size, (rank + 1) * total // size
    pieces, start = [], 0
    for index in order:
        stop = start + sizes[index]
        if max(start, low) < min(stop, high):
            pieces.append((index, max(start, low) - start, min(stop, high) - start))
        start = stop
    return pieces


class BalancedSampler(Sampler):
    """--balance: each step's global batch split among the ranks in unequal ``shares``.

    Steps and their samples are ShardedSampler's (the epoch's order from sample
    ``start``, cut to whole global batches of ``sum(shares)``); only the cut
    between ranks moves: rank r takes the samples between the running sums of
    the shares before it and through it. ``shares`` is read at each ``iter()``,
    so new shares apply from the next iteration, the same step on every rank.
    Yields each step's list of indices (a DataLoader ``batch_sampler``).
    """

    def __init__(self, num_samples, rank, shares, seed):
        self.num_samples, self.rank, self.shares, self.seed = num_samples, rank, shares, seed
        self.epoch = self.start = 0
        self.loader_batch_size = None  # yields each step's indices

    @property
    def steps_left(self):
        return (self.num_samples - self.start) // sum(self.shares)

    @property
    def steps(self):
        """[(start, stop)] of the steps left, in samples of the epoch's order (the shares change none)."""
        global_batch = sum(self.shares)
        return [(self.start + k * global_batch, self.start + (k + 1) * global_batch) for k in range(self.steps_left)]

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def __iter__(self):
        order = epoch_order(self.num_samples, self.seed, self.epoch)
        global_batch, low = sum(self.shares), sum(self.shares[:self.rank])
        high = low + self.shares[self.rank]
        for step in range(self.steps_left):
            first = self.start + step * global_batch
            yield order[first + low:first + high].tolist()

    def __len__(self):
        return self.steps_left
