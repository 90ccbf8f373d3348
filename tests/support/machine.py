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
(two suites run at once share the cores too) and die with their process.
"""
import contextlib
import fcntl
import tempfile
from pathlib import Path



@contextlib.contextmanager
def share(whole, directory=tempfile.gettempdir()):
    """Hold the machine, alone when ``whole``, beside the other shared tests otherwise."""
    mode = fcntl.LOCK_EX if whole else fcntl.LOCK_SH
    with open(Path(directory, "hvdtest-machine.turnstile"), "a") as turnstile, \
            open(Path(directory, "hvdtest-machine.lock"), "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, mode)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
