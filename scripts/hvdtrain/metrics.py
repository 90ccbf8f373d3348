"""Metrics averaged exactly across ranks: allreduce sums and counts, then divide.

A mean of per-rank (or per-batch) means is wrong whenever ranks or batches hold
different numbers of samples; sums and counts are exact.
"""
import time

import torch
import horovod.torch as hvd


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
        names = sorted(self.sums)
        if not names:
            return {}
        local = torch.tensor([[self.sums[n], float(self.counts[n])] for n in names],
                             dtype=torch.float64)
        # Horovod: sum the sums and the counts over all ranks.
        total = hvd.allreduce(local, op=hvd.Sum, name=f"{name_prefix}.sums")
        return {n: (s / c if c else float("nan")) for n, (s, c) in zip(names, total.tolist())}

    def reset(self):
        self.sums = {name: 0.0 for name in self.names}
        self.counts = {name: 0 for name in self.names}


def topk_correct(logits, targets, ks=(1, 5)):
    """Number of samples whose target is in the top-k predictions, for each k."""
    max_k = min(max(ks), logits.size(1))
    top = logits.topk(max_k, dim=1).indices
    hits = top.eq(targets.view(-1, 1))
    return [int(hits[:, :min(k, max_k)].any(dim=1).sum().item()) for k in ks]


class Throughput:
    """Samples per second over the steps after the first ``warmup_steps``.

    The first steps pay for allocation, autotuning and Horovod's tensor
    negotiation; counting them would understate steady-state speed.
    """

    def __init__(self, warmup_steps=5):
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.samples = 0
        # Without warm-up, time from now: the first step counts too.
        self.start = time.perf_counter() if warmup_steps == 0 else None

    def step(self, samples):
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.start = time.perf_counter()
        elif self.steps > self.warmup_steps:
            self.samples += samples

    def per_second(self):
        """Local samples/s, or None before enough steps were timed."""
        if self.start is None or self.samples == 0:
            return None
        return self.samples / (time.perf_counter() - self.start)


def total_throughput(local_rate):
    """(samples/s summed over all ranks, the same per rank); 0 where not yet measured."""
    rate = torch.tensor([local_rate or 0.0], dtype=torch.float64)
    total = hvd.allreduce(rate, op=hvd.Sum, name="throughput").item()  # Horovod
    return total, total / hvd.size()
