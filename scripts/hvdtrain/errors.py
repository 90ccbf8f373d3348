"""Errors and exit statuses: the ground floor every other module may import.

Exit statuses of every script (one line on stderr says why):

    0  done, or stopped on request (--stop-after, SIGTERM/SIGUSR1) with a checkpoint
    1  a rank failed (its own exception, or a peer that died, froze or left): ``report``
    2  bad input (``UsageError``): the same one line on every rank, printed once
    3  the progress watchdog ended a rank that made no progress (runtime/watchdog.py)
    4  a non-finite loss stopped the run (--nonfinite-loss stop, runtime/nonfinite.py)
    5  a straggler was found and the run checkpointed (--straggler-action checkpoint-exit,
       runtime/stragglers.py): relaunch without the host the line names

Every rank parses the same arguments and checks the same input, so bad input
makes every rank exit 2 on its own; only the first rank prints, so a 64-rank
job shows one line, not 64.
"""
import os
import signal
import sys
import threading
import time
import traceback

FAILED_EXIT = 1
USAGE_ERROR_EXIT = 2
WATCHDOG_EXIT = 3
NONFINITE_EXIT = 4
STRAGGLER_EXIT = 5

TRACEBACK_ENV = "HVDTRAIN_TRACEBACK"
# Exiting runs Horovod's shutdown; when a peer is gone it can wait for that peer.
EXIT_GRACE_SECONDS = 10
# Bad input: how long a rank that does not print waits for rank 0 to print the line.
SILENT_RANK_WAIT_SECONDS = 10

# Rank variables set by the launchers we support, read before hvd.init().
LAUNCHER_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                      "PMI_RANK", "SLURM_PROCID")


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2.

    ``on_every_rank`` marks an error that all ranks agreed on (see
    ``runtime.dist.agree_on_errors``): then only the first rank prints it.
    """

    exit_status = USAGE_ERROR_EXIT  # a subclass may report another (nonfinite.RunStopped)

    def __init__(self, message, on_every_rank=False):
        super().__init__(message)
        self.on_every_rank = on_every_rank


def launcher_rank():
    """This process's rank as the launcher announced it (0 when launched alone)."""
    for name in LAUNCHER_RANK_VARS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def fail(message, prog=None, every_rank_fails=True, status=USAGE_ERROR_EXIT):
    """Print one line naming the problem and exit with ``status`` (2: bad input).

    When every rank fails the same way only the first one prints.
    """
    _exit_with_status_when_terminated(status)
    if launcher_rank() == 0 or not every_rank_fails:
        prog = prog or os.path.basename(sys.argv[0])
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    elif _launched():
        # The launcher ends the job when the first rank exits; were it this silent one,
        # rank 0 (slower to start, say) would be killed before it printed the line.
        # So this rank waits for rank 0 to print and exit, which ends this wait too.
        time.sleep(SILENT_RANK_WAIT_SECONDS)
    sys.exit(status)


def _launched():
    return any(os.environ.get(name) for name in LAUNCHER_RANK_VARS)


def _exit_with_status_when_terminated(status):
    """Keep ``status`` when the launcher ends this rank: after another rank exits 2,
    mpirun, horovodrun and `srun --kill-on-bad-exit` SIGTERM the rest, which would
    then report 143."""
    try:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(status))
    except ValueError:  # not the main thread: leave it
        pass


_last_step = None  # the latest finished step, for the one-line reports


def note_step(step):
    """The latest finished step, named by a one-line report ("after step N")."""
    global _last_step
    _last_step = step


def is_peer_failure(error):
    """True for the errors a rank gets when another rank died or left mid-collective."""
    name = type(error).__name__
    return name == "HorovodInternalError" or "gloo" in str(error).lower()


# Who else is alive (runtime/peers.py, set once the heartbeat runs): on a peer
# failure it says whether this rank speaks for the job, and names the lost ranks.
_witness = None


def set_peer_witness(witness):
    """``witness.on_peer_failure()`` -> None (stay quiet: rank 0 speaks for the job) or a
    detail for this rank's line ("" when it knows no more); ``witness.announce_reported()``."""
    global _witness
    _witness = witness


def describe(error, who, detail=""):
    """One line: who ("rank 1", or the script when launched alone), and what ended it."""
    # Horovod's messages run on for several sentences: the first says what happened.
    first_line = (str(error).strip().splitlines() or [""])[0].split(". ")[0][:200]
    after = f" after step {_last_step}" if _last_step is not None else ""
    if is_peer_failure(error):
        return (f"{who}: error: a collective failed{after}: another rank died, froze or left the job"
                f"{'; ' + detail if detail else ''} ({type(error).__name__}: {first_line})")
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    place = f" at {os.path.relpath(where.filename)}:{where.lineno} in {where.name}" if where else ""
    return (f"{who}: error: {type(error).__name__}{after}: {first_line}{place} "
            f"({TRACEBACK_ENV}=1 prints the traceback)")


def report(error):
    """Print ``error`` as one line (the traceback only on request), then exit 1."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(error)
    who = f"rank {launcher_rank()}" if _launched() else os.path.basename(sys.argv[0])
    # A lost node fails the collective on every survivor at once: one line (rank 0's) for the job.
    witness = _witness if is_peer_failure(error) else None
    detail = witness.on_peer_failure() if witness else ""
    if detail is not None:
        print(describe(error, who, detail), file=sys.stderr, flush=True)
        if witness:
            witness.announce_reported()
    # A normal exit (atexit: the run lock, Horovod's shutdown), unless the shutdown
    # waits on a peer that is gone.
    threading.Thread(target=_exit_after_grace, daemon=True).start()
    sys.exit(FAILED_EXIT)


def _exit_after_grace():
    time.sleep(EXIT_GRACE_SECONDS)
    os._exit(FAILED_EXIT)
