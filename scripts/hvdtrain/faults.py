"""Failures of one rank: test-only fault injection, and one-line reports.

Fault injection (tests and the fault matrix only): set

    HVDTRAIN_FAULT="rank=1,step=20,kind=stop"

and that rank, right after finishing that step, does one of
  stop      SIGSTOP itself: the whole process frozen (a hung node)
  deadlock  block its main thread forever; Horovod's thread stays alive
  kill      SIGKILL itself (a crashed node, the OOM killer)
  raise     raise an exception on this rank only (a bug, a bad file)
  slow-checkpoint  sleep ``seconds`` (default 30) inside the checkpoint write of
            that step: a legitimate long phase, which must not be killed.

``report(error)`` turns an exception that ends a rank into one line naming the
rank and the cause: a peer's failure (HorovodInternalError, Gloo's transport
errors) or this rank's own exception, instead of a traceback wall.
"""
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from . import cli

FAULT_ENV = "HVDTRAIN_FAULT"
TRACEBACK_ENV = "HVDTRAIN_TRACEBACK"
KINDS = ("stop", "deadlock", "kill", "raise", "slow-checkpoint")
FAILED_EXIT = 1
# Exiting runs Horovod's shutdown; when a peer is gone it can wait for that peer.
EXIT_GRACE_SECONDS = 10


@dataclass
class Fault:
    rank: int
    step: int
    kind: str
    seconds: float = 30.0


def parse(text):
    """HVDTRAIN_FAULT's value -> Fault (a UsageError names what is wrong)."""
    fields = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        fields[key.strip()] = value.strip()
    try:
        fault = Fault(int(fields.pop("rank")), int(fields.pop("step", 1)), fields.pop("kind"),
                      float(fields.pop("seconds", 30)))
    except (KeyError, ValueError):
        raise cli.UsageError(f"{FAULT_ENV}={text!r}: expected rank=R,step=N,kind=K[,seconds=S]") from None
    if fault.kind not in KINDS or fields:
        raise cli.UsageError(f"{FAULT_ENV}={text!r}: kind must be one of {', '.join(KINDS)}; "
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


_last_step = None  # the latest finished step, for the one-line reports


def at_step(rank, step):
    """Called after every training step: inject the planned fault there."""
    global _last_step
    _last_step = step
    fault = planned()
    if not fault or fault.kind == "slow-checkpoint" or fault.rank != rank or fault.step != step:
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
    if fault and fault.kind == "slow-checkpoint" and fault.rank == rank and step == fault.step:
        time.sleep(fault.seconds)


def is_peer_failure(error):
    """True for the errors a rank gets when another rank died or left mid-collective."""
    name = type(error).__name__
    return name == "HorovodInternalError" or "gloo" in str(error).lower()


def describe(error, who):
    """One line: who ("rank 1", or the script when launched alone), and what ended it."""
    # Horovod's messages run on for several sentences: the first says what happened.
    first_line = (str(error).strip().splitlines() or [""])[0].split(". ")[0][:200]
    after = f" after step {_last_step}" if _last_step is not None else ""
    if is_peer_failure(error):
        return (f"{who}: error: a collective failed{after}: another rank died, froze or left the job "
                f"({type(error).__name__}: {first_line})")
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    place = f" at {os.path.relpath(where.filename)}:{where.lineno} in {where.name}" if where else ""
    return (f"{who}: error: {type(error).__name__}{after}: {first_line}{place} "
            f"({TRACEBACK_ENV}=1 prints the traceback)")


def report(error):
    """Print ``error`` as one line (the traceback only on request), then exit 1."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(error)
    launched = any(os.environ.get(name) for name in cli.LAUNCHER_RANK_VARS)
    who = f"rank {cli.launcher_rank()}" if launched else os.path.basename(sys.argv[0])
    print(describe(error, who), file=sys.stderr, flush=True)
    # A normal exit (atexit: the run lock, Horovod's shutdown), unless the shutdown
    # waits on a peer that is gone.
    threading.Thread(target=_exit_after_grace, daemon=True).start()
    sys.exit(FAILED_EXIT)


def _exit_after_grace():
    time.sleep(EXIT_GRACE_SECONDS)
    os._exit(FAILED_EXIT)
