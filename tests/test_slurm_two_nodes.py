"""slurm/ on a real two-node Slurm cluster: one slurmd on each of support/hosts.py's hosts.

    hvd-a 10.77.0.1: slurmctld, slurmd -N hvd-a    hvd-b 10.77.0.2: slurmd -N hvd-b, sshd

Every job asks for `sbatch --nodes=2 --ntasks-per-node=1`, so its two ranks can
only meet over the network between the hosts. The CNN trainer runs under each
launcher (srun and horovodrun; mpirun in `make test-scale`), BERT under srun (the others: `make
test-scale`); the horovodrun CNN run is sent USR1, is
requeued and ends with the same weights as the uninterrupted runs; probe jobs
(tests/workers/preemptible.py) show which rank each launcher lets the signal
reach; a CNN run whose rank on hvd-b is slowed is requeued without hvd-b and
finishes on hvd-a alone. All jobs are submitted together and run side by side;
every wait is bounded.
"""
import json
import re
import time

import pytest

from support.bert_data import prepare_bert_data
from support.commands import SLOW_RANK_WATCH, SLOW_SHARE
from support.launch import REPO
from support.needs import require_module, require_program
from support.ranks import cpu_share, rank_pids, require_cpu_cgroup
from support.selected import is_selected, selected_values
from support.slurm_cluster import running_on
from support.slurm_jobs import (LAUNCHERS, SLURM, assert_requeued_once, ended, events, probe_sbatch,
                                send_usr1_to_batch_shell)
from support.weights import assert_same_tensors, checkpoint_at


JOB_TIMEOUT = 420  # ten jobs of two ranks share this machine's cores
# The ranks' interpreter: prints the host each rank runs on, then runs python.
PYTHON_ON_HOST = REPO / "tests" / "workers" / "python_on_host.sh"
CNN_STEPS = 200  # long enough that USR1 lands mid-run (see test_slurm.py)
CNN_RUN = ["--model", "convnet", "--dataset", "digits", "--epochs", "5", "--max-steps", CNN_STEPS,
           "--keep-checkpoints", "1"]
BERT_STEPS = 4
BERT_RUN = ["--model", "tiny", "--batch-size", "8", "--steps", BERT_STEPS, "--checkpoint-every", "0"]
# The run that loses hvd-b: long enough that the straggler is named mid-run, on a
# global batch that keeps its optimisation when it goes on with one rank.
SHRINK_RUN = ["--model", "convnet", "--dataset", "digits", "--epochs", "20", "--global-batch", "64",
              "--precision", "fp32", "--keep-checkpoints", "1", *SLOW_RANK_WATCH,
              "--straggler-action", "checkpoint-exit"]
DIGITS_TRAIN = 1438  # samples in each epoch's row
PROBE_STEPS = 40
# Probe jobs (tests/workers/preemptible.py) that get USR1: name -> (LAUNCHER, LAUNCHER_ARGS,
# the signal hvd-b's rank gets itself). srun and mpirun forward USR1 to every rank
# on every node; horovodrun forwards none, and the batch shell on hvd-a reaches only
# hvd-a's ranks: hvd-b's rank, started by horovodrun through mpirun and srun (inside
# the job) or with --gloo through ssh (outside it), is told by the other ranks.
PROBES = {"probe-srun": ("srun", "", "SIGUSR1"), "probe-mpirun": ("mpirun", "", "SIGUSR1"),
          "probe-horovodrun": ("horovodrun", "", None), "probe-horovodrun-gloo": ("horovodrun", "--gloo", None)}


@pytest.fixture(scope="session")
def two_node_slurm(two_hosts):
    """slurmctld and slurmd hvd-a on host hvd-a, slurmd hvd-b on host hvd-b."""
    with running_on(two_hosts) as cluster:
        yield cluster


def submit_on_two_nodes(cluster, two_hosts, sbatch_file, log, args, launcher, launcher_args=""):
    """One rank on each node; the job's PATH has two_hosts' ssh, which horovodrun uses."""
    return cluster.sbatch(["--output", log, "--nodes=2", "--ntasks-per-node=1", sbatch_file, *map(str, args)],
                          env={**two_hosts.env(), "LAUNCHER": launcher, "LAUNCHER_ARGS": launcher_args,
                               "PYTHON": str(PYTHON_ON_HOST)})


def slow_rank_on_hvd_b(share, out):
    """An action for act_when_ready: once the run trains (its lock written), its rank 1,
    the one on hvd-b, gets ``share``'s sliver of a core."""
    def ready():
        return (out / "run.lock").exists() and bool(rank_pids(str(out), rank=1))

    def act():
        for pid in rank_pids(str(out), rank=1):
            share.add(pid)
    return ready, act


