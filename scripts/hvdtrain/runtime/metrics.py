"""Metrics averaged exactly across ranks: allreduce sums and counts, then divide.

A mean of per-rank (or per-batch) means is wrong whenever ranks or batches hold
different numbers of samples; sums and counts are exact.
"""
import time

import torch

from hvdtrain.runtime import collectives


class SumMeter:
    """Sums of named quantities with their sample counts, reducible across ranks.

    Name the quantities up front (``SumMeter("loss", "top1")``): a rank that saw
    no samples then still joins the allreduce with zeros instead of leaving the
    other ranks waiting for a tensor it never sends.
    """

    def __init__(self, *names):
        self.names = names
        self.reset()

    def add(self, name, total, count):
        """Add ``total`` (a sum over ``count`` samples) to ``name``."""
        total = float(total.detach().item() if torch.is_tensor(total) else total)
        self.sums[name] = self.sums.get(name, 0.0) + total
        self.counts[name] = self.counts.get(name, 0) + int(count)

    def reduce(self, name_prefix="meter"):
        """Averages over every sample on every rank: {name: sum / count}."""
        return averages(self.reduce_totals(name_prefix))

    def reduce_totals(self, name_prefix="meter"):
        """{name: [sum, count]} over every rank."""
        if not self.sums:
            return {}
        # Horovod: sum the sums and the counts over all ranks.
        return self.totals_of(collectives.sum_over_ranks(self.local_totals(), name=f"{name_prefix}.sums"))

    def local_totals(self):
        """This rank's [sum, count] of each name, in name order: a float64 tensor to sum over the ranks."""
        return torch.tensor([[self.sums[n], float(self.counts[n])] for n in sorted(self.sums)], dtype=torch.float64)

    def totals_of(self, summed):
        """{name: [sum, count]} of ``local_totals()`` summed over the ranks."""
        return dict(zip(sorted(self.sums), summed.tolist()))

    def reset(self):
        self.sums = {name: 0.0 for name in self.names}
        self.counts = {name: 0 for name in self.names}

    # A checkpoint holds every rank's partial sums, so a resumed run reports the
    # same averages as an uninterrupted one (see checkpoint.Checkpointer).
    def state_dict(self):
        return {"sums": dict(self.sums), "counts": dict(self.counts)}

    def load_state_dict(self, state):
        self.sums, self.counts = dict(state["sums"]), dict(state["counts"])

    def load_resized(self, entries, rank, step):
        """Resumed on another number of ranks: rank 0 holds the old ranks' sums, the others none,
        so the reduced totals (all that is ever reported) are the checkpoint's."""
        self.reset()
        for entry in entries if rank == 0 else []:
            for name, total in entry["sums"].items():
                self.add(name, total, entry["counts"][name])


class EpochSums:
    """The epoch's training sums over every rank, and its metrics at its end; a checkpoint component.

    ``folded`` (--elastic, --global-batch): at every checkpoint and --elastic commit
    (``to_sum``/``summed``, in the save's one allreduce) the ranks' partial sums join ``totals``, so a lost
    worker takes none of the committed steps' counts with it and the epoch's row covers
    every sample once (``train_samples``). Otherwise each rank keeps its own sums (the
    ``meter``, a per-rank checkpoint component) until the epoch's end reduces them.
    """

    def __init__(self, meter, folded):
        self.meter = meter  # this rank's SumMeter of the epoch's training sums
        self.folded = folded
        self.totals = {}  # name -> [sum, count] over every rank, folded in so far

    def state_dict(self):
        return {"totals": self.totals}

    def load_state_dict(self, state):
        self.totals = {name: list(total) for name, total in state["totals"].items()}

    def to_sum(self):
        """At every checkpoint and commit (checkpoint.around_save): this rank's sums, when folded."""
        return [self.meter.local_totals()] if self.folded and self.meter.sums else []

    def summed(self, sums):
        if sums:
            self._fold(self.meter.totals_of(sums[0]))

    def _fold(self, reduced):
        for name, (total, count) in reduced.items():
            kept = self.totals.setdefault(name, [0.0, 0.0])
            kept[0], kept[1] = kept[0] + total, kept[1] + count
        self.meter.reset()

    def epoch_metrics(self, world_size):
        """The epoch's averages over every sample of every rank; collective (one allreduce)."""
        if not self.folded:
            return self.meter.reduce("train")
        self._fold(self.meter.reduce_totals("train"))  # Horovod: one allreduce
        return {**averages(self.totals), "train_samples": int(self.totals["train_top1"][1]),
                "world_size": world_size}

    def next_epoch(self):
        self.meter.reset()
        self.totals = {}


