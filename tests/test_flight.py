"""A hang named to its collective: the flight recorder (hvdtrain/liveness/recorder.py).

Real launches of train_cnn.py with code of a user's own (support/user_task.py) that makes a
rank-divergent collective, a rank that leaves the NaN/Inf vote out (HVDTRAIN_FAULT
kind=skip-vote), a rank stuck in its data loader, and a mismatch Horovod catches: each job
ends with one line naming the collectives, the ranks on each side and their script lines;
the divergent ones with the default limits, as soon as the heartbeat makes the deadlock
certain (liveness/judge.py), the stuck loader within the watchdog's limit (its floor at
10 s here). The ranks' dumps merge (scripts/flight_dumps.py) into the same finding.
"""
import json
import re
import sys

import pytest

from support.checks import ok, one_error_line
from support.commands import CNN
from support.launch import REPO, SCRIPTS, horovodrun, launch, python
from support.user_task import write_task

pytestmark = pytest.mark.usefixtures("need_horovod")

FAST = {"HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "10"}
WATCHDOG_EXIT = 3
TIMEOUT = 150  # the watchdog's 10 s and its grace, start-up, teardown: well inside


def task(tmp_path, model="build", data="data"):
    path = write_task(tmp_path)[1].rpartition(":")[0]
    return ["--model", f"{path}:{model}", "--dataset", f"{path}:{data}", "--epochs", "4",
            "--output-dir", tmp_path / "out"]


def launched(launcher, args, env):
    """``train_cnn.py ARGS`` on 2 ranks under ``launcher``."""
    if launcher == "mpirun":
        passed = [option for name in env for option in ("-x", name)]
        return launch(["mpirun", "-np", "2", "-hostfile", REPO / "hostfiles" / "localhost", "--bind-to", "none",
                       *passed, sys.executable, CNN, *args], timeout=TIMEOUT, env=env)
    return horovodrun(2, [CNN, *args], timeout=TIMEOUT, env=env, transport=launcher.split("--")[-1])


def merged(tmp_path):
    return ok(python([SCRIPTS / "flight_dumps.py", tmp_path / "out" / "flight-recorder", "--ranks", "2"],
                     timeout=60)).output


@pytest.mark.parametrize("launcher", ["horovodrun --gloo", pytest.param("mpirun", marks=pytest.mark.scale),
                                      pytest.param("horovodrun --mpi", marks=pytest.mark.scale)])
def test_a_rank_divergent_collective_in_user_code_is_named(tmp_path, launcher, need_mpi):
    """Rank 1 alone averages a metric inside the user's model at step 5: rank 0 waits in the
    gradients' allreduce, rank 1 in its own; the one line says so, from both ranks' records."""
    ran = launched(launcher, task(tmp_path, model="diverging"), {})
    line = one_error_line(ran, "no training progress", status=WATCHDOG_EXIT)
    assert re.search(r"rank 0: error: no training progress for \d+ s after step 4: rank 0 waits in allreduce "
                     r"\d+ gradients \(grad\.\S+ \.\.\. grad\.\S+\) \(#(\d+), train_cnn\.py:\d+\); rank 1 waits in allreduce "
                     r"user\.rank1_only_metric \(#\1, their_task\.py:\d+\): the ranks made different collectives "
                     r"\(they differ in name, tensors\); aborting \(certain, not a limit", line), line
    found = merged(tmp_path)
    assert re.search(r"first difference at collective #\d+: rank 0 made allreduce \d+ gradients \(grad\.\S+ \.\.\. "
                     r"grad\.\S+\) float32\[[\d, ]+\] and \d+ more at train_cnn\.py:\d+; rank 1 made allreduce "
                     r"user\.rank1_only_metric float32\[3\] at their_task\.py:\d+",
                     found), found
    assert "no dump from" not in found, found


def test_a_rank_that_leaves_the_nan_vote_out_is_named(tmp_path):
    ran = horovodrun(2, [CNN, *task(tmp_path)], timeout=TIMEOUT, env={"HVDTRAIN_FAULT": "rank=1,step=5,kind=skip-vote"})
    one_error_line(ran, "rank 0 waits in allreduce nonfinite.vote (#", "; rank 1 waits in allreduce",
                   "gradients", "the ranks made different collectives", status=WATCHDOG_EXIT)


def test_a_rank_stuck_in_its_data_loader_is_named(tmp_path):
    """Rank 1's read of a sample never returns: rank 1's own line says it is in its data loader,
    in the user's code, while rank 0 waits in the gradients' allreduce."""
    ran = horovodrun(2, [CNN, *task(tmp_path, data="stuck")], timeout=TIMEOUT, env=FAST)
    line = one_error_line(ran, "rank 1: error: no training progress", status=WATCHDOG_EXIT)
    assert re.search(r"this rank's main thread is stuck in its data loader, at \S*their_task\.py:\d+ in __getitem__, "
                     r"while rank 0 waits in allreduce \d+ gradients", line), line


def test_a_mismatch_horovod_catches_names_each_sides_line(tmp_path):
    """The same collective, a tensor of another shape on each rank: Horovod's own error, one line,
    now with each rank's side and script line."""
    ran = horovodrun(2, [CNN, *task(tmp_path, model="mismatching")], timeout=TIMEOUT, env=FAST)
    line = one_error_line(ran, "the ranks made one collective with different tensors", status=1)
    assert re.search(r"Mismatched ALLREDUCE tensor shapes.*: rank 0: user\.metric float32\[3\] at their_task\.py:"
                     r"(\d+); rank 1: user\.metric float32\[4\] at their_task\.py:\1", line), line


def test_the_divergence_of_1024_ranks_is_one_line_of_ranges():
    """The watchdog's finding at 1,024 ranks: ranks as ranges, the odd one out named."""
    from hvdtrain.liveness import peers, recorder
    waiting = {"op": "allreduce", "name": "65 gradients (grad.conv1.weight ... grad.fc.bias)", "first": 4097,
               "where": "train_cnn.py:220",
               "in": "collective"}
    statuses = {rank: dict(waiting) for rank in range(1024)}
    statuses[517] = {"op": "allreduce", "name": "user.metric", "first": 4097, "where": "m.py:12", "in": "collective"}
    statuses[900] = {"in": "data loader", "place": "their.py:40 in __getitem__"}
    line = recorder.divergence(statuses, peers.rank_list)
    assert line.startswith("ranks 0-516, 518-899, 901-1023 wait in allreduce 65 gradients (grad.conv1.weight ... "
                           "grad.fc.bias) "
                           "(#4097, train_cnn.py:220); "), line
    assert "rank 517 waits in allreduce user.metric (#4097, m.py:12)" in line, line
    assert "rank 900 is in its data loader (at their.py:40 in __getitem__)" in line and len(line) < 400, line


def test_a_collective_one_rank_completed_is_no_deadlock_while_another_waits_in_it():
    """The judge calls a deadlock certain only where every waiting rank stopped at one position of
    the sequence: a collective one rank has completed and another still waits in was submitted by
    every rank, so it can complete. (Under srun with two jobs starting at once, rank 0 waited 5 s in
    allgather #12 while rank 1, past it, waited in #13: the judge ended the job as rank-divergent.)"""
    from hvdtrain.liveness import judge, peers

    def waiting(rank, seq, name, line):
        return {"rank": rank, "seq": seq, "first": seq, "op": "allgather", "name": name, "blocked": 5.0,
                "where": f"train_cnn.py:{line}", "detail": "int64[2]", "keys": [f"allgather {name}"]}
    statuses = {0: waiting(0, 12, "agree_on_errors.t", 140), 1: waiting(1, 13, "rank_fingerprint_digests", 143)}
    received = dict.fromkeys(statuses, 100.0)
    assert judge.verdict(statuses, received, 2, str, str, peers.rank_list) is None
    statuses[0] = waiting(0, 13, "a_metric_rank_0_alone", 150)  # at one position, none in common: certain
    assert judge.verdict(statuses, received, 2, str, str, peers.rank_list).kind == "deadlocked"


@pytest.mark.parametrize("ranks, per_node", [(32, 4), pytest.param(1024, 8, marks=pytest.mark.scale)])
def test_liveness_at_many_ranks_by_simulation(tmp_path, ranks, per_node):
    """The heartbeat, the statuses and the finding, the liveness code itself in lightweight processes
    (tools/liveness_sim.py): rank 0 hears every rank on a few % of a core; a rank-divergent collective
    is judged a deadlock within BLOCKED_SECONDS and two beats, a lost node within the bound of 2 ranks
    (SILENT_SECONDS)."""
    from hvdtrain.liveness import judge, peers
    out = tmp_path / "sim.json"
    ran = ok(launch([sys.executable, REPO / "tools" / "liveness_sim.py", "--ranks", ranks, "--per-node", per_node,
                     "--steady-seconds", "3" if ranks < 100 else "10", "--port", 29_701 + ranks,
                     "--output", out], timeout=300))
    figures = json.loads(out.read_text())
    print(ran.output)
    assert figures["steady"]["heard_every_rank"] and figures["steady"]["rank0_cpu_fraction"] < 0.05, figures
    assert figures["divergence"]["seconds_to_name_it"] < judge.BLOCKED_SECONDS + 2 * peers.BEAT_SECONDS + 1, figures
    assert "waits in allreduce user.metric" in figures["divergence"]["finding"], figures
    assert figures["lost_node"]["seconds_to_name_it"] < peers.SILENT_SECONDS + 2 * peers.BEAT_SECONDS, figures
    assert figures["lost_node"]["line"].startswith(f"not heard from ranks {ranks - 2 * per_node}-"), figures


def test_reading_the_main_threads_place_keeps_no_frame_alive():
    """The recorder reads where the main thread is from that thread too (a dump at a stop): the frame
    it reads must not keep itself, and so its callers' locals, alive. A DataLoader iterator kept so
    outlives the trainer, and multiprocessing's exit then waits forever for its workers, which leave
    SIGTERM to the rank (the stop at --stop-after hung this way)."""
    import gc
    import weakref
    from hvdtrain.liveness import recorder

    class Local:
        pass

    def a_trainer():
        local = Local()
        recorder.main_thread_place()
        return weakref.ref(local)

    gc.disable()  # a cycle is freed only by the collector, which may or may not run at exit
    try:
        assert a_trainer()() is None
    finally:
        gc.enable()
