"""--elastic BERT data: one order of the epoch's instances, whatever the world size.

``PretrainingData`` splits each epoch's shards among the ranks by the world
size, so its position means nothing at another size. Under --elastic the epoch
has one global order, the one a single rank reads (the shards shuffled by
seed+epoch and laid end to end, each shard's rows of a length bin shuffled
inside it), and ``BinPosition`` counts the instances of each bin trained so
far. Each step draws from one bin (a seeded choice among the steps the bins
have left, the same on every rank) and takes that bin's next
ranks x batch x accumulation instances (--global-batch N: N at every size); rank r takes the r-th of ``size``
near-equal slices of them (--balance, without --elastic: slices following the
ranks' speed, see training/balance.py). After a reset the new world goes on from the
committed position, so every instance of the epoch is trained exactly once at
whatever sizes the epoch ran (as ``sampling.ElasticBatchSampler`` does for the
CNN). A bin's last step takes what is left of it (``sampling.global_steps``),
so ranks' batches may differ by a sequence. Every rank reads every shard and
keeps its slices: memory still holds about two shards per bin.

Pure (no Horovod): the trainer passes rank, size and the position in.
"""
import bisect
import contextlib

import numpy as np

from hvdtrain import testhooks
from hvdtrain.data.bert_data import PretrainingData, ShardStream
from hvdtrain.data.sampling import assign_rows, global_steps

class BinPosition:
    """--elastic: the epoch in progress, its steps and the instances of each length bin trained.

    A checkpoint component, committed with the train state.
    """

    def __init__(self):
        self.epoch, self.steps, self.taken = 0, 0, []

    def state_dict(self):
        return {"epoch": self.epoch, "steps": self.steps, "taken": list(self.taken)}

    def load_state_dict(self, state):
        self.epoch, self.steps, self.taken = state["epoch"], state["steps"], list(state["taken"])

    def at(self, epoch, bins):
        """(steps, instances taken per bin) of ``epoch``: nothing yet unless it is in progress."""
        if self.epoch == epoch and self.taken:
            return self.steps, self.taken
        return 0, [0] * bins

    def where(self, totals):
        return f"epoch {self.epoch} goes on from instance {sum(self.taken)} of {sum(totals)}"