@pytest.fixture(scope="module")
def two_node_jobs(request, two_node_slurm, two_hosts, tmp_path_factory):
    """Every job of this module, submitted at once; the probes and the horovodrun CNN
    run get USR1. Returns {name: Ended}."""
    require_module("horovod.torch")
    require_program("horovodrun", "run `make setup`")
    require_program("mpirun", "install Open MPI or `make setup` as root")
    root = tmp_path_factory.mktemp("two-nodes")
    prepare_bert_data(root / "bert-data", 32)
    runs = {}  # name: (sbatch file, launcher, arguments, LAUNCHER_ARGS)
    cnn = selected_values(request, "test_train_cnn_on_two_nodes_matches_the_srun_run", "launcher")
    for launcher in sorted({*cnn, "srun"}) if cnn else ():  # srun's run: the others' reference
        runs[f"cnn-{launcher}"] = (SLURM / "train_cnn.sbatch", launcher,
                                   [*CNN_RUN, "--output-dir", root / f"cnn-{launcher}"], "")
    for launcher in selected_values(request, "test_pretrain_bert_on_two_nodes", "launcher"):
        bert_args = ["--data", root / "bert-data", *BERT_RUN, "--output-dir", root / f"bert-{launcher}"]
        runs[f"bert-{launcher}"] = (SLURM / "pretrain_bert.sbatch", launcher, bert_args, "")
    probes = selected_values(request, "test_usr1_stops_both_nodes_at_one_step_and_they_resume", "name")
    for name, (launcher, launcher_args, _) in PROBES.items():
        if name not in probes:
            continue
        runs[name] = (probe_sbatch(root), launcher, [root / name, PROBE_STEPS, 0.3], launcher_args)
    shrinks = is_selected(request, "test_a_job_requeued_without_its_straggler_node_finishes_on_the_node_left")
    if shrinks:
        require_cpu_cgroup()
        runs["cnn-shrinks"] = (SLURM / "train_cnn.sbatch", "srun", [*SHRINK_RUN, "--output-dir", root / "cnn-shrinks"],
                               "")
    with cpu_share(SLOW_SHARE) as share:
        jobs = {name: submit_on_two_nodes(two_node_slurm, two_hosts, sbatch_file, root / f"{name}.out", args,
                                          launcher, launcher_args)
                for name, (sbatch_file, launcher, args, launcher_args) in runs.items()}

        # Interrupt once the ranks train: the CNN once rank 0 logs its start, a probe
        # once both ranks have written their first event; whichever is first.
        actions = {name: (lambda out=root / name: bool(events(out, 0) and events(out, 1)),
                          lambda job=jobs[name]: send_usr1_to_batch_shell(two_node_slurm, job)) for name in probes}
        if "cnn-horovodrun" in runs:
            actions["cnn-horovodrun"] = (lambda: "convnet on digits" in read_log(root / "cnn-horovodrun.out"),
                                         lambda: send_usr1_to_batch_shell(two_node_slurm, jobs["cnn-horovodrun"]))
        if shrinks:
            actions["cnn-shrinks"] = slow_rank_on_hvd_b(share, root / "cnn-shrinks")
        act_when_ready(two_node_slurm, jobs, actions)
        return {name: ended(two_node_slurm, job, root / f"{name}.out", root / name, JOB_TIMEOUT)
                for name, job in jobs.items()}


def read_log(path):
    return path.read_text(errors="replace") if path.exists() else ""


