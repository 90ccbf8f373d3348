"""Hangs and faults end the job fast, with one line naming the rank and the cause.

The matrix: rank 1 of a real train_cnn.py job is SIGSTOPped, deadlocks its main
thread, is SIGKILLed, raises, or leaves a collective out (diverge), under
horovodrun --gloo, horovodrun --mpi, mpirun and srun (on the test Slurm
cluster). A stop, a kill and a divergence are certain from the heartbeat
(liveness/judge.py) and end the job in seconds with the default settings; how
fast depends on how each launcher ends a job, so `make test` runs them under all
four. A deadlock (a rank alive and busy while the other waits) and an exception
reach the same watchdog and error report under every launcher: `make test` runs
each under one, with a lowered watchdog floor for the deadlock, and `make
test-scale` the other cells. The cells of the selected tests run PARALLEL at a
time; more runs prove that a long legitimate phase and a long step on every
rank are no hang, and that a rank frozen in an evaluation is not given the
phase's limit. The srun cells have a fixture of their own, so that only they
wait for the Slurm cluster's worker.
"""
import json
import os
import re
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.checkpoints import checkpoint_file
from support.checks import error_lines, is_error_line, ok, only_an_error_line, the_error_line
from support.fault_cells import CERTAIN, EVALUATION, FAULTS, LAUNCHERS, LIMITS, TRAIN, run_cell
from support.launch import horovodrun, python
from support.needs import require_module, require_program

