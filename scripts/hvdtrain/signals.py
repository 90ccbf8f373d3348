"""Preemption: SIGTERM/SIGUSR1 make every rank finish its step, checkpoint, exit 0.

Slurm sends SIGUSR1 before a time limit (``--signal``) and SIGTERM on
preemption, but not always to every rank at the same moment. Each rank only
records the signal; ``should_stop()`` is an allreduce, so all ranks stop after
the same step even when only one of them was signalled.
"""
import signal

from . import dist


class StopRequest:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.received = None
        for number in signals:
            signal.signal(number, self._record)

    def _record(self, number, _frame):
        self.received = signal.Signals(number).name

    def should_stop(self):
        """Collective: True on every rank once any rank has been signalled."""
        return dist.any_rank_true(self.received is not None)
