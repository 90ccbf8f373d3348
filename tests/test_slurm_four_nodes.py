"""slurm/ on a real four-node Slurm cluster: a slurmd on each of support/hosts.py's node1-node4.

    node1 10.78.0.1: slurmctld, slurmd -N node1    node2-node4: slurmd -N nodeN, sshd

Every job is `sbatch --nodes=4 --ntasks-per-node=4 --exclusive slurm/train_cnn.sbatch`:
16 ranks, four per node, under each LAUNCHER (srun, mpirun, horovodrun). Each
equals one worker with the same global batch (support/sixteen_ranks.py) and knows
its node (host, local rank and size, threads). The horovodrun job gets USR1 once
it trains, checkpoints, is requeued and resumes; it ends bit-identical to the
uninterrupted srun job. --exclusive runs the jobs one at a time: 16 ranks already
fill this machine's two cores. Then faults that only nodes have: under srun a
frozen, a partitioned and a vanished node; under LAUNCHER=horovodrun-elastic
(sbatch --no-kill) the last node's slurmd and ranks killed, the job going on without it.

`make test` runs the faults on two of the nodes with two ranks each (TWO_BY_2, the
smallest real form: a node's ranks are several); `make test-scale` runs every test
here at 16 ranks.
"""
import contextlib
import json
import re
import sys
import time

import pytest

from support.checkpoints import any_checkpoint, checkpoint_file, newest_step
from support.checks import error_lines, ok, the_error_line
from support.commands import CNN, DISCOVER
from support.hosts import INTERFACE
from support.launch import launch
from support.needs import require_module, require_program
from support.ranks import cpu_share, require_cpu_cgroup, slow_down, waits_held, waits_held_once_frozen
from support.sixteen_ranks import (BERT_COMPARED_STEPS, FOUR_BY_4, RANKS, SMALL, TWO_BY_2,
                                   assert_placed_four_per_host, assert_same_weights_as, bert_reference, one_worker,
                                   sixteen_by_4)
from support.slurm_cluster import running_on
from support.slurm_jobs import LAUNCHERS, SLURM, assert_requeued_once, ended, send_usr1_to_batch_shell
from support.weights import assert_same_tensors, checkpoint_at

# 16 ranks on 2 cores: the tests beside them would starve, so they run alone.
SIXTEEN = [pytest.mark.scale, pytest.mark.whole_machine]
SHAPES = [pytest.param(TWO_BY_2, id=str(TWO_BY_2)), pytest.param(FOUR_BY_4, marks=SIXTEEN, id=str(FOUR_BY_4))]

STEPS, CHECKPOINT_EVERY = 60, 20  # long enough that USR1 lands mid-run
JOB_TIMEOUT = 600  # per job; they run one after another
POLL = 0.5