# Lowered for speed where a limit decides (a rank alive and busy): the watchdog's floor (default 60 s).
FAST = {"HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "10"}
PARALLEL = 5
# The launcher each launcher-independent fault runs under in `make test` (a spread, so that
# each launcher's output is read for one of them too); the certain faults run under every launcher.
ONCE = {"deadlock": "mpirun", "raise": "horovodrun --mpi"}
LAUNCHED = [launcher for launcher in LAUNCHERS if launcher != "srun"]


def cells(launchers):
    """(fault, launcher) parameters, the cells outside `make test` marked `scale`."""
    return [pytest.param(fault, launcher, id=f"{fault}-{launcher}",
                         marks=[] if fault in CERTAIN or ONCE.get(fault) == launcher else [pytest.mark.scale])
            for fault in FAULTS for launcher in launchers]


# The cells other than the matrix's, by the test that reads them.
EXTRA_CELLS = {
    "test_a_checkpoint_write_longer_than_the_step_limit_is_no_hang": "slow checkpoint",
    "test_a_long_step_on_every_rank_is_no_hang": "busy everywhere",
    "test_a_rank_frozen_in_an_evaluation_is_not_given_the_phases_limit": "frozen in an evaluation",
}


def selected_cells(request, srun):
    """The cells this session's selected tests of this module read: only those are launched."""
    wanted = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = getattr(item, "callspec", None) and item.callspec.params
        if params and "fault" in params and (params["launcher"] == "srun") == srun:
            wanted.append((params["fault"], params["launcher"], False))
        elif item.originalname in EXTRA_CELLS and not srun:
            wanted.append(EXTRA_CELLS[item.originalname])
    return sorted(set(wanted), key=str)


def run_cells(wanted, root, cluster=None):
    """{(fault, launcher, defaults?): Cell, "slow checkpoint": (Launched, its output dir), ...}, side by side."""
    require_module("horovod.torch")
    require_program("horovodrun", "run `make setup`")
    require_program("mpirun", "install Open MPI or `make setup` as root")

    def one(cell):
        if cell == "slow checkpoint":
            return cell, (slow_checkpoint_run(root / "slow-checkpoint"), root / "slow-checkpoint")
        if cell == "busy everywhere":
            return cell, (long_step_run(root / "busy-everywhere"), root / "busy-everywhere")
        if cell == "frozen in an evaluation":
            return cell, run_cell("stop", "mpirun", root / "stop-in-evaluation", where=EVALUATION, hold_waits=True)
        fault, launcher, _ = cell
        name = f"{fault}-{launcher.replace(' --', '-')}"
        return cell, run_cell(fault, launcher, root / name, None if fault in CERTAIN else FAST, cluster,
                              hold_waits=True)

    with ThreadPoolExecutor(PARALLEL) as pool:
        return dict(pool.map(one, wanted))


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory):
    """The selected cells under horovodrun and mpirun, and the extra runs."""
    return run_cells(selected_cells(request, srun=False), tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def srun_matrix(request, slurm_cluster, tmp_path_factory):
    """The selected srun cells, on the session's Slurm cluster."""
    return run_cells(selected_cells(request, srun=True), tmp_path_factory.mktemp("srun-faults"), slurm_cluster)


def slow_checkpoint_run(out):
    """A 15 s checkpoint write on rank 0 (the other rank waits for it) under a 5 s floor."""
    env = {"HVDTRAIN_FAULT": "rank=0,step=10,kind=slow-checkpoint,seconds=15", "HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "5"}
    return horovodrun(2, [*TRAIN[:-1], "1", "--output-dir", out, "--checkpoint-every", "10", "--stop-after", "12"],
                      timeout=300, env=env)


def long_step_run(out):
    """Every rank computes 25 s after step 10 (a long step: a first compile, a huge batch) under a
    5 s floor: nobody waits in a collective, so nobody is ended (the 3-minute step the watchdog
    must let finish, shortened through its floor)."""
    env = {"HVDTRAIN_FAULT": "rank=0-1,step=10,kind=busy,seconds=25", "HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "5"}
    return horovodrun(2, [*TRAIN[:-1], "1", "--output-dir", out, "--stop-after", "12"], timeout=300, env=env)


@pytest.mark.parametrize("fault, launcher", cells(LAUNCHED))
def test_a_fault_on_one_rank_ends_the_job_fast_with_one_line(matrix, fault, launcher):
    assert_ended_fast_with_one_line(matrix[(fault, launcher, False)], fault)


@pytest.mark.parametrize("fault, launcher", cells(["srun"]))
def test_a_fault_on_one_rank_under_srun_ends_the_job_fast_with_one_line(srun_matrix, fault, launcher):
    assert_ended_fast_with_one_line(srun_matrix[(fault, launcher, False)], fault)


def assert_ended_fast_with_one_line(cell, fault):
    assert not cell.timed_out and cell.returncode not in (0, None), cell.describe()
    assert cell.seconds_after_fault < LIMITS[fault], cell.describe()
    if fault in ("stop", "diverge"):  # with the default limits: the heartbeat's judgement, not a limit
        assert "certain, not a limit" in cell.message, cell.describe()
    assert cell.message, f"no line naming the rank and the cause:\n{cell.describe()}"
    assert len(error_lines(cell.output)) <= 1, f"one fault, more than one line:\n{cell.describe()}"
    assert not cell.wall(), f"a traceback wall:\n{cell.wall()}\n{cell.describe()}"
    stray = [line for line in cell.output.splitlines() if "HorovodInternalError" in line and not is_error_line(line)]
    assert not stray, cell.describe()


def test_a_checkpoint_write_longer_than_the_step_limit_is_no_hang(matrix):
    """The write runs inside the watchdog's phase: the job completes."""
    run, out = matrix["slow checkpoint"]
    ok(run)
    assert "error" not in run.output, run.describe()
    assert json.loads((out / "results.json").read_text())["steps"] == 12
    assert checkpoint_file(out, 10).is_file()


def test_a_long_step_on_every_rank_is_no_hang(matrix):
    run, out = matrix["busy everywhere"]
    ok(run)
    assert "error" not in run.output, run.describe()
    assert json.loads((out / "results.json").read_text())["steps"] == 12


def test_a_rank_frozen_in_an_evaluation_is_not_given_the_phases_limit(matrix):
    """Rank 1 stops as it enters the first evaluation; rank 0 waits there in a collective.
    An evaluation may legitimately take the phase limit (30 min), but a rank the heartbeat
    no longer hears will not join: the job ends as fast as after a step (a node cut off
    mid-evaluation held an srun job for the phase limit once)."""
    cell = matrix["frozen in an evaluation"]
    assert not cell.timed_out and cell.returncode not in (0, None), cell.describe()
    assert cell.seconds_after_fault < LIMITS["stop"], cell.describe()
    line = the_error_line(cell.output, "certain, not a limit", shown=cell.describe())
    assert re.search(r"rank 0: error: no training progress for \d+ s after step 44: not heard from rank 1 "
                     r"\(1 of 2 on \S+\) for \d+ s: frozen, dead or cut off from the network, with rank 0 waiting "
                     r"in allreduce", line), cell.describe()
    assert not cell.wall(), cell.describe()


# ---------------------------------------------------------------- the parts, without a launch
def test_the_limit_adapts_to_the_slowest_recent_step_with_a_floor():
    from hvdtrain.liveness.watchdog import Watchdog
    watchdog = Watchdog(rank=0, floor=60, phase_timeout=1800, watch=False)
    assert watchdog.limit()[0] == 1800  # before the first step (it may compile)
    watchdog.step(1)
    watchdog.last_beat -= 0.5
    watchdog.step(2)
    assert watchdog.limit() == (60, "HVDTRAIN_WATCHDOG_FLOOR_SECONDS=60")
    watchdog.last_beat -= 20  # a 20 s step
    watchdog.step(3)
    assert watchdog.limit()[0] == pytest.approx(200, abs=1)
    with watchdog.phase("writing a checkpoint"):
        assert watchdog.limit()[0] == 1800
    assert Watchdog(rank=0, fixed=7, floor=60, watch=False).limit() == (7, "HVDTRAIN_WATCHDOG_SECONDS=7")


def test_a_stuck_srun_of_the_job_on_this_node_is_ended_and_no_other(tmp_path, monkeypatch):
    """Under Slurm the ranks are not srun's children, so the teardown that ends a stuck
    mpirun found none: once (CI, under load) srun --kill-on-bad-exit waited 7 minutes for
    a cut-off node's tasks after rank 0 had named them and exited. The job's srun on the
    rank's node is ended after the grace; another job's never."""
    from hvdtrain.liveness import teardown
    srun = tmp_path / "srun"  # a process whose name is srun
    shutil.copy(shutil.which("sleep"), srun)
    job = f"hvdtest-{os.getpid()}"
    stuck = subprocess.Popen([srun, "60"], env={**os.environ, "SLURM_JOB_ID": job})
    other = subprocess.Popen([srun, "60"], env={**os.environ, "SLURM_JOB_ID": f"{job}-other"})
    try:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        teardown.end_a_stuck_launcher(grace=0.2)  # a detached process ends it after the grace
        assert stuck.wait(timeout=20) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for process in (stuck, other):
            process.kill()
            process.wait()


def test_fault_spec_errors_are_one_line(monkeypatch):
    from hvdtrain import cli
    from hvdtrain import testhooks
    assert testhooks.parse_fault("rank=1,step=20,kind=stop") == testhooks.Fault(1, 20, "stop")
    assert testhooks.parse_fault("rank=1,step=44,kind=kill,phase=writing a checkpoint").phase == "writing a checkpoint"
    for bad in ("rank=1,kind=nap", "step=3,kind=stop", "rank=1,kind=stop,when=now"):
        with pytest.raises(cli.UsageError, match="HVDTRAIN_FAULT"):
            testhooks.parse_fault(bad)
    # dist.init reads every hook's variable before training: a bad one stops the start, not step N.
    monkeypatch.setenv(testhooks.NONFINITE_ENV, "rank=1")
    with pytest.raises(cli.UsageError, match=testhooks.NONFINITE_ENV):
        testhooks.check_environment()


def test_a_peer_failure_and_an_own_error_read_as_one_line():
    from hvdtrain.liveness import failures
    try:
        raise RuntimeError("bad shard\nmore detail")
    except RuntimeError as error:
        line = failures.failure_line(error, "rank 1")
    assert line.startswith("rank 1: error: RuntimeError") and "bad shard" in line and "\n" not in line
    assert "test_faults.py" in line  # where it was raised
    peer = type("HorovodInternalError", (RuntimeError,), {})("Horovod has been shut down. This was caused by")
    assert failures.failure_line(peer, "rank 0").startswith(
        "rank 0: error: a collective failed") and "another rank died" in failures.failure_line(peer, "rank 0")


def test_a_bad_watchdog_setting_is_one_line_exit_2(need_horovod):
    ran = python([TRAIN[0], "--epochs", "1"], timeout=120, env={"HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "soon"})
    assert only_an_error_line(ran) == (
        "train_cnn.py: error: HVDTRAIN_WATCHDOG_FLOOR_SECONDS='soon': expected a number of seconds (0 or more)")
