"""One job per output directory: a lock file that works on shared file systems.

Two jobs writing one --output-dir would interleave their metrics and overwrite
each other's checkpoints and results (a job resubmitted while its previous
instance still runs). Rank 0 therefore holds ``<output-dir>/run.lock`` for the
whole run: a small JSON file naming the holder (host, pid, Slurm job, start time,
command).

What it relies on: creating a file with ``O_CREAT | O_EXCL`` is atomic and
``rename`` of one file is atomic, on local file systems and on NFSv3+, Lustre
and GPFS. No ``flock``/``fcntl`` locks (NFS implementations differ, and they
vanish with the process that holds them, which says nothing about a frozen one).

A lock is stale, and taken over with a notice, when its holder is
- a process on this host that no longer exists (pid and its start time, so a
  recycled pid does not count; a reboot ends every holder), or
- an earlier run of this same Slurm job (a requeue, possibly on another node), or
- a Slurm job that ``squeue`` reports as ended (or no longer knows).
Anything else (a live process, a running or pending job, a host that cannot be
asked) is refused with exit status 2; ``--take-over-lock`` overrides that.
"""
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from hvdtrain.errors import UsageError

LOCK_NAME = "run.lock"
# squeue states of a job that will never run again.
ENDED_JOB_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                    "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "TIMEOUT"}
_ATTEMPTS = 5


def boot_id():
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid):
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces


def this_holder():
    return {
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "pid": os.getpid(),
        "pid_start": process_start(os.getpid()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
        "token": uuid.uuid4().hex,
    }


def holder_text(holder):
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}"


def slurm_job_state(job_id):
    """The job's state from squeue, "GONE" if Slurm no longer knows it, None if it cannot tell."""
    try:
        answer = subprocess.run(["squeue", "--noheader", "--states=all", "--jobs", job_id, "--format=%T"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if answer.returncode == 0:
        states = answer.stdout.split()
        return states[0] if states else "GONE"
    return "GONE" if "Invalid job id" in answer.stderr else None


def why_stale(holder, me):
    """Why ``holder`` no longer uses the directory, or None if it may still."""
    if holder.get("host") == me["host"] and holder.get("boot_id") == me["boot_id"]:
        if process_start(holder.get("pid")) == holder.get("pid_start"):
            return None
        return "that process no longer exists"
    if holder.get("host") == me["host"]:
        return "this host has rebooted since"
    job = holder.get("slurm_job_id")
    if job and job == me["slurm_job_id"]:
        return "it was an earlier run of this Slurm job (requeued)"
    if job:
        state = slurm_job_state(job)
        if state == "GONE":
            return "squeue no longer knows that job"
        if state in ENDED_JOB_STATES:
            return f"squeue reports that job {state}"
    return None


class OutputDirLock:
    """Rank 0's lock on an output directory; ``release()`` at exit."""

    def __init__(self, directory):
        self.path = Path(directory) / LOCK_NAME
        self.holder = None

    def acquire(self, take_over=False, say=print):
        """Take the lock, taking over a stale one (with a notice); UsageError if in use."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = this_holder()
        for _ in range(_ATTEMPTS):
            if self._create(me):
                self.holder = me
                return self
            holder = self._read()
            if holder is None:
                continue  # removed meanwhile, or being written: look again
            reason = "--take-over-lock was given" if take_over else why_stale(holder, me)
            if reason is None:
                raise UsageError(
                    f"{self.path.parent} is in use by another run ({holder_text(holder)}); wait for it to end or "
                    f"use another --output-dir (if it has ended, delete {self.path} or pass --take-over-lock)")
            if self._remove_stale(holder):
                say(f"note: taking over the lock on {self.path.parent} from {holder_text(holder)}: {reason}",
                    flush=True)
        raise UsageError(f"cannot lock {self.path.parent}: {self.path} keeps changing or cannot be read "
                         "(delete it if no run uses that directory)")

    def release(self):
        """Remove the lock if it is still ours (a taker-over's lock is left alone)."""
        if self.holder is not None and (self._read() or {}).get("token") == self.holder["token"]:
            self.path.unlink(missing_ok=True)
        self.holder = None

    def _create(self, me):
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(me, indent=1) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return True

    def _read(self):
        """The holder in the lock file; None if it vanished or is still being written."""
        for _ in range(10):
            try:
                return json.loads(self.path.read_text())
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                time.sleep(0.1)  # created, not yet written
        return None

    def _remove_stale(self, holder):
        """Move the stale lock aside; True if this process did (only one taker wins)."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = {}
        if moved.get("token") != holder.get("token"):
            # Another taker's fresh lock: put it back (link fails if yet another holds the name).
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True