@pytest.fixture(scope="module")
def four_node_slurm(four_hosts):
    """slurmctld and slurmd node1 on host node1, slurmd nodeN on host nodeN."""
    with running_on(four_hosts) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def four_node_jobs(four_node_slurm, four_hosts, tmp_path_factory):
    """The reference (one worker, batch 64) and one job per LAUNCHER, submitted at once;
    the horovodrun job gets USR1 once it trains. Returns (reference, {launcher: Ended})."""
    require_module("horovod.torch")
    require_program("horovodrun", "run `make setup`")
    require_program("mpirun", "install Open MPI or `make setup` as root")
    root = tmp_path_factory.mktemp("four-nodes")
    reference = one_worker(root / "one-worker", STEPS, CHECKPOINT_EVERY, JOB_TIMEOUT)
    jobs = {launcher: four_node_slurm.sbatch(
        ["--output", root / f"{launcher}.out", "--nodes=4", "--ntasks-per-node=4", "--exclusive",
         SLURM / "train_cnn.sbatch", *map(str, [*sixteen_by_4(CHECKPOINT_EVERY), "--max-steps", STEPS,
                                               "--output-dir", root / launcher])],
        env={**four_hosts.env(), "LAUNCHER": launcher}) for launcher in LAUNCHERS}
    signal_once_training(four_node_slurm, jobs["horovodrun"], root / "horovodrun.out")
    done = {launcher: ended(four_node_slurm, job, root / f"{launcher}.out", root / launcher,
                            JOB_TIMEOUT * len(LAUNCHERS))
            for launcher, job in jobs.items()}
    if open_mpi_failed_at_start(*done["srun"]):  # the srun job once more, alone (below)
        print(f"the srun job: Open MPI failed at start-up; submitted again\n{done['srun'].log}")
        again = root / "srun-again"
        job = four_node_slurm.sbatch(
            ["--output", root / "srun-again.out", "--nodes=4", "--ntasks-per-node=4", "--exclusive",
             SLURM / "train_cnn.sbatch", *map(str, [*sixteen_by_4(CHECKPOINT_EVERY), "--max-steps", STEPS,
                                                   "--output-dir", again])],
            env={**four_hosts.env(), "LAUNCHER": "srun"})
        done["srun"] = ended(four_node_slurm, job, root / "srun-again.out", again, JOB_TIMEOUT)
    return reference, done


def signal_once_training(cluster, job, log):
    """USR1 to the job's batch shell once rank 0 has logged its first line (it must still run)."""
    deadline = time.monotonic() + JOB_TIMEOUT * len(LAUNCHERS)
    while "convnet on digits" not in (log.read_text(errors="replace") if log.exists() else ""):
        info = cluster.job(job)
        if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job {job} ended before it was signalled: {info}\n{cluster.job_output(info)}")
        if time.monotonic() > deadline:
            pytest.fail(f"job {job} not training after {JOB_TIMEOUT * len(LAUNCHERS)} s: {info}")
        time.sleep(0.5)
    send_usr1_to_batch_shell(cluster, job)


@pytest.mark.parametrize("launcher", [pytest.param(launcher, marks=SIXTEEN) for launcher in LAUNCHERS])
def test_16_ranks_on_four_slurm_nodes_equal_one_worker(four_node_jobs, launcher):
    reference, jobs = four_node_jobs
    info, log, out = jobs[launcher]
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    assert f"4 node(s) node[1-4], {RANKS} ranks, 1 thread(s) each" in log, log
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == STEPS and results["world_size"] == RANKS, results
    assert_same_weights_as(out, reference, (STEPS,))  # the checkpoints kept: the last, epoch ends
    assert_placed_four_per_host(out)


@pytest.mark.scale
@pytest.mark.whole_machine
def test_usr1_checkpoints_requeues_and_resumes_16_ranks_bit_identical(four_node_jobs):
    """horovodrun forwards no signal: the batch shell on node1 signals node1's ranks, the
    other 12 follow through the collective stop check; all stop after one step, the job
    is requeued and resumes there, and ends equal, bit for bit, to the srun job."""
    _, jobs = four_node_jobs
    info, log, out = jobs["horovodrun"]
    assert_requeued_once(None, info["JobId"], info, log)
    stopped = re.search(r"stopped by SIGUSR1 \(rank 0\) at step (\d+)", log)
    assert stopped and 0 < int(stopped[1]) < STEPS, log
    assert f"(step {stopped[1]})" in log, log
    expected, actual = checkpoint_at(jobs["srun"].out, STEPS), checkpoint_at(out, STEPS)
    assert_same_tensors(actual["model"], expected["model"], "model")
    assert_same_tensors(actual["optimizer"]["state"], expected["optimizer"]["state"], "optimizer")


