"""The machine's cores, shared by the suite's xdist workers (a readers-writer lock).

Most tests share the machine: four workers run side by side on two cores, and a
2-rank launch tolerates that. A test marked `whole_machine` (16 ranks on the four
hosts) loads both cores so hard that the tests beside it starve: Slurm jobs whose
first step took 54 s, a straggler named on an unthrottled rank at 0.72 of the
fastest (a CI run here failed on both). So it runs alone: it waits until the tests
running finish, and the others wait until it is done. conftest.py holds the lock
around each test's whole protocol, so the module fixtures a test starts (a module's
Slurm jobs, its 16-rank training) are inside it; the wait shows in the test's time.

flock(2) locks on one file, shared for most tests, exclusive for the whole-machine
ones. Linux grants a shared lock while a writer waits, so a queue of shared tests
could hold a whole-machine test off to the end of the run; a second file, the
turnstile, is taken by everyone on the way in (and held only while waiting), which
queues a writer before the readers that come after it. The locks are per machine
(two suites run at once share the cores too) and die with their process. A worker
keeps the exclusive lock from one whole-machine test to the next (Machine.share's keep).
"""
import contextlib
import fcntl
import tempfile
from pathlib import Path



class Machine:
    """This xdist worker's hold on the machine's cores (one per pytest process)."""

    def __init__(self, directory=tempfile.gettempdir()):
        self.directory = Path(directory)
        self.kept = None  # the lock file, held exclusively from one whole-machine test to the next

    @contextlib.contextmanager
    def share(self, whole, keep=False):
        """Hold the machine, alone when ``whole``, beside the other shared tests otherwise.

        ``keep``: the worker's next test needs the whole machine too, so the lock stays held
        until it starts: consecutive whole-machine tests (the 16-rank files are one xdist
        group, on one worker) run as one block, and the machine is drained once for all of
        them instead of once each, the other workers idle while it drains.
        """
        lock = self.kept if whole else None
        self.kept = None
        if lock is None:
            lock = self._acquire(fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
        try:
            yield
        finally:
            if whole and keep:
                self.kept = lock
            else:
                fcntl.flock(lock, fcntl.LOCK_UN)
                lock.close()

    def _acquire(self, mode):
        lock = open(self.directory / "hvdtest-machine.lock", "a")
        with open(self.directory / "hvdtest-machine.turnstile", "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(lock, mode)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        return lock
