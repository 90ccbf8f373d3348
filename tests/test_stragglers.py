"""Stragglers: each rank times its steps in parts; a rank slower than the others is named with its host.

The slow rank is real: the cgroup v1 CPU controller limits one rank's process
to a small fraction of a core once training has started (support/ranks.py).
"""
import json
import socket
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from support.bert_data import make_small_static_data
from support.checkpoints import checkpoint_file
from support.checks import is_error_line, ok, one_error_line
from support.commands import CNN, PRETRAIN, QUICK_CNN, SLOW_RANK_WATCH, SLOW_SHARE
from support.launch import horovodrun, launch, wait_then
from support.ranks import cpu_share, rank_pids, require_cpu_cgroup

from hvdtrain.durations import SECTIONS, SectionTimer
from hvdtrain.runtime.stragglers import StragglerWatch, scores, speed_without
from hvdtrain.training import optim

STRAGGLER_EXIT = 5


def times(compute, data=0.001, comm=0.002, optimizer=0.001):
    return {"data": data, "compute": compute, "comm": comm, "optimizer": optimizer}


def watch(patience=2):
    settings = SimpleNamespace(straggler_interval=10, straggler_threshold=0.8, straggler_patience=patience,
                               straggler_action="warn")
    return StragglerWatch(settings, rank=0, size=3)


def table(*per_rank):
    rows = scores(list(per_rank))
    for row in rows:
        row["host"] = f"node-{'abc'[row['rank']]}"
    return rows


def test_scores_name_the_slow_section_relative_to_the_fastest_rank():
    rows = scores([times(0.010), times(0.040, comm=0.001), times(0.010)])
    assert rows[1]["relative"]["compute"] < 0.3 < 0.95 < rows[0]["relative"]["compute"]
    assert rows[1]["relative"]["data"] == pytest.approx(1.0)
    assert rows[0]["relative"]["busy"] == pytest.approx(1.0) and rows[1]["relative"]["busy"] < 0.5
    # the fast ranks wait in the allreduce for the slow one; the slow one waits for no one
    assert rows[0]["waiting"] > 0 and rows[1]["waiting"] == 0
    assert all(set(f"{s}_s" for s in SECTIONS) <= set(row) for row in rows)


def test_a_difference_of_microseconds_is_noise_not_a_straggler():
    rows = scores([times(0.010, data=0.000001), times(0.010, data=0.00002)])
    assert rows[1]["relative"]["data"] > 0.95


def test_individual_score_compares_a_rank_with_its_own_best():
    first = scores([times(0.010), times(0.010)])
    later = scores([times(0.010), times(0.020)], best_busy=[row["best_busy_s"] for row in first])
    assert later[0]["individual"] == pytest.approx(1.0) and later[1]["individual"] < 0.6


def test_speed_without_the_slowest_rank():
    rows = scores([times(0.010, data=0, optimizer=0, comm=0.030), times(0.040, data=0, optimizer=0, comm=0.0)])
    assert speed_without(rows, 1) == pytest.approx(0.25)  # 10 ms without it, 40 ms with it
    assert speed_without(rows, 0) == pytest.approx(1.0)


def test_a_straggler_is_named_after_patience_intervals_and_once_until_it_recovers():
    w = watch(patience=2)
    slow = lambda: table(times(0.010), times(0.010), times(0.030))  # noqa: E731
    healthy = lambda: table(times(0.010), times(0.010), times(0.010))  # noqa: E731
    assert w._verdict(slow()) is None
    found = w._verdict(slow())
    assert found is not None and (found.rank, found.host, found.section, found.intervals) == (2, "node-c", "compute", 2)
    assert found.line().startswith("rank 2 on node-c is the straggler: compute 0.3")
    assert "the job runs at ~41 % of its speed without it" in found.line()  # (12+2)/(32+2) ms
    assert w._verdict(slow()) is None  # named once
    assert w._verdict(healthy()) is None
    assert w._verdict(slow()) is None and w._verdict(slow()) is not None  # slow again: named again


def test_a_straggler_on_one_of_two_nodes_named_alike_is_told_by_its_address_and_never_excluded():
    """Cloned machines or containers may report one host name: the line must say which node
    (its address), and --straggler-action exclude, which discovery applies by name, must not
    drop every node of that name."""
    def straggler_on(*hosts):
        w = watch(patience=1)
        w.placement = [{"rank": rank, "host": host, "node": f"boot-{rank}/4026531992", "address": f"10.0.0.{rank}"}
                       for rank, host in enumerate(hosts)]
        rows = scores([times(0.010), times(0.010), times(0.030)])
        w.locate(rows)
        return w._verdict(rows)

    alike = straggler_on("node-a", "node-b", "node-a")
    assert alike.line().startswith("rank 2 on node-a (the node at 10.0.0.2, one of 2 named node-a) is the straggler")
    assert "drop all of them" in alike.exclusion_refused()
    distinct = straggler_on("node-a", "node-b", "node-c")  # the host alone, and leaving it out is fine
    assert distinct.line().startswith("rank 2 on node-c is the straggler") and distinct.exclusion_refused() is None


class DecidedAfterAWait:
    """A non-finite guard whose collective decision (every rank's flag) waits for a slower peer."""

    WAIT = 0.05

    def skip_step(self):
        time.sleep(self.WAIT)
        return False