class ElasticPretrainingData(PretrainingData):
    """``PretrainingData``'s interface over the global order; ``advance()`` after each step."""

    def __init__(self, directory, metadata, rank, size, seed, micro_batch, accumulation, position,
                 mlm_probability=0.15, binned=False, reading=contextlib.nullcontext, global_batch=None, shares=None):
        super().__init__(directory, metadata, rank, size, seed, micro_batch, accumulation, mlm_probability,
                         binned=binned, reading=reading)
        self.position = position
        self.global_batch = global_batch  # instances per step (None: size x micro_batch x accumulation)
        self.shares = shares  # --balance: instances per rank and step (a list changed in place), or equal
        self.totals = [sum(sizes) for sizes, _, _ in self.bins]
        self.plan = None  # the step in progress: (step, bin, start, stop, [instance ids])
        self.record = testhooks.recording_instances()  # test-only (HVDTRAIN_RECORD_INSTANCES)

    def _steps_left(self, taken):
        """Per bin: [(start, stop)] of its steps left at this size (one sequence per rank and micro-batch at least)."""
        whole = self.global_batch or self.size * self.micro_batch * self.accumulation
        return [global_steps(start, total, whole, self.size * self.accumulation)
                for start, total in zip(taken, self.totals)]

    def steps_in_epoch(self, epoch):
        """The epoch's steps: those trained (at any size) and those left at this size."""
        steps, taken = self.position.at(epoch, len(self.bins))
        return steps + sum(map(len, self._steps_left(taken)))

    def resumed_mid_epoch(self, epoch):
        """A line saying where the epoch goes on, or None at its start."""
        return self.position.where(self.totals) if self.position.at(epoch, len(self.bins))[0] else None

    def start_epoch(self, epoch, step=0):
        """Plan ``epoch`` from the position and read the piece of this rank's next rows."""
        steps, taken = self.position.at(epoch, len(self.bins))
        self.position.epoch, self.position.steps, self.position.taken = epoch, steps, list(taken)
        self.epoch, self.streams, self.plan = epoch, [], None
        for b, (sizes, firsts, _) in enumerate(self.bins):
            pieces = [(self.entries[shard], firsts[shard] + start, firsts[shard] + stop)
                      for shard, start, stop in assign_rows(sizes, 0, 1, self.seed, epoch)]
            self.streams.append(ShardStream(pieces, (self.seed, epoch, b), self._load, self.reader, self.reading))
        if steps < self.steps_in_epoch(epoch):
            _, b, low, _ = self._rank_rows(0)
            stream = self.streams[b]
            stream.piece(stream.piece_at(low))

    def _next_step(self):
        """(bin, start, stop) of the next step: a bin drawn in proportion to the steps it has left."""
        left = self._steps_left(self.position.taken)
        counts = np.cumsum([len(steps) for steps in left])
        rng = np.random.default_rng([self.seed, self.epoch, sum(self.position.taken)])
        b = bisect.bisect_right(counts.tolist(), int(rng.integers(counts[-1])))
        return (b, *left[b][0])

    def _rank_rows(self, micro):
        """(step, bin, first, stop) of this rank's rows of micro-batch ``micro`` of the next step."""
        if self.plan is None:
            self.plan = (self.position.steps, *self._next_step(), [])
        step, b, start, stop, _ = self.plan
        if self.shares is None:
            low = start + self.rank * (stop - start) // self.size
            share = start + (self.rank + 1) * (stop - start) // self.size - low
        else:
            parts = cut(stop - start, self.shares, self.accumulation)
            low, share = start + sum(parts[:self.rank]), parts[self.rank]
        return step, b, low + micro * share // self.accumulation, low + (micro + 1) * share // self.accumulation

    def batch(self, step, micro):
        """Micro-batch ``micro`` of step ``step`` of the epoch (the step after the position)."""
        planned, b, first, stop = self._rank_rows(micro)
        assert planned == step, (planned, step)
        if self.record:
            self.plan[4].extend(self._instance_ids(self.streams[b], first, stop - first))
        rng = np.random.default_rng([self.seed, self.epoch, b, first]) if not self.static else None
        return self._tensors(self.streams[b].rows(first, stop - first), b, rng)

    def advance(self, global_step):
        """The step trained: its instances join the position (and the test record)."""
        _, b, _, stop, ids = self.plan
        self.position.taken[b], self.position.steps, self.plan = stop, self.position.steps + 1, None
        if self.record:
            testhooks.instances_trained(global_step, self.epoch, self.size, self.rank, ids)

    @staticmethod
    def _instance_ids(stream, position, count):
        """"FILE:ROW" of ``count`` rows from ``position`` (the orders ShardStream draws, nothing read)."""
        ids = []
        while count:
            index = stream.piece_at(position)
            entry, start, stop = stream.pieces[index]
            order = np.random.default_rng([*stream.key, index]).permutation(stop - start)
            offset = position - (stream.ends[index - 1] if index else 0)
            rows = order[offset:offset + count]
            ids += [f"{entry['file']}:{start + int(row)}" for row in rows]
            position, count = position + len(rows), count - len(rows)
        return ids


def cut(count, shares, minimum):
    """--balance: ``count`` instances in parts following ``shares`` (exactly them for a whole step,
    scaled for a bin's last one), each at least ``minimum``."""
    if count == sum(shares):
        return list(shares)
    spare, total = count - minimum * len(shares), sum(shares)
    bounds = [spare * sum(shares[:r]) // total for r in range(len(shares) + 1)]
    return [minimum + high - low for low, high in zip(bounds, bounds[1:])]
