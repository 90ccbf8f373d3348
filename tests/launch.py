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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
VENV_BIN = Path(sys.executable).parent

# horovodrun --gloo tags lines "[1]<stdout>:", mpirun/horovodrun --mpi "[1,1]<stdout>:".
_RANK_TAG = re.compile(r"^\[(?:\d+,)?(\d+)\]<(?:stdout|stderr)>:?\s?(.*)$")


@dataclass
class Launched:
    command: list
    returncode: int
    output: str
    timed_out: bool

    def rank_output(self, rank):
        """Lines one rank printed (launchers that tag lines by rank)."""
        lines = []
        for line in self.output.splitlines():
            match = _RANK_TAG.match(line)
            if match and int(match.group(1)) == rank:
                lines.append(match.group(2))
        return "\n".join(lines)

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
        kill_group(process.pid)
        output, _ = process.communicate()
        return Launched(command, process.returncode, output, timed_out=True)
    finally:
        # A launcher that exited may leave orphaned ranks behind in its group.
        kill_group(process.pid)


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def horovodrun(np, script_args, timeout, transport="gloo", env=None, extra=()):
    """``horovodrun -np N --gloo|--mpi python <script> ...`` under ``launch``."""
    command = ["horovodrun", "-np", str(np), f"--{transport}", *extra,
               sys.executable, *script_args]
    return launch(command, timeout, env=env)


def python(script_args, timeout, env=None):
    """A single-process run of a script (no launcher)."""
    return launch([sys.executable, *script_args], timeout, env=env)