def test_waiting_in_the_ranks_step_decision_is_comm_not_the_ranks_own_work():
    """The ranks decide together whether to skip a step (a collective after the gradient allreduce):
    a fast rank waits there for a slow one, and that wait must not count as its busy time."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    timer = SectionTimer()
    assert optim.finish_step(optimizer, torch.amp.GradScaler("cpu", enabled=False), guard=DecidedAfterAWait(),
                             timer=timer)
    assert timer.seconds["comm"] >= DecidedAfterAWait.WAIT > timer.seconds["optimizer"], timer.seconds


def slow_rank_one_once_training(output, share):
    """Throttle rank 1 to ``share`` of a core once rank 0 holds the output directory's lock."""
    require_cpu_cgroup()
    throttled = []

    def throttle():
        for pid in rank_pids(str(output), rank=1):
            share.add(pid)
            throttled.append(pid)
    wait_then(lambda: (output / "run.lock").exists() and rank_pids(str(output), rank=1), throttle, timeout=240)
    return throttled


def straggler_lines(output):
    return [line for line in output.splitlines() if "is the straggler" in line and not is_error_line(line)]


def test_a_throttled_rank_is_named_with_its_host_in_the_log_and_the_tables(tmp_path, need_horovod, need_mpi):
    """mpirun, 2 ranks, rank 1 at 5 % of a core: one line naming it; per-rank tables in the outputs."""
    out = tmp_path / "run"
    with cpu_share(SLOW_SHARE) as share:
        throttled = slow_rank_one_once_training(out, share)
        run = launch(["mpirun", "-np", "2", "--bind-to", "none", sys.executable, CNN, *QUICK_CNN, "--threads", "1",
                      "--epochs", "2", "--output-dir", out, *SLOW_RANK_WATCH], timeout=300)
    ok(run)
    assert throttled, run.describe()
    lines = straggler_lines(run.output)
    intervals = [json.loads(line) for line in (out / "stragglers.jsonl").read_text().splitlines()]
    # Named once, and again only after an interval in which it kept up (a loaded machine's noise).
    assert lines and all(f"rank 1 on {socket.gethostname()} is the straggler: " in line for line in lines), \
        f"{run.describe()}\nthe intervals' busy scores: {[[r['relative']['busy'] for r in i['ranks']] for i in intervals]}"
    assert len(intervals) >= 3 and [i["step"] for i in intervals] == sorted(i["step"] for i in intervals)
    # Over the whole run, not one interval: a CPU quota stalls the throttled rank in bursts, and
    # a burst may land inside an allreduce, where it counts as that interval's waiting.
    busy = [sum(i["ranks"][rank]["relative"]["busy"] for i in intervals) / len(intervals) for rank in (0, 1)]
    waiting = [sum(i["ranks"][rank]["waiting"] for i in intervals) for rank in (0, 1)]
    assert busy[1] < 0.8 <= busy[0], intervals
    assert waiting[0] > waiting[1], intervals  # rank 0 waits for rank 1
    results = json.loads((out / "results.json").read_text())
    assert [row["rank"] for row in results["ranks"]["ranks"]] == [0, 1]


def test_checkpoint_exit_names_the_host_exits_5_and_the_run_resumes(tmp_path, need_horovod):
    """BERT, horovodrun --gloo: exit status 5 on every rank after a checkpoint, the host in one line and in
    HVDTRAIN_STRAGGLER_FILE; relaunched on healthy ranks it resumes there and finishes, naming no one."""
    data = make_small_static_data(tmp_path)
    out, host_file = tmp_path / "run", tmp_path / "straggler-host"
    args = [PRETRAIN, "--data", data, "--output-dir", out, "--model", "tiny", "--batch-size", "8",
            "--steps", "60", "--log-every", "5", "--checkpoint-every", "0", *SLOW_RANK_WATCH]
    with cpu_share(SLOW_SHARE) as share:
        throttled = slow_rank_one_once_training(out, share)
        stopped = horovodrun(2, [*args, "--straggler-action", "checkpoint-exit"], timeout=300,
                             env={"HVDTRAIN_STRAGGLER_FILE": str(host_file)})
    # horovodrun exits 1 when a rank fails and names the first rank's status
    assert throttled and stopped.returncode != 0 and not stopped.timed_out, stopped.describe()
    assert f"Exit code: {STRAGGLER_EXIT}\n" in stopped.output, stopped.describe()
    host = "localhost"  # horovodrun's name for this machine (HOROVOD_HOSTNAME), as in its -H and hostfiles
    line = one_error_line(stopped, f"rank 1 on {host} is the straggler", "checkpoint written to",
                          f"relaunch without {host}", status=STRAGGLER_EXIT)
    assert host_file.read_text().strip() == host, line
    step = json.loads((out / "results.json").read_text())["steps"]
    assert 0 < step < 60 and checkpoint_file(out, step).exists(), line

    # Without the throttle no rank is named (the threshold is SLOW_RANK_WATCH's 0.5).
    resumed = horovodrun(2, args, timeout=300)
    ok(resumed)
    assert f"resumed from {out} at step {step}" in resumed.output, resumed.describe()
    assert not straggler_lines(resumed.output), resumed.describe()
    assert json.loads((out / "results.json").read_text())["steps"] == 60
