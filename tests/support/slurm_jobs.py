"""The slurm/ sbatch files' jobs, as test_slurm.py and test_slurm_two_nodes.py run and judge them."""
import json
from pathlib import Path
from typing import NamedTuple

from .launch import REPO

SLURM = REPO / "slurm"
LAUNCHERS = ("srun", "mpirun", "horovodrun")


class Ended(NamedTuple):
    """A job once it ended, as a test judges it."""
    info: dict  # scontrol's fields: JobState, ExitCode, Restarts, ...
    log: str  # its --output file's text
    out: Path  # the run's --output-dir


def ended(cluster, job, log, out, timeout):
    """Wait for ``job`` to end: its Ended."""
    info = cluster.wait_for_end(job, timeout)
    return Ended(info, Path(log).read_text(errors="replace"), Path(out))


def probe_sbatch(tmp_path):
    """train_cnn.sbatch, word for word, but running tests/workers/preemptible.py."""
    text = (SLURM / "train_cnn.sbatch").read_text()
    line = 'hvd_run scripts/train_cnn.py "$@"'
    assert text.count(line) == 1
    path = tmp_path / "probe.sbatch"
    path.write_text(text.replace(line, 'hvd_run tests/workers/preemptible.py "$@"'))
    return path


def events(directory, rank):
    """What tests/workers/preemptible.py's rank recorded: [{"event": ..., "step": ...}, ...]."""
    path = Path(directory) / f"events-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def send_usr1_to_batch_shell(cluster, job):
    """What --signal=B:USR1@N does before the time limit, on demand."""
    cluster.run(["scancel", "--signal=USR1", "--batch", job])


def assert_requeued_once(cluster, job, info, log):
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    assert info.get("Restarts") == "1", f"job {job} was not requeued exactly once: {info}\n{log}"
    for expected in ("restart count 0", "USR1: asking the ranks", "requeueing job", "restart count 1"):
        assert expected in log, f"job {job} log lacks {expected!r}:\n{log}"
