"""Test-only hooks: the one seam through which the suite and the fault matrix reach into a run.

Production code calls these functions at fixed points; each does nothing unless its
variable is set in the launch's environment. ``check_environment`` (dist.configure, before hvd.init) reads
them all at start, so a bad value is one line and exit 2 on every rank before step 1.

    HVDTRAIN_FAULT="rank=1,step=20,kind=stop"   after_step, phase_entered, checkpoint_writing
    HVDTRAIN_INJECT_NONFINITE="rank=1,steps=5,6" loss_computed: rank 1's loss NaN at steps 5, 6
    HVDTRAIN_RECORD_INSTANCES=FILE               instances_trained: one line per BERT --elastic step and rank

HVDTRAIN_FAULT: that rank (or each of ``rank=12-15``: a whole node), right after finishing
that step, does one of
  stop      SIGSTOP itself: the whole process frozen (a hung node)
  deadlock  block its main thread forever; Horovod's thread stays alive
  kill      SIGKILL itself (a crashed node, the OOM killer)
  raise     raise an exception on this rank only (a bug, a bad file)
  busy      compute for ``seconds`` (default 30) outside any collective: a long
            step (``rank=0-1``: on every rank, which is no hang).
  slow-checkpoint  sleep ``seconds`` (default 30) inside rank 0's write of that
            step's checkpoint file (--checkpoint-write async: in its background
            thread): a slow file system, a legitimate long wait that must not be killed.
  full-disk raise ENOSPC inside rank 0's write of that step's checkpoint file.
  skip-vote leave that step's NaN/Inf vote out (a rank-divergent collective: the others
            wait in the vote, this rank in the next step's gradients).

With ``phase=NAME`` the fault happens instead as that rank enters the watchdog
phase NAME after that step (``rank=1,step=44,kind=stop,phase=evaluating``): a
node lost in the middle of an evaluation or a checkpoint write.

What a job prints when a rank fails this way is ``hvdtrain.liveness.failures.report``'s one line.
"""
import errno
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from hvdtrain.errors import UsageError

FAULT_ENV = "HVDTRAIN_FAULT"
NONFINITE_ENV = "HVDTRAIN_INJECT_NONFINITE"
RECORD_ENV = "HVDTRAIN_RECORD_INSTANCES"
KINDS = ("stop", "deadlock", "kill", "raise", "busy", "slow-checkpoint", "full-disk", "skip-vote")
CHECKPOINT_KINDS = ("slow-checkpoint", "full-disk")  # at the checkpoint write, not after the step
IN_STEP_KINDS = ("skip-vote",)  # inside the step (skips_vote), not after it


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


def parse_fault(text):
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
                         "rank=R[-R2],step=N,kind=K[,seconds=S][,phase=NAME]", on_every_rank=True) from None
    if fault.kind not in KINDS or fields:
        raise UsageError(f"{FAULT_ENV}={text!r}: kind must be one of {', '.join(KINDS)}; "
                         f"unknown keys: {', '.join(fields) or 'none'}", on_every_rank=True)
    return fault


def parse_nonfinite(text):
    """HVDTRAIN_INJECT_NONFINITE's value, ``rank=1,steps=5,6`` -> {1: {5, 6}}; groups split by ';'."""
    injected = {}
    for group in filter(None, (part.strip() for part in text.split(";"))):
        try:
            rank_part, steps_part = group.split(",", 1)
            key, rank = rank_part.split("=")
            steps_key, steps = steps_part.split("=")
            if key.strip() != "rank" or steps_key.strip() != "steps":
                raise ValueError
            injected.setdefault(int(rank), set()).update(int(step) for step in steps.split(","))
        except ValueError:
            raise UsageError(f"{NONFINITE_ENV}={text!r}: expected e.g. rank=1,steps=5,6", on_every_rank=True) \
                from None
    return injected


_PARSERS = {FAULT_ENV: parse_fault, NONFINITE_ENV: parse_nonfinite}
_parsed = {}  # variable -> (its text, parsed): read again only when the environment changes


def _planned(name):
    text = os.environ.get(name, "")
    if _parsed.get(name, (None,))[0] != text:
        _parsed[name] = (text, _PARSERS[name](text) if text else None)
    return _parsed[name][1]


def check_environment():
    """Parse every hook's variable now: a bad value raises UsageError (exit 2) before training."""
    for name in _PARSERS:
        _planned(name)


def after_step(rank, step):
    """After every training step (the watchdog's ``step``, from Run.step_done): the fault planned there."""
    fault = _planned(FAULT_ENV)
    if fault and not fault.phase:
        _inject(fault, rank, step)


def phase_entered(rank, step, name):
    """As a rank enters a watchdog phase (Watchdog.phase): the fault planned there."""
    fault = _planned(FAULT_ENV)
    if fault and fault.phase == name:
        _inject(fault, rank, step)


def _inject(fault, rank, step):
    # slow-checkpoint, full-disk: no injection here; checkpoint_writing acts inside the write.
    if fault.kind in CHECKPOINT_KINDS + IN_STEP_KINDS or not fault.applies_to(rank) or fault.step != step:
        return
    _say_injected(fault, rank, f"after step {step}")
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
    elif fault.kind == "busy":
        time.sleep(fault.seconds)


def checkpoint_writing(rank, step):
    """As rank 0 writes a checkpoint file (Checkpointer): a slow file system or a full one, when planned."""
    fault = _planned(FAULT_ENV)
    if not (fault and fault.kind in CHECKPOINT_KINDS and fault.applies_to(rank) and step == fault.step):
        return
    if fault.kind == "full-disk":
        raise OSError(errno.ENOSPC, f"No space left on device ({FAULT_ENV})")
    time.sleep(fault.seconds)


def _say_injected(fault, rank, when):
    # The wall-clock time lets the fault matrix measure how long the job took to end.
    print(f"rank {rank}: injecting fault {fault.kind} {when} at {time.time():.3f} ({FAULT_ENV})",
          file=sys.stderr, flush=True)


def skips_vote(rank, step):
    """In step ``step``'s NaN/Inf vote (NonFiniteGuard.skip_step): whether this rank leaves it out,
    planned as kind=skip-vote (a rank-divergent collective, for the flight recorder's tests)."""
    fault = _planned(FAULT_ENV)
    skips = bool(fault and fault.kind == "skip-vote" and fault.applies_to(rank) and fault.step == step)
    if skips:  # its next collective is the next step's gradients, while the others wait in the vote
        _say_injected(fault, rank, f"in step {step}")
    return skips


def loss_computed(rank, step, loss):
    """Each backward pass's loss (NonFiniteGuard.watch): NaN where one is planned at ``step``."""
    if step in (_planned(NONFINITE_ENV) or {}).get(rank, ()):
        return loss * float("nan")  # keeps the graph: the gradients turn NaN too
    return loss


def recording_instances():
    """True when the BERT --elastic data should note the instances each step trains."""
    return bool(os.environ.get(RECORD_ENV))


def instances_trained(global_step, epoch, size, rank, ids):
    """Append "STEP EPOCH SIZE RANK FILE:ROW,..." for a step this rank trained."""
    line = f"{global_step} {epoch} {size} {rank} {','.join(ids)}\n"
    descriptor = os.open(os.environ[RECORD_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line.encode())  # one write: the ranks' lines do not mix
    finally:
        os.close(descriptor)