# ----------------------------------------------------------------------- faults that only nodes have, under srun
QUICK_WATCHDOG = {"HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "15"}


def fault_job(shape):
    """Batch 64 a step at every shape."""
    return [*SMALL, "--batch-size", 64 // shape.ranks, "--epochs", "3", "--checkpoint-every", "10"]


def on_nodes(shape):
    """sbatch's options for ``shape``: its nodes by name, its ranks per node, alone on them."""
    return [f"--nodelist={','.join(shape.hosts)}", f"--nodes={len(shape.hosts)}",
            f"--ntasks-per-node={shape.slots}", "--exclusive"]


def srun_job(cluster, hosts, log, out, env, shape):
    """``shape``'s ranks under LAUNCHER=srun (srun --mpi=pmix --kill-on-bad-exit)."""
    return cluster.sbatch(["--output", log, *on_nodes(shape),
                           SLURM / "train_cnn.sbatch", *map(str, [*fault_job(shape), "--output-dir", out])],
                          env={**hosts.env(), "LAUNCHER": "srun", **env})


@pytest.mark.scale
@pytest.mark.whole_machine
def test_pretrain_bert_16_ranks_under_srun_equal_one_worker(four_node_slurm, four_hosts, tmp_path):
    """sbatch --nodes=4 --ntasks-per-node=4 slurm/pretrain_bert.sbatch under srun: 16 ranks x 1
    sequence train the weights of one worker x 16 (support/sixteen_ranks.py's BERT workload)."""
    common, reference = bert_reference(tmp_path, JOB_TIMEOUT)

    def submit(attempt):
        out, log = tmp_path / f"run{attempt}", tmp_path / f"job{attempt}.out"
        return four_node_slurm.sbatch(["--output", log, "--nodes=4", "--ntasks-per-node=4", "--exclusive",
                                       SLURM / "pretrain_bert.sbatch",
                                       *map(str, [*common, "--batch-size", 1, "--output-dir", out])],
                                      env={**four_hosts.env(), "LAUNCHER": "srun"}), log, out

    job, log, out = past_open_mpi_start(four_node_slurm, submit)
    info = four_node_slurm.wait_for_end(job, JOB_TIMEOUT)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", f"{info}\n{text}"
    assert f"4 node(s) node[1-4], {RANKS} ranks, 1 thread(s) each" in text, text
    assert_same_weights_as(out, reference, BERT_COMPARED_STEPS)


def past_open_mpi_start(cluster, submit, checkpointed=False, trained=any_checkpoint):
    """``submit(attempt)`` -> (job, its log, its output directory); the job waited for until it
    ended, or with ``checkpointed`` until its first checkpoint, and submitted once more when
    Open MPI failed at start-up (below; ``trained(out)``: whether the job wrote a checkpoint).
    (job, log, output directory) of the job that started."""
    for attempt in range(2):
        job, log, out = submit(attempt)
        if checkpointed:
            cluster.wait_for(job, lambda info: trained(out) or info.get("JobState") not in (
                "PENDING", "RUNNING", "CONFIGURING"), "checkpointed", JOB_TIMEOUT)
            if trained(out):
                return job, log, out
        info = cluster.wait_for_end(job, JOB_TIMEOUT)
        text = log.read_text(errors="replace")
        if attempt or not open_mpi_failed_at_start(info, text, out, trained):
            break
        print(f"job {job}: Open MPI failed at start-up; submitted again\n{text}")
    if checkpointed:
        pytest.fail(f"job {job} ended before its first checkpoint: {info}\n{text}", pytrace=False)
    return job, log, out


def open_mpi_failed_at_start(info, text, out, trained=any_checkpoint):
    """The intermittent start-up failure of Open MPI 4.1 under srun on these simulated nodes
    (seen three times in about eleven suite runs, 2026-11-25 to 27, twice more on 2026-12-04 and
    05, each time node3's first task, and on 2026-12-07 node1's rank 0; not understood): a rank segfaults before training starts,
    mostly after its shared memory set-up failed (open(2): ENOENT, a segment file; ompi issue 5262
    describes the same failure), once with srun's line alone. One resubmission, for the tests
    whose job must start; docs/testing.md. ``trained(out)``: the job wrote a checkpoint."""
    segfault = ("A system call failed during shared memory initialization" in text
                or re.search(r"^srun: error: node\d+: tasks? [\d-]+: Segmentation fault", text, re.M))
    return info.get("ExitCode") == "139:0" and bool(segfault) and not trained(out)


def assert_one_line_naming_the_last_node(log, shape):
    line = the_error_line(log, "rank 0: error:", shape.last_ranks())
    assert "Traceback" not in log and "terminate called" not in log, log
    return line


@pytest.mark.parametrize("shape", SHAPES)
def test_a_frozen_node_under_srun_ends_the_job_with_one_line_naming_it(four_node_slurm, four_hosts, shape, tmp_path):
    """The last node's ranks SIGSTOPped after step 15: rank 0 names them, srun --kill-on-bad-exit
    ends the step (a stopped task still dies of SIGKILL), the job fails, one line."""
    lost = f"{shape.ranks - shape.slots}-{shape.ranks - 1}"
    job = srun_job(four_node_slurm, four_hosts, tmp_path / "job.out", tmp_path / "run",
                   {"HVDTRAIN_FAULT": f"rank={lost},step=15,kind=stop", **QUICK_WATCHDOG}, shape)
    try:
        with waits_held_once_frozen(str(tmp_path / "run"), shape.ranks):  # the survivors' MPI waits poll
            info = four_node_slurm.wait_for_end(job, JOB_TIMEOUT)
    finally:
        four_hosts.vanish(shape.last, "train_cnn.py")  # should a stopped rank outlive the job
    log = (tmp_path / "job.out").read_text(errors="replace")
    assert info["JobState"] == "FAILED", f"{info}\n{log}"
    print(f"a frozen node under srun: {assert_one_line_naming_the_last_node(log, shape)}")


@pytest.mark.parametrize("shape", SHAPES)
def test_a_partitioned_node_under_srun_ends_the_job_within_120_s_with_one_line(four_node_slurm, four_hosts, shape,
                                                                                 tmp_path):
    """The last node's link taken down once the job has checkpointed (its ranks and slurmd alive,
    their packets lost): rank 0 names its ranks, the job's batch step ends within 120 s of the
    cut. Slurm finishes the job's cleanup on that node when it answers again (or is declared
    down after SlurmdTimeout): the job shows COMPLETING meanwhile."""
    out = tmp_path / "run"

    def submit(attempt):
        log = tmp_path / f"job{attempt}.out"
        return srun_job(four_node_slurm, four_hosts, log, out, QUICK_WATCHDOG, shape), log, out

    job, log, _ = past_open_mpi_start(four_node_slurm, submit, checkpointed=True)
    cut = time.monotonic()
    four_hosts.link(shape.last, "down")
    try:
        with waits_held(str(out), shape.ranks) as hold:
            hold()  # every rank now waits in MPI, which polls
            four_node_slurm.wait_for(job, lambda info: info.get("JobState") != "RUNNING", "ended", JOB_TIMEOUT)
        ended = time.monotonic()
    finally:
        four_hosts.link(shape.last, "up")
        # The cut-off ranks would still hold their ports and memory when the next job starts.
        four_hosts.vanish(shape.last, "train_cnn.py")
    info = four_node_slurm.wait_for_end(job, JOB_TIMEOUT)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "FAILED", f"{info}\n{text}"
    assert ended - cut < 120, f"the job ran {ended - cut:.0f} s after the partition\n{text}"
    line = assert_one_line_naming_the_last_node(text, shape)
    print(f"a partitioned node under srun: the job ended {ended - cut:.0f} s after the cut: {line}")


@pytest.mark.parametrize("shape", SHAPES)
def test_a_node_that_vanishes_under_srun_ends_the_job_and_the_last_checkpoint_resumes(four_node_slurm, four_hosts,
                                                                                     shape, tmp_path):
    """The last node's ranks SIGKILLed at once once the job has checkpointed: srun names the node's
    tasks, no rank adds a line of its own beyond rank 0's, and the job submitted again resumes
    from the last checkpoint."""
    out = tmp_path / "run"

    def submit(attempt):
        log = tmp_path / f"job{attempt}.out"
        return srun_job(four_node_slurm, four_hosts, log, out, {}, shape), log, out

    job, job_out, _ = past_open_mpi_start(four_node_slurm, submit, checkpointed=True)
    four_hosts.vanish(shape.last, "train_cnn.py")
    info = four_node_slurm.wait_for_end(job, JOB_TIMEOUT)
    log = job_out.read_text(errors="replace")
    assert info["JobState"] == "FAILED", f"{info}\n{log}"
    assert shape.last in log and len(error_lines(log)) <= 1, log
    assert "Traceback" not in log and "terminate called" not in log, log
    last = newest_step(out)

    def resubmit(attempt):
        log = tmp_path / f"again{attempt}.out"
        return srun_job(four_node_slurm, four_hosts, log, out, {}, shape), log, out

    again, again_out, _ = past_open_mpi_start(four_node_slurm, resubmit, trained=lambda out: newest_step(out) != last)
    info = four_node_slurm.wait_for_end(again, JOB_TIMEOUT)
    text = again_out.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and f"restored step {last} from {out}" in text, f"{info}\n{text}"


# ----------------------------------------------------------------------- elastic: a node lost, the job goes on
DIGITS_TRAIN = 1438  # digits samples left for training by the fixed validation split
ELASTIC_EPOCHS = 10
# Slurm's default SlurmdTimeout (300 s) pings a quiet node every 100 s: node4 would be
# flagged long after the test should be over. 30 s: a ping every 10 s, node4 flagged
# not responding (`allocated*`) 20-30 s after its slurmd died (measured), DOWN soon after.
# Only for this test: the partition test above needs node4 kept up for its 120 s.
SLURMD_TIMEOUT = 30
# Horovod lets a blacklisted host in again after this cooldown if discovery lists it: longer
# than Slurm takes to flag node4 (20 and 28 s measured), so the job stays at 12 only if
# discovery leaves node4 out; shorter than the job's 12-rank part (it ends about 100 s
# after the kill), so that a node4 let in again would show.
COOLDOWN = (50, 60)
# At 2x2 the two survivors would finish the run about 15 s after the kill: before Slurm flags
# the lost node and long before the cooldown ends, so neither would be tested. Held together to
# a quarter of a core (the CPU controller: a real slow rank, support/ranks.py), they train on
# past both, as the 12 survivors at 16 ranks do at full speed.
SURVIVORS_SHARE = 0.25


@pytest.mark.parametrize("shape", SHAPES)
def test_elastic_job_loses_a_nodes_slurmd_and_ranks_goes_on_without_it_and_completes(four_node_slurm, four_hosts,
                                                                                      shape, tmp_path):
    """`sbatch --no-kill` with LAUNCHER=horovodrun-elastic (2 nodes of 2 ranks, or 4 of 4): the
    last node dies in epoch 2 (its slurmd and its ranks SIGKILLed at once). Horovod blacklists it
    and the other nodes' ranks go on from the last commit; Slurm flags it not responding, then
    DOWN, and `discover_hosts.py --slurm` leaves it out, so the cooldown's end does not bring it
    back. The job completes, exit 0, every epoch training every sample once."""
    require_module("horovod.torch")
    require_program("horovodrun", "run `make setup`")
    require_cpu_cgroup()
    out, log, lost, ranks = tmp_path / "run", tmp_path / "job.out", shape.last, shape.ranks
    four_node_slurm.reconfigure(SlurmdTimeout=SLURMD_TIMEOUT)
    try:
        job = four_node_slurm.sbatch(
            ["--output", log, "--no-kill", *on_nodes(shape), SLURM / "train_cnn.sbatch",
             *map(str, [*SMALL, "--elastic-commit-every", "5", "--batch-size", 64 // ranks, "--lr", 0.1 / ranks,
                        "--epochs", ELASTIC_EPOCHS,
                        "--checkpoint-every", "10", "--output-dir", out])],
            env={**four_hosts.env(), "LAUNCHER": "horovodrun-elastic",
                 "LAUNCHER_ARGS": f"--network-interface {INTERFACE} --blacklist-cooldown-range {COOLDOWN[0]} {COOLDOWN[1]}"})
        # 64 samples a step, 23 steps an epoch: a checkpoint at step 30 is in epoch 2.
        four_node_slurm.wait_for(job, lambda info: checkpoint_file(out, 30).exists() or info.get("JobState") not in (
            "PENDING", "RUNNING", "CONFIGURING"), "at step 30", JOB_TIMEOUT)
        assert checkpoint_file(out, 30).exists(), log.read_text(errors="replace")
        with contextlib.ExitStack() as survivors:
            killed = time.monotonic()
            four_hosts.vanish(lost, "slurmd")
            four_hosts.vanish(lost, CNN.name)
            if shape == TWO_BY_2:
                slow_down(survivors.enter_context(cpu_share(SURVIVORS_SHARE)), str(out), ranks)
            flagged = wait_for_node_state(four_node_slurm, lost, lambda state: state.endswith("*"), 60)
            assert flagged - killed < COOLDOWN[0], f"Slurm flagged {lost} {flagged - killed:.0f} s after its slurmd died"
            discovered = discover_in_job(four_node_slurm, job, tmp_path / "discovery-state", shape)
            info = four_node_slurm.wait_for_end(job, JOB_TIMEOUT)
    finally:
        four_hosts.vanish(lost, CNN.name)
        four_node_slurm.start_slurmd(lost)
        four_node_slurm.reconfigure(SlurmdTimeout=None)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text}"
    assert "launcher horovodrun-elastic" in text and "--host-discovery-script" in text, text
    kept = [f"{host}:{shape.slots}" for host in shape.hosts[:-1]]
    assert discovered.output.splitlines()[-len(kept):] == kept, discovered.describe()
    left_out = re.search(rf"discover_hosts.py: leaving out {lost} \([^)]*\)", text)
    assert left_out, text  # said once in the job's log, by the discovery horovodrun ran
    sizes = [int(n) for n in re.findall(r"(\d+) workers? x batch", text)]
    assert sizes[0] == ranks and len(sizes) > 1 and set(sizes[1:]) == {ranks - shape.slots}, (sizes, text)
    assert json.loads((out / "results.json").read_text())["world_size"] == ranks - shape.slots
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(row["epoch"], row["train_samples"]) for row in rows] == [
        (epoch, DIGITS_TRAIN) for epoch in range(1, ELASTIC_EPOCHS + 1)], rows
    assert "Traceback" not in text and "terminate called" not in text, text
    print(f"elastic under Slurm: {lost} flagged {flagged - killed:.0f} s after it died; world sizes {sizes}; "
          f"{left_out[0]}")


def wait_for_node_state(cluster, node, done, timeout):
    """When sinfo's state of ``node`` satisfies ``done`` (time.monotonic())."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done(cluster.node_state(node)):
            return time.monotonic()
        time.sleep(POLL)
    pytest.fail(f"node {node} still {cluster.node_state(node)!r} after {timeout} s")


def discover_in_job(cluster, job, state, shape):
    """discover_hosts.py --slurm on node1 with the job's allocation, as horovodrun runs it there."""
    env = cluster.env({"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": ",".join(shape.hosts),
                       "SLURM_TASKS_PER_NODE": f"{shape.slots}(x{len(shape.hosts)})",
                       "HVD_DISCOVERY_STATE": str(state)})
    return ok(launch(cluster.on("node1", [sys.executable, DISCOVER, "--slurm"]), timeout=60, env=env))
