"""The fault matrix: one rank of a real train_cnn.py job fails, under each launcher.

    cell = run_cell("stop", "mpirun", env={...})   # or "srun" with a SlurmCluster
    cell.seconds_after_fault, cell.returncode, cell.message

Faults are injected by the trainer itself (HVDTRAIN_FAULT, hvdtrain/testhooks.py):
rank 1 SIGSTOPs or SIGKILLs its own process, deadlocks its main thread, or
raises, right after step FAULT_STEP, or leaves that step's NaN/Inf vote out
("diverge": the ranks then wait in different collectives). Shared by
tests/test_faults.py and tools/fault_matrix.py (docs/troubleshooting.md's table).
"""
import contextlib
import re
import time
from dataclasses import dataclass

from .launch import REPO, SCRIPTS, horovodrun, launch
from .ranks import waits_held_once_frozen

FAULTS = ("stop", "deadlock", "kill", "raise", "diverge")
KINDS = {"diverge": "skip-vote"}  # HVDTRAIN_FAULT's kind, where it is not the fault's name
LAUNCHERS = ("horovodrun --gloo", "horovodrun --mpi", "mpirun", "srun")
# Seconds from the fault to the job's end. What the heartbeat makes certain (liveness/judge.py): a
# frozen rank within 15 s, a dead one within 5 s, ranks in collectives that cannot match within 10 s.
# A rank alive and busy (deadlock) holds the job until the watchdog's limit; an exception ends it at once.
# A kill is held to 7 s: under the suite's four workers on 2 cores a killed rank's job ended 5.05 s
# (srun) and 5.8 s (horovodrun --gloo) after the kill, rank 0's line said (two runs, 2026-12-07); a job
# left to a launcher's 5 s grace ends later still, and without rank 0's line, which the cells check.
LIMITS = {"stop": 15, "deadlock": 120, "kill": 7, "raise": 60, "diverge": 10}
CERTAIN = ("stop", "kill", "diverge")
FAULT_STEP = 20  # in the first epoch (44 steps of 2 x 16 digits)
EVALUATION = "step=44,phase=evaluating"  # as rank 1 enters the first epoch's evaluation
TRAIN = [SCRIPTS / "train_cnn.py", "--model", "convnet", "--image-size", "8", "--epochs", "3"]
LAUNCH_TIMEOUT = 300

# The one line that names the rank and the cause, for each fault.
CAUSES = {
    "stop": re.compile(r"rank \d+: error: .*(frozen|froze|stopped)"),
    "deadlock": re.compile(r"rank 1: error: no training progress .* main thread is stuck outside any collective"),
    "kill": re.compile(r"(rank|Process|task) 1\b.*(Killed|status code 137|signal 9)"
                       r"|Process name: 1 \(on \S+\) Exit code: 137"
                       r"|rank 0: error: a collective failed after step \d+: another rank died"
                       r"|rank 0: error: .*rank 1 \(1 of 2 on \S+\) has exited"),
    "raise": re.compile(r"rank 1: error: RuntimeError after step \d+: injected fault"),
    "diverge": re.compile(r"rank \d+: error: no training progress .*: the ranks made different collectives"),
}
_INJECTED = re.compile(r"injecting fault \S+ (?:after|in) step \d+ at (\d+\.\d+)")
@dataclass
class Cell:
    fault: str
    launcher: str
    returncode: int
    seconds: float  # launch to end
    seconds_after_fault: float  # the fault's injection to the end of the job
    output: str
    timed_out: bool

    @property
    def message(self):
        """The line naming the rank and the cause, or None."""
        lines = [line for line in self.output.splitlines() if CAUSES[self.fault].search(line)]
        return _untagged(lines[0]) if lines else None

    def wall(self):
        """Traceback text from the ranks (a wall), empty when there is none."""
        # horovodrun --gloo's own runner printed a traceback too before the project's patch
        # to Horovod's launcher (scripts/setup): now it is one "horovodrun: error:" line.
        return "\n".join(line for line in self.output.splitlines()
                         if "Traceback" in line or line.lstrip().startswith(("File \"", "horovod.common")))

    def describe(self):
        tail = "\n".join(self.output.splitlines()[-40:])
        return (f"{self.fault} under {self.launcher}: exit {self.returncode}, {self.seconds:.0f} s "
                f"({self.seconds_after_fault:.0f} s after the fault){' TIMED OUT' if self.timed_out else ''}\n{tail}")


def _untagged(line):
    return re.sub(r"^\[(?:\d+,)?\d+\]<std(?:out|err)>:", "", line).strip()


def fault_env(fault, extra=None, where=None):
    return {"HVDTRAIN_FAULT": f"rank=1,{where or f'step={FAULT_STEP}'},kind={KINDS.get(fault, fault)}",
            **(extra or {})}


def run_cell(fault, launcher, out_dir, env=None, cluster=None, where=None, hold_waits=False):
    """One launch of the trainer with ``fault`` on rank 1 (after FAULT_STEP, or ``where``
    says: EVALUATION); returns its Cell. ``hold_waits`` (the tests): a rank stopped under an MPI
    launcher holds the other rank's wait, which polls, to a sliver of a core (support/ranks.py)."""
    args = [*TRAIN, "--output-dir", out_dir, "--no-resume"]
    env = fault_env(fault, env, where)
    held = hold_waits and fault == "stop" and launcher != "horovodrun --gloo"
    started = time.time()
    with waits_held_once_frozen(str(out_dir), 2) if held else contextlib.nullcontext():
        if launcher == "srun":  # the sbatch file names the script itself
            returncode, output, timed_out = _slurm_job(cluster, args[1:], env, out_dir)
        elif launcher == "mpirun":
            ran = launch(["mpirun", "-np", "2", "--bind-to", "none", "python", *args], LAUNCH_TIMEOUT, env=env)
            returncode, output, timed_out = ran.returncode, ran.output, ran.timed_out
        else:
            ran = horovodrun(2, args, LAUNCH_TIMEOUT, transport=launcher.split("--")[1], env=env)
            returncode, output, timed_out = ran.returncode, ran.output, ran.timed_out
    ended = time.time()
    return Cell(fault, launcher, returncode, ended - started, ended - injected_at(output), output, timed_out)


def injected_at(output):
    """When the first rank of ``output`` injected its fault (time.time()), NaN if none did."""
    return min((float(at) for at in _INJECTED.findall(output)), default=float("nan"))


def _slurm_job(cluster, args, env, out_dir):
    """srun inside a batch job on the test cluster: (exit status, job log, timed out)."""
    log = f"{out_dir}.out"
    job = cluster.sbatch(["--output", log, REPO / "slurm" / "train_cnn.sbatch", *map(str, args)],
                         env={"LAUNCHER": "srun", **env})
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    info = {}
    while time.monotonic() < deadline:
        info = cluster.job(job)
        if info.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        time.sleep(0.5)
    else:
        launch(["scancel", job], timeout=30, env={"SLURM_CONF": str(cluster.conf)})
        return None, cluster.job_output(info), True
    status = int(info.get("ExitCode", "0:0").split(":")[0])
    return status, cluster.job_output(info), False
