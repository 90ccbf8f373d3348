"""The processes of a running job's ranks, and a real slow rank (the cgroup v1 CPU controller)."""
import contextlib
import itertools
import os
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
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
            except OSError:  # exited meanwhile
                pass
        group.rmdir()


class _Group:
    def __init__(self, path):
        self.path = path

    def add(self, pid):
        """Every thread of ``pid``, and those it starts later."""
        (self.path / "cgroup.procs").write_text(str(pid))
