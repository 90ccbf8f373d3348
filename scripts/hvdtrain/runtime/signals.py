"""Preemption: SIGTERM/SIGUSR1 make every rank finish its step, checkpoint, exit 0.

Slurm sends SIGUSR1 before a time limit (``--signal``) and SIGTERM on
preemption, but not always to every rank at the same moment. Each rank only
records the signal; ``poll()`` is an allreduce, so all ranks stop after
the same step even when only one of them was signalled.

DataLoader workers must survive these signals: Open MPI's orted and Slurm
signal a rank's whole process group or process tree, and a worker that dies of
SIGUSR1 ends its rank with "DataLoader worker exited unexpectedly" instead of
a checkpoint. ``worker_loader_options()`` makes them ignore the signals.
"""
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing import forkserver, resource_tracker

from hvdtrain.runtime import collectives


# Signals a launcher or Slurm sends to every process of a rank. A DataLoader
# worker ignores them all, SIGINT included: Ctrl-C still ends the job through
# the rank (KeyboardInterrupt, exit 130), whose DataLoader then shuts its workers
# down; a worker that died first would only add "exited unexpectedly" tracebacks.
WORKER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# The packages of the rank's modules the fork server imports for its workers: torch's
# own submodules come with `import torch`, lazily loaded ones (the compiler) stay out.
PRELOADED_PACKAGES = ("hvdtrain", "horovod", "PIL", "numpy")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds hvdtrain/


class StopRequest:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.received = None
        for number in signals:
            signal.signal(number, self._record)

    def _record(self, number, _frame):
        self.received = signal.Signals(number).name

    def poll(self):
        """Collective: None, or which signal reached which rank, e.g. "SIGUSR1 (rank 1)".

        Horovod: the stop vote, one allreduce (Max) of a flag per rank; only when a rank was
        signalled, every rank's signal, one allgather_object, so the line names the rank.
        """
        if not collectives.any_rank_true(self.received is not None, name="stop_signal.vote"):
            return None
        received = collectives.allgather_object(self.received, name="stop_signal")
        rank = next(r for r, name in enumerate(received) if name)
        return f"{received[rank]} (rank {rank})"


def ignore_in_worker(_worker_id=None):
    """DataLoader ``worker_init_fn``: leave the launcher's signals to the rank, end with the rank."""
    for number in WORKER_IGNORED_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    threading.Thread(target=_exit_with_the_rank, args=(multiprocessing.parent_process(),), daemon=True,
                     name="exit with the rank").start()


def _exit_with_the_rank(rank):
    """End this worker once its rank is gone, however it went (SIGKILL, an abort, os._exit).

    torch's worker watches its parent process, here the fork server, which outlives the
    rank as long as any worker it forked does (each holds the server's liveness pipe), and
    this worker ignores the launcher's SIGTERM: killed without shutting its DataLoader
    down, a rank left both behind for good. multiprocessing hands the worker a pipe whose
    other end the rank holds (``parent_process().sentinel``): at its end of file the rank
    has exited, or has let go of this worker.
    """
    if rank is None or rank.sentinel is None:
        return
    try:
        while os.read(rank.sentinel, 4096):  # the worker's start-up data is read already; EOF is the news
            pass
    except OSError:
        pass
    os._exit(0)


def start_forkserver():
    """Start multiprocessing's fork server with the worker signals blocked.

    forkserver DataLoader workers are forked by this server, not by the rank,
    and inherit its signal mask: blocked from their first instruction, they are
    safe before ``ignore_in_worker`` runs, and the server (in the rank's process
    group) survives too. Blocked, not ignored, in the rank for that moment: a
    signal that arrives meanwhile stays pending and reaches the rank's handler.
    (CPython starts its resource tracker the same way.) Does nothing once running.
    """
    forkserver.set_forkserver_preload(modules_for_workers())
    # The fork server starts multiprocessing's resource tracker first (also in the
    # rank's process group), which unblocks SIGINT and SIGTERM in this thread when
    # started: start it on its own, then the server.
    # Python 3.11's server is handed the rank's sys.path but never applies it: it would preload
    # (and its workers run) the hvdtrain that PYTHONPATH or a .pth file names first, maybe another
    # checkout's. Started with this one's folder first on PYTHONPATH, it imports the rank's.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, path]))
    try:
        for start in (resource_tracker.ensure_running, forkserver.ensure_running):
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
            try:
                start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path


def modules_for_workers():
    """What the fork server imports once, so that each worker it forks has it already.

    A worker runs the script's top level again (as ``__mp_main__``) and unpickles its
    dataset: without these in the server, each worker of each epoch imported torch and
    Horovod anew, about 1.7 CPU-s a worker (2 ranks x 2 workers, 40 steps of a tiny
    image-folder job: 52 CPU-s against 11 with no workers). Python 3.11's own
    preloading of ``__main__`` never happens (the server is not given the path).
    """
    loaded = [name for name in sys.modules if name.partition(".")[0] in PRELOADED_PACKAGES]
    return ["torch", *sorted(name for name in loaded if name != "torch")]


def worker_loader_options():
    """DataLoader keyword arguments for workers that survive their rank's signals.

    Horovod's advice: forkserver workers, since fork is unsafe with some
    InfiniBand/MPI stacks once the communication thread runs.
    """
    start_forkserver()
    return {"multiprocessing_context": "forkserver", "worker_init_fn": ignore_in_worker}
