"""Errors and exit statuses: the ground floor every other module may import.

Exit statuses of every script (one line on stderr says why):

    0  done, or stopped on request (--stop-after, SIGTERM/SIGUSR1) with a checkpoint
    1  a rank failed (its own exception, or a peer that died, froze or left):
       ``liveness.failures.report``
    2  bad input (``UsageError``): the same one line on every rank, printed once
    3  the progress watchdog ended a rank that made no progress (liveness/watchdog.py)
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
import time

FAILED_EXIT = 1
USAGE_ERROR_EXIT = 2
WATCHDOG_EXIT = 3
NONFINITE_EXIT = 4
STRAGGLER_EXIT = 5

TRACEBACK_ENV = "HVDTRAIN_TRACEBACK"
# Bad input: how long a rank that does not print waits for rank 0 to print the line.
SILENT_RANK_WAIT_SECONDS = 10

# Rank variables set by the launchers we support, read before hvd.init().
LAUNCHER_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                      "PMI_RANK", "SLURM_PROCID")


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2.

    ``on_every_rank`` marks an error that all ranks agreed on (see
    ``runtime.collectives.agree_on_errors``): then only the first rank prints it.
    """

    exit_status = USAGE_ERROR_EXIT  # a subclass may report another (nonfinite.RunStopped)

    def __init__(self, message, on_every_rank=False):
        super().__init__(message)
        self.on_every_rank = on_every_rank


class Agreement:
    """A check run on every rank whose UsageError, raised on any rank, every rank raises.

    Without it a rank that finds bad input exits while the others wait in their next
    collective; with it every rank leaves with the same one line. ``allgather(verdict)``
    returns every rank's verdict (None or the error's message): Horovod's
    (``runtime.collectives.agree_on_errors``) or mpi4py's (``launch.mpi_world.World``).
    Without one (``runtime.collectives.ALONE``: an --elastic worker's start checks, which
    must make no collective) the check runs on this rank alone and its error is its own.
    """

    def __init__(self, allgather=None):
        self.allgather = allgather

    def __call__(self, check, *args, **kwargs):
        """``check(*args, **kwargs)``'s result on every rank, or the first rank's UsageError on all."""
        if self.allgather is None:
            return check(*args, **kwargs)
        message, result = None, None
        try:
            result = check(*args, **kwargs)
        except UsageError as error:
            message = str(error)
        first = next((m for m in self.allgather(message) if m is not None), None)
        if first is not None:
            raise UsageError(first, on_every_rank=True)
        return result


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
    elif launched():
        # The launcher ends the job when the first rank exits; were it this silent one,
        # rank 0 (slower to start, say) would be killed before it printed the line.
        # So this rank waits for rank 0 to print and exit, which ends this wait too.
        time.sleep(SILENT_RANK_WAIT_SECONDS)
    sys.exit(status)


def launched():
    """True when a launcher (horovodrun, mpirun, srun) started this process."""
    return any(os.environ.get(name) for name in LAUNCHER_RANK_VARS)


def _exit_with_status_when_terminated(status):
    """Keep ``status`` when the launcher ends this rank: after another rank exits 2,
    mpirun, horovodrun and `srun --kill-on-bad-exit` SIGTERM the rest, which would
    then report 143."""
    try:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(status))
    except ValueError:  # not the main thread: leave it
        pass
