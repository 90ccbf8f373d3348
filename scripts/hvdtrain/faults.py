"""Test-only fault injection: a rank that freezes, deadlocks, dies or raises at a given step.

Fault injection (tests and the fault matrix only): set

    HVDTRAIN_FAULT="rank=1,step=20,kind=stop"

and that rank (or each of ``rank=12-15``: a whole node), right after finishing that step, does one of
  stop      SIGSTOP itself: the whole process frozen (a hung node)
  deadlock  block its main thread forever; Horovod's thread stays alive
  kill      SIGKILL itself (a crashed node, the OOM killer)
  raise     raise an exception on this rank only (a bug, a bad file)
  slow-checkpoint  sleep ``seconds`` (default 30) inside the checkpoint write of
            that step: a legitimate long phase, which must not be killed.

With ``phase=NAME`` the fault happens instead as that rank enters the watchdog
phase NAME after that step (``rank=1,step=44,kind=stop,phase=evaluating``): a
node lost in the middle of an evaluation or a checkpoint write.

What a job prints when a rank fails this way is ``hvdtrain.liveness.failures.report``'s one line.
"""
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from hvdtrain.errors import UsageError

FAULT_ENV = "HVDTRAIN_FAULT"
KINDS = ("stop", "deadlock", "kill", "raise", "slow-checkpoint")


@dataclass
class Fault:
    rank: int
    step: int
    kind: str
    seconds: float = 30.0
    last_rank: int = None  # rank=12-15: ranks 12 to 15
    phase: str = None  # phase=evaluating: as the rank enters that watchdog phase, not after the step

    def applies_to(self, rank):
        return self.rank <= rank <= (self.rank if self.last_rank is None else self.last_rank)


def parse(text):
    """HVDTRAIN_FAULT's value -> Fault (a UsageError names what is wrong)."""
    fields = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        fields[key.strip()] = value.strip()
    try:
        first, _, last = fields.pop("rank").partition("-")
        fault = Fault(int(first), int(fields.pop("step", 1)), fields.pop("kind"),
                      float(fields.pop("seconds", 30)), int(last) if last else None, fields.pop("phase", None))
    except (KeyError, ValueError):
        raise UsageError(f"{FAULT_ENV}={text!r}: expected "
                         "rank=R[-R2],step=N,kind=K[,seconds=S][,phase=NAME]") from None
    if fault.kind not in KINDS or fields:
        raise UsageError(f"{FAULT_ENV}={text!r}: kind must be one of {', '.join(KINDS)}; "
                         f"unknown keys: {', '.join(fields) or 'none'}")
    return fault


_planned = None


def planned():
    """This process's Fault, or None (read once from the environment)."""
    global _planned
    if _planned is None:
        text = os.environ.get(FAULT_ENV, "")
        _planned = parse(text) if text else False
    return _planned or None


def at_step(rank, step):
    """Called after every training step: inject the planned fault there."""
    fault = planned()
    if fault and not fault.phase:
        _inject(fault, rank, step)


def in_phase(rank, step, name):
    """Called as a rank enters a watchdog phase: inject the fault planned there."""
    fault = planned()
    if fault and fault.phase == name:
        _inject(fault, rank, step)


def _inject(fault, rank, step):
    # slow-checkpoint is no injection here: in_checkpoint_write sleeps inside the write.
    if fault.kind == "slow-checkpoint" or not fault.applies_to(rank) or fault.step != step:
        return
    # The wall-clock time lets the fault matrix measure how long the job took to end.
    print(f"rank {rank}: injecting fault {fault.kind} after step {step} at {time.time():.3f} ({FAULT_ENV})",
          file=sys.stderr, flush=True)
    if fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "deadlock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns: a main-thread deadlock
    elif fault.kind == "raise":
        raise RuntimeError(f"injected fault ({FAULT_ENV})")


def in_checkpoint_write(rank, step):
    """Called inside every checkpoint write: a slow file system, when planned."""
    fault = planned()
    if fault and fault.kind == "slow-checkpoint" and fault.applies_to(rank) and step == fault.step:
        time.sleep(fault.seconds)


