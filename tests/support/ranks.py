"""The processes of a running job's ranks, and a real slow rank (the cgroup v1 CPU controller)."""
import contextlib
import itertools
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from .needs import require

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1, mounted read-write on the test machines
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_groups = itertools.count()


def rank_pids(marker, rank):
    """Python processes of ``rank`` (as its launcher set it) whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if ("python" in Path(argv[0].decode()).name and marker.encode() in b" ".join(argv)
                and any(f"{name}={rank}".encode() in environ for name in RANK_VARS)):
            pids.append(int(entry.name))
    return pids


def slow_down(share, marker, ranks):
    """Every rank still alive of the job whose command lines contain ``marker`` (launched as
    ``ranks``) into ``share`` (``cpu_share``)."""
    pids = [pid for rank in range(ranks) for pid in rank_pids(marker, rank)]
    assert pids, f"no rank of the job marked {marker} is alive"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a rank that ended meanwhile
            share.add(pid)


# Open MPI's blocking waits poll: a rank waiting in a collective for a frozen or cut-off peer spins
# a whole core, mpi_yield_when_idle or not (10.0 CPU-s in 10 s here; Horovod's Gloo wait sleeps:
# 0.06 CPU-s). A test that freezes or cuts off ranks on purpose holds the job's waiting ranks to
# this share of a core (their watchdog and heartbeat threads need little), so that the wait it
# proves, up to the watchdog's minute, costs the tests beside it nothing.
WAITING_SHARE = 0.2


@contextmanager
def waits_held(marker, ranks):
    """While it is entered, ``hold()`` moves the live ranks of the job marked ``marker`` (launched
    as ``ranks``), but stopped ones, into a WAITING_SHARE group: once the test has cut them off or
    frozen their peers. Without a writable CPU controller they wait at full cost (nothing else changes)."""
    if not os.access(CPU_CGROUP, os.W_OK):
        yield lambda: None
        return
    with cpu_share(WAITING_SHARE) as share:
        def hold():
            for pid in (pid for rank in range(ranks) for pid in rank_pids(marker, rank)):
                if not frozen(pid):
                    with contextlib.suppress(OSError):  # ended meanwhile
                        share.add(pid)
        yield hold


@contextmanager
def waits_held_once_frozen(marker, ranks):
    """While it is entered: once a rank of the job marked ``marker`` (launched as ``ranks``) is
    stopped (a frozen rank, HVDTRAIN_FAULT's stop), its other ranks' waits are held (``waits_held``)."""
    with waits_held(marker, ranks) as hold:
        done = threading.Event()

        def watch():
            while not done.wait(1.0):
                if any(frozen(pid) for rank in range(ranks) for pid in rank_pids(marker, rank)):
                    hold()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()


def frozen(pid):
    """Whether ``pid`` is stopped (SIGSTOP), not merely gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def standing_by(pid):
    """Whether ``pid`` is an elastic worker started ahead of its world, waiting in hvd.init()
    for its slot (the project's Horovod patch names it hvd-standby meanwhile)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "hvd-standby"
    except OSError:
        return False


def stopped(pid):
    """Whether ``pid`` is stopped (SIGSTOP: a frozen rank), or gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return True


def require_cpu_cgroup():
    require((CPU_CGROUP / "cpu.cfs_quota_us").is_file() and os.access(CPU_CGROUP, os.W_OK),
            "a writable cgroup v1 CPU controller at /sys/fs/cgroup/cpu (for a real slow rank)",
            "run the tests as root on a machine with cgroup v1's cpu controller mounted")


@contextmanager
def cpu_share(fraction):
    """A cgroup whose processes get ``fraction`` of one core; ``.add(pid)`` moves a process in.

    On exit its processes go back to the root group and the group is removed.
    """
    group = CPU_CGROUP / f"hvdtest-{os.getpid()}-{next(_groups)}"
    group.mkdir()
    period = int((group / "cpu.cfs_period_us").read_text())
    (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(fraction * period))))
    try:
        yield _Group(group)
    finally:
        _remove(group)


def _remove(group, tries=50):
    """Its processes back to the root group, then the group gone. A process of the group may fork
    meanwhile (seen: rmdir's EBUSY after a partition test), so until it is empty, for a few seconds;
    a group left then is an empty directory once its processes end, and says so."""
    for _ in range(tries):
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
            except OSError:  # exited meanwhile
                pass
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    print(f"support/ranks.py: {group} still holds processes; left in place", file=sys.stderr)


class _Group:
    def __init__(self, path):
        self.path = path

    def add(self, pid):
        """Every thread of ``pid``, and those it starts later."""
        (self.path / "cgroup.procs").write_text(str(pid))