def averages(totals):
    """{name: sum / count} of {name: [sum, count]}."""
    return {n: (s / c if c else float("nan")) for n, (s, c) in totals.items()}


def topk_correct(logits, targets, ks=(1, 5)):
    """Number of samples whose target is in the top-k predictions, for each k."""
    max_k = min(max(ks), logits.size(1))
    top = logits.topk(max_k, dim=1).indices
    hits = top.eq(targets.view(-1, 1))
    return [int(hits[:, :min(k, max_k)].any(dim=1).sum().item()) for k in ks]


# A launch's first steps pay for allocation, autotuning and Horovod's tensor negotiation:
# left out of the rates here and of the straggler intervals (runtime/stragglers.py).
WARMUP_STEPS = 5


class Throughput:
    """Samples per second, per window (an epoch, a log interval) and for the launch.

    The first ``warmup_steps`` of a launch pay for allocation, autotuning and
    Horovod's tensor negotiation, so they are left out of every rate; a window
    made only of warm-up steps (a very short epoch) is rated over all its steps
    rather than reported as 0. A step's time runs from the previous ``step()``
    (or the window's start), so data loading counts.
    """

    def __init__(self, warmup_steps=WARMUP_STEPS):
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.launch = [0, 0.0]  # samples, seconds after the warm-up
        self.start_window()

    def start_window(self):
        self.window_timed = [0, 0.0]
        self.window_all = [0, 0.0]
        self.last = time.perf_counter()

    def step(self, samples):
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.steps += 1
        _add(self.window_all, samples, seconds)
        if self.steps > self.warmup_steps:
            _add(self.window_timed, samples, seconds)
            _add(self.launch, samples, seconds)

    def window_rate(self):
        """Local samples/s over the current window; None when it has no steps."""
        return _rate(self.window_timed) or _rate(self.window_all)

    def launch_rate(self):
        """Local samples/s since the warm-up; None before any step was timed."""
        return _rate(self.launch)

    def launch_rates(self, size):
        """(samples/s of this launch over every rank, per rank); 0 where nothing was timed. Collective."""
        return total_throughput(self.launch_rate() or self.window_rate(), size)

    def window_rates(self, size):
        """(samples/s over every rank, per rank, seconds) of the window so far. Collective."""
        total, per_worker = total_throughput(self.window_rate(), size)
        return total, per_worker, self.window_all[1]


def _add(total, samples, seconds):
    total[0] += samples
    total[1] += seconds


def _rate(total):
    samples, seconds = total
    return samples / seconds if samples and seconds > 0 else None


def rate_text(rate, unit, digits=1):
    """``863.2 images/s``; a launch too short to time says so instead of ``0.0 images/s``."""
    return f"{rate:.{digits}f} {unit}/s" if rate else f"{unit}/s: too few steps to time"


def total_throughput(local_rate, size):
    """(samples/s summed over the ``size`` ranks, the same per rank); 0 where not yet measured."""
    rate = torch.tensor([local_rate or 0.0], dtype=torch.float64)
    total = collectives.sum_over_ranks(rate, name="throughput").item()  # Horovod: one allreduce
    return total, total / size
