"""Taking a job down when its launcher cannot.

When a rank ends itself (its watchdog fired), the launcher ends the other
ranks. But mpirun ends a job through every node's daemon, and a node cut off
from the network never answers: mpirun then waits for it (measured: still
running 300 s after one of two hosts lost its link), holding the allocation
until the time limit. So a rank whose watchdog ends the job, and the rank that
names lost ranks after a failed collective, leave behind a small detached
process that kills the launcher if it is still there
LAUNCHER_GRACE_SECONDS later. A launcher that ends the job in time is never
touched; only an mpirun on this rank's own node (one of its ancestors) is
considered (under ``horovodrun --mpi`` horovodrun then ends too).

Under Slurm the ranks are not srun's children (slurmstepd starts them), but the
batch step's srun runs on the job's first node, rank 0's: the same holds for the
job's srun found there. srun --kill-on-bad-exit usually gives up on a cut-off
node's tasks within seconds, but was seen (once, under load) waiting until Slurm
declared the node down, 7 minutes later (SlurmdTimeout, 300 s by default).
"""
import os
import signal
import subprocess
import sys
import time

LAUNCHER_GRACE_SECONDS = 30.0
LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun")


def end_a_stuck_launcher(grace=LAUNCHER_GRACE_SECONDS):
    """Kill this rank's mpirun, or its job's srun (on this node), if it outlives this rank by
    ``grace`` seconds."""
    launcher = _launcher_ancestor() or _job_srun()
    if launcher is None:
        return
    # A fresh interpreter running this file, not a fork: a rank has Horovod's, torch's and the
    # heartbeat's threads, and a forked copy of it can block on a lock one of them held (a CI run
    # once saw the forked child never kill). Its own session, so that the job's teardown does not
    # take it along; none of the rank's files, so that the launcher does not wait for its output.
    subprocess.Popen([sys.executable, "-I", __file__, str(launcher[0]), str(launcher[1]), str(grace)],
                     start_new_session=True, close_fds=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def end_own_children():
    """SIGKILL this rank's child processes and theirs (DataLoader workers, multiprocessing's forkserver)
    as it exits on a failure: orphaned, a DataLoader worker notices its parent gone only at its next
    5 s check, and holds the job's output open until then (a pipe's reader, ``| tee``, waits for it).
    Processes in another session (end_a_stuck_launcher's) are left alone."""
    session = os.getsid(0)
    for pid in _descendants(os.getpid()):
        try:
            if os.getsid(pid) == session:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _descendants(parent):
    found = []
    for child in _children(parent):
        found += [child, *_descendants(child)]
    return found


def _kill_after(launcher, grace):
    time.sleep(grace)
    if _process_identity(launcher[0]) == launcher:
        # Its children too: the ssh to a lost node would hold the launcher's output open.
        for pid in [launcher[0], *_children(launcher[0])]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _launcher_ancestor():
    """(pid, start time) of the nearest mpirun among this process's ancestors, or None."""
    pid = os.getppid()
    while pid > 1:
        identity = _process_identity(pid)
        if identity is None:
            return None
        if _name(pid) in LAUNCHERS:
            return identity
        pid = _parent(pid)
    return None


def _job_srun(job=None):
    """(pid, start time) of an srun of this Slurm job on this node, or None."""
    job = job or os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _name(int(entry)) == "srun" and _environment(int(entry)).get("SLURM_JOB_ID") == job:
            return _process_identity(int(entry))
    return None


def _environment(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            pairs = environ.read().split(b"\0")
    except OSError:
        return {}
    return dict(pair.decode(errors="replace").partition("=")[::2] for pair in pairs if pair)


def _process_identity(pid):
    """(pid, start time in clock ticks): a pid reused by another process reads differently."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return pid, int(fields[19])  # field 22 of /proc/PID/stat: starttime


def _parent(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _children(parent):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _parent(int(entry)) == parent:
                    found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def _name(pid):
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


if __name__ == "__main__":  # end_a_stuck_launcher's detached process: PID START_TIME GRACE
    _kill_after((int(sys.argv[1]), int(sys.argv[2])), float(sys.argv[3]))
