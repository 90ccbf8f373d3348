"""Launch a command the way a user would, and never hang doing it.

Every test that starts horovodrun, mpirun, sbatch or a script goes through
``launch``: the command runs in its own process group, and when the timeout
expires the whole group (launcher and every rank) is killed.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
# horovodrun tags rank lines "[1]<stderr>:" (gloo) or "[1,1]<stderr>:" (MPI).
RANK_TRACEBACK = re.compile(r"\[[\d,]+\]<std(?:out|err)>:\s*Traceback")
VENV_BIN = Path(sys.executable).parent

# horovodrun --gloo tags lines "[1]<stdout>:", mpirun/horovodrun --mpi "[1,1]<stdout>:".
# Open MPI tags each chunk a rank writes, not each line: print() writes the text
# and its newline separately, so another rank's chunk can land mid-line
# ("[1,1]<stdout>:a[1,0]<stdout>:b\n[1,1]<stdout>:\n"). Tags are found anywhere.
_RANK_TAG = re.compile(r"\[(?:\d+,)?(\d+)\]<(?:stdout|stderr)>:?")


@dataclass
class Launched:
    command: list
    returncode: int
    output: str
    timed_out: bool

    def rank_output(self, rank):
        """Lines one rank printed, reassembled from the launcher's tagged chunks."""
        chunks = []
        for line in self.output.splitlines():
            tags = list(_RANK_TAG.finditer(line))
            if not tags or tags[0].start() != 0:
                continue  # the launcher's own line, not a rank's
            for tag, following in zip(tags, tags[1:] + [None]):
                if int(tag.group(1)) != rank:
                    continue
                end = following.start() if following else len(line)
                # a chunk that runs to the end of the line ended with its newline
                chunks.append(line[tag.end():end] + ("" if following else "\n"))
        text = "".join(chunks)
        return "\n".join(line.removeprefix(" ") for line in text.splitlines())

    def describe(self):
        tail = "\n".join(self.output.splitlines()[-60:])
        state = "TIMED OUT" if self.timed_out else f"exit {self.returncode}"
        return f"$ {' '.join(map(str, self.command))}\n[{state}]\n{tail}"


def test_env(extra=None):
    """Environment for launched commands: the venv first on PATH, quiet libraries."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    # Open MPI refuses to run as root without these; harmless otherwise.
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    # Two ranks on a 2-core machine: let Open MPI oversubscribe rather than refuse.
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    # A rank waiting in MPI yields its core instead of spinning: several tests' ranks
    # share the cores (make test runs tests side by side), more than Open MPI knows of.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.update(extra or {})
    return env


def launch(command, timeout, env=None, cwd=REPO, input_text=None):
    """Run ``command``; kill its whole process group if it outlives ``timeout`` s."""
    command = [str(part) for part in command]
    process = subprocess.Popen(
        command, cwd=cwd, env=test_env(env), start_new_session=True,
        stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(input=input_text, timeout=timeout)
        return Launched(command, process.returncode, output, timed_out=False)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        try:
            output, _ = process.communicate(timeout=OUTPUT_GRACE_SECONDS)
        except subprocess.TimeoutExpired as still:  # held open from outside the session (setsid)
            output = _text(still.output) + f"\n[output still open {OUTPUT_GRACE_SECONDS} s after the kill]\n"
        return Launched(command, process.poll(), output, timed_out=True)
    finally:
        # A launcher that exited may leave orphaned ranks behind in its group.
        kill_session(process.pid)


OUTPUT_GRACE_SECONDS = 30


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_session(sid):
    """SIGKILL the launch's process group and every other process of its session: Open MPI
    starts each ssh to a remote host in a process group of its own, and one that outlives
    mpirun (its host cut off) would hold the launch's output open."""
    kill_group(sid)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                session = int(stat.read().rsplit(")", 1)[1].split()[3])  # field 6 of /proc/PID/stat
            if session == sid:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def horovodrun(np, script_args, timeout, transport="gloo", env=None, extra=()):
    """``horovodrun -np N --gloo|--mpi python <script> ...`` under ``launch``."""
    command = ["horovodrun", "-np", str(np), f"--{transport}", *extra,
               sys.executable, *script_args]
    return launch(command, timeout, env=env)


def python(script_args, timeout, env=None):
    """A single-process run of a script (no launcher)."""
    return launch([sys.executable, *script_args], timeout, env=env)


def wait_then(condition, action, timeout):
    """In a thread: once ``condition()`` holds, run ``action()`` (gives up after ``timeout`` s)."""
    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                action()
                return
            time.sleep(0.2)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


class Timed:
    """A launch whose output lines are timestamped as they arrive; killed (group) at the timeout
    (the tools that time a job's phases: tools/scale_study.py, tools/chaos.py)."""

    def __init__(self, command, env, timeout, started=None, lines=None):
        # ``started``, ``lines``: a timeline several launches share (a job relaunched after each fault)
        self.started = time.monotonic() if started is None else started
        self.lines = [] if lines is None else lines  # (seconds since start, line)
        self.process = subprocess.Popen([str(c) for c in command], env=test_env(env), start_new_session=True,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.timer = threading.Timer(timeout, self.kill)
        self.timer.start()

    def kill(self):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self):
        for line in self.process.stdout:
            self.lines.append((time.monotonic() - self.started, line.rstrip("\n")))
        self.process.wait()
        self.ended = time.monotonic() - self.started
        self.ended_wall = time.time()
        self.timer.cancel()
        self.kill()  # ranks a launcher left behind
        return self

    def first(self, pattern):
        return next((at for at, line in self.lines if pattern.search(line)), None)

    def output(self):
        return "\n".join(line for _, line in self.lines)