def act_when_ready(cluster, jobs, actions):
    """``actions``: {name: (ready, act)}; ``act()`` as soon as ``ready()`` holds, while the
    job still runs (a job that ended before fails the test)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    waiting = dict(actions)
    while waiting:
        for name, (is_ready, act) in list(waiting.items()):
            info = cluster.job(jobs[name])
            if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
                pytest.fail(f"{name} (job {jobs[name]}) ended before it was acted on: {info}\n"
                            f"{cluster.job_output(info)}")
            if is_ready():
                act()
                del waiting[name]
        if waiting and time.monotonic() > deadline:
            pytest.fail(f"not ready to be acted on after {JOB_TIMEOUT} s: {sorted(waiting)}")
        time.sleep(0.5)


def assert_ran_on_both_hosts(log, name, runs=1):
    """Rank 0 on hvd-a, rank 1 on hvd-b, in each of ``runs`` launches (python_on_host.sh)."""
    assert "2 node(s) hvd-a,hvd-b, 2 ranks" in log, f"{name}:\n{log}"
    started = re.findall(r"rank (\d) starts on host (\S+)", log)
    assert sorted(started) == sorted([("0", "hvd-a"), ("1", "hvd-b")] * runs), f"{name}: {started}\n{log}"


# srun's run is the reference (make test); mpirun's and horovodrun's in `make test-scale`. mpirun forwards
# USR1 to both nodes (the probes below) and runs the CNN under Slurm on one node (test_slurm.py);
# horovodrun's run is requeued: its USR1, requeue and bit-identical resume are test_slurm.py's on one
# node, and its rank on hvd-b, which nothing signals, stops with hvd-a's in the probe below.
@pytest.mark.parametrize("launcher", [launcher if launcher == "srun" else pytest.param(launcher, marks=pytest.mark.scale)
                                      for launcher in LAUNCHERS])
def test_train_cnn_on_two_nodes_matches_the_srun_run(two_node_jobs, launcher):
    """srun and mpirun run straight through; horovodrun is interrupted by USR1, requeued
    and resumed. All three end with bit-identical weights."""
    info, log, out = two_node_jobs[f"cnn-{launcher}"]
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == CNN_STEPS and results["world_size"] == 2, results
    if launcher == "horovodrun":
        assert_requeued_once(None, info["JobId"], info, log)
        # Only hvd-a's rank is signalled (horovodrun forwards no signals, and the batch
        # shell reaches only the ranks on its own node); the probe test below shows
        # that hvd-b's rank stops through the collective check.
        assert re.search(r"stopped by SIGUSR1 \(rank 0\) at step \d+", log), log
        assert_ran_on_both_hosts(log, launcher, runs=2)
    else:
        assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "0", f"{info}\n{log}"
        assert_ran_on_both_hosts(log, launcher)
    baseline = checkpoint_at(two_node_jobs["cnn-srun"].out, CNN_STEPS)
    final = checkpoint_at(out, CNN_STEPS)
    assert_same_tensors(final["model"], baseline["model"], f"{launcher} model")
    assert_same_tensors(final["optimizer"], baseline["optimizer"], f"{launcher} optimizer")


# pretrain_bert.sbatch and train_cnn.sbatch launch through the same slurm/common.sh: BERT under
# srun in `make test`, under the other launchers in `make test-scale`.
@pytest.mark.parametrize("launcher", ["srun", *(pytest.param(launcher, marks=pytest.mark.scale)
                                                for launcher in LAUNCHERS if launcher != "srun")])
def test_pretrain_bert_on_two_nodes(two_node_jobs, launcher):
    info, log, out = two_node_jobs[f"bert-{launcher}"]
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == BERT_STEPS and results["world_size"] == 2 and results["completed"], results
    assert_ran_on_both_hosts(log, launcher)


@pytest.mark.parametrize("name", PROBES)
def test_usr1_stops_both_nodes_at_one_step_and_they_resume(two_node_jobs, name):
    """hvd-a's rank gets USR1; hvd-b's rank gets it from srun or mpirun, or under
    horovodrun (never signalled) follows through the collective check. Both stop
    after the same step and resume from it in the requeued run."""
    info, log, out = two_node_jobs[name]
    assert_requeued_once(None, info["JobId"], info, log)
    by_host = {}
    for rank in (0, 1):
        seen = events(out, rank)
        happened = [(e["event"], e["restart"]) for e in seen]
        assert happened == [("start", 0), ("stop", 0), ("start", 1), ("done", 1)], seen
        assert seen[0]["size"] == 2 and seen[0]["host"] == seen[1]["host"], seen
        by_host[seen[0]["host"]] = seen
    assert sorted(by_host) == ["hvd-a", "hvd-b"], by_host
    stop_a, stop_b = by_host["hvd-a"][1], by_host["hvd-b"][1]
    assert stop_a["signal"] == "SIGUSR1" and stop_b["signal"] == PROBES[name][2], (stop_a, stop_b)
    assert stop_a["step"] == stop_b["step"] < PROBE_STEPS, (stop_a, stop_b)
    for seen in by_host.values():
        assert seen[2]["step"] == stop_a["step"] and seen[3]["step"] == PROBE_STEPS, seen


def test_a_job_requeued_without_its_straggler_node_finishes_on_the_node_left(two_node_jobs):
    """Rank 1 on hvd-b is slowed: --straggler-action checkpoint-exit names hvd-b, and
    slurm/common.sh requeues the job without it. No node is spare, so the requeued run
    starts on hvd-a alone (the job's range set again: 1 to 2 nodes), resumes the two
    ranks' checkpoint on one rank and finishes: each epoch trained every sample once."""
    info, log, out = two_node_jobs["cnn-shrinks"]
    job = info["JobId"]
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", f"{info}\n{log}"
    for expected in ("restart count 0: 2 node(s) hvd-a,hvd-b, 2 ranks", "rank 1 on hvd-b is the straggler",
                     f"requeueing job {job} without node hvd-b (a straggler) on 1 to 2 nodes",
                     "restart count 1: 1 node(s) hvd-a, 1 ranks", "resuming 2 ranks' checkpoint on 1"):
        assert expected in log, f"the log lacks {expected!r}:\n{log}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(1, 21)), rows
    assert {row["train_samples"] for row in rows} == {DIGITS_TRAIN}, rows
    # The epoch the job stopped in is written by the run on one rank (1438 samples: both runs' share).
    sizes = [row["world_size"] for row in rows]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 1, sizes
    assert json.loads((out / "results.json").read_text())["world_size"] == 1
