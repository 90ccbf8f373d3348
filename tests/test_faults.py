"""Hangs and faults end the job fast, with one line naming the rank and the cause.

The matrix: rank 1 of a real train_cnn.py job is SIGSTOPped, deadlocks its main
thread, is SIGKILLed, or raises, under horovodrun --gloo, horovodrun --mpi,
mpirun and srun (on the test Slurm cluster). The cells run four at a time with
a lowered watchdog floor; one more cell proves the default limits (SIGSTOP under
MPI, the worst case) and one run proves that a long legitimate phase is no hang.
"""
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import require_module, require_program
from fault_cells import FAULTS, LAUNCHERS, LIMITS, TRAIN, run_cell
from launch import horovodrun
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

# Lowered for speed: the watchdog's floor (default 60 s) and Horovod's stall warning.
FAST = {"HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "10"}
PARALLEL = 4


@pytest.fixture(scope="module")
def matrix(slurm_cluster, tmp_path_factory):
    """Every cell, plus the default-limits cell, run side by side: {(fault, launcher): Cell}."""
    require_module("horovod.torch")
    require_program("mpirun", "install Open MPI or `make setup` as root")
    root = tmp_path_factory.mktemp("faults")
    cells = [(fault, launcher, FAST) for fault in FAULTS for launcher in LAUNCHERS]
    cells.insert(0, ("stop", "horovodrun --mpi", None))  # the defaults: the longest, so first

    def one(cell):
        fault, launcher, env = cell
        name = f"{fault}-{launcher.replace(' --', '-')}{'-default' if env is None else ''}"
        return (fault, launcher, env is None), run_cell(fault, launcher, root / name, env, slurm_cluster)

    with ThreadPoolExecutor(PARALLEL) as pool:
        return dict(pool.map(one, cells))


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_on_one_rank_ends_the_job_fast_with_one_line(matrix, fault, launcher):
    cell = matrix[(fault, launcher, False)]
    assert not cell.timed_out and cell.returncode not in (0, None), cell.describe()
    assert cell.seconds_after_fault < LIMITS[fault], cell.describe()
    assert cell.message, f"no line naming the rank and the cause:\n{cell.describe()}"
    assert not cell.wall(), f"a traceback wall:\n{cell.wall()}\n{cell.describe()}"
    stray = [line for line in cell.output.splitlines() if "HorovodInternalError" in line and ": error: " not in line]
    assert not stray, cell.describe()


def test_a_frozen_rank_under_mpi_ends_the_job_within_120_s_with_the_defaults(matrix):
    """No limit lowered: the adaptive limit's floor (60 s) catches a SIGSTOPped rank."""
    cell = matrix[("stop", "horovodrun --mpi", True)]
    assert not cell.timed_out and cell.returncode not in (0, None), cell.describe()
    assert not math.isnan(cell.seconds_after_fault) and cell.seconds_after_fault < 120, cell.describe()
    assert "limit 60 s: HVDTRAIN_WATCHDOG_FLOOR_SECONDS=60" in cell.output, cell.describe()
    assert cell.message and not cell.wall(), cell.describe()


def test_a_checkpoint_write_longer_than_the_step_limit_is_no_hang(tmp_path, need_horovod):
    """A 15 s checkpoint write on rank 0 (the other rank waits for it) under a 5 s
    step limit: the job completes, the write ran inside the watchdog's phase."""
    out = tmp_path / "out"
    env = {"HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "5", "HVDTRAIN_FAULT": "rank=0,step=10,kind=slow-checkpoint,seconds=15"}
    run = horovodrun(2, [*TRAIN[:-1], "1", "--output-dir", out, "--checkpoint-every", "10",
                         "--stop-after", "12"], timeout=180, env=env)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert "error" not in run.output, run.describe()
    assert json.loads((out / "results.json").read_text())["steps"] == 12
    assert (out / "step-000000010.pt").is_file()
