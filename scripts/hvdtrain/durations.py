"""How long things take on this rank: the parts of each step, and the run's collective moments.

``SectionTimer``: the seconds of each step spent waiting for ``data``, in
``compute`` (forward and backward), in ``comm`` (waiting for the gradient
allreduce) and in the ``optimizer`` step; the trainers time their steps with
one, and runtime/stragglers.py compares the ranks' sums every interval.

``timed``/``summary``: the run's collective moments, results.json "durations".

What grows with the number of ranks shows here rather than in the step time:
the rank agreement check (one allgather of a 32-byte digest per rank), each
checkpoint's per-rank gather and write, restores, elastic resets. One set per
process; the watchdog's phases add to it (liveness/watchdog.py), the other
moments use ``timed``. tools/scale_study.py reads rank 0's at 1 to 32 ranks
(docs/scale.md).
"""
import contextlib
import time

SECTIONS = ("data", "compute", "comm", "optimizer")


class SectionTimer:
    """Seconds this rank spent in each part of its steps since the last reset."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.seconds = dict.fromkeys(SECTIONS, 0.0)
        self.steps = 0

    @contextlib.contextmanager
    def section(self, name):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def timed(self, iterable, name="data"):
        """``iterable``'s items, the time waiting for each counted in ``name``."""
        iterator = iter(iterable)
        while True:
            started = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self.seconds[name] += time.perf_counter() - started
            yield item


UNTIMED = SectionTimer()  # for callers that time nothing (the benchmark's plain loops)


_seen = {}  # name -> (count, total seconds, longest)


@contextlib.contextmanager
def timed(name):
    started = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - started)


def add(name, seconds):
    count, total, longest = _seen.get(name, (0, 0.0, 0.0))
    _seen[name] = (count + 1, total + seconds, max(longest, seconds))


def summary():
    """{name: {"count", "total_s", "max_s"}} of everything timed so far in this process."""
    return {name: {"count": count, "total_s": round(total, 4), "max_s": round(longest, 4)}
            for name, (count, total, longest) in sorted(_seen.items())}
