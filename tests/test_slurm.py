"""slurm/: the sbatch files on a real one-node Slurm cluster the tests start.

Jobs that do not depend on each other are submitted together and run side by
side (the test node claims 8 CPUs); every wait is bounded.
"""
import json
import os
import re
import shutil
import signal
import socket
import time
from datetime import datetime
from pathlib import Path

import pytest

from support.bert_data import prepare_bert_data
from support.checkpoints import any_checkpoint, checkpoint_file
from support.checks import ok
from support.image_data import make_image_folder
from support.commands import QUICK_CNN, SLOW_RANK_WATCH, SLOW_SHARE
from support.launch import REPO, SCRIPTS, horovodrun, launch
from support.locks import lock_of
from support.needs import require_module, require_program
from support.ranks import cpu_share, rank_pids, require_cpu_cgroup
from support.selected import is_selected, selected_values
from support.slurm_cluster import run
from support.slurm_jobs import (LAUNCHERS, SLURM, assert_requeued_once, ended, events, probe_sbatch,
                                send_usr1_to_batch_shell)
from support.user_task import write_task
from support.weights import assert_same_tensors, checkpoint_at

SBATCH_FILES = [SLURM / "train_cnn.sbatch", SLURM / "pretrain_bert.sbatch", SLURM / "train.sbatch"]
JOB_TIMEOUT = 480  # jobs share 2 cores with the rest of the suite (a CI run saw 0.1 steps/s)


# ---------------------------------------------------------------- the files themselves
@pytest.mark.parametrize("path", SBATCH_FILES, ids=lambda p: p.name)
def test_every_sbatch_line_carries_a_comment(path):
    lines = [line for line in path.read_text().splitlines() if line.startswith("#SBATCH")]
    assert lines, f"{path.name} has no #SBATCH lines"
    for line in lines:
        assert re.match(r"^#SBATCH\s+--[\w-]+(=\S+)?\s+#\s*\S", line), f"no comment: {line!r}"
    options = [line.split()[1].split("=")[0] for line in lines]
    assert options.count("--nodes") == 1
    for needed in ("--signal", "--requeue", "--ntasks-per-node", "--cpus-per-task", "--time"):
        assert needed in options, f"{path.name} lacks {needed}"


def test_slurm_shell_files_parse():
    for path in sorted(SLURM.iterdir()):
        checked = launch(["bash", "-n", path], timeout=10)
        ok(checked)


def test_sbatch_file_outside_slurm_is_one_line_exit_2():
    ran = launch(["bash", SLURM / "train_cnn.sbatch", "--max-steps", "1"], timeout=30,
                 env={"SLURM_JOB_ID": "", "SLURM_JOB_NAME": "", "HVD_REPO": str(REPO)})
    assert ran.returncode == 2, ran.describe()
    assert ran.output.strip().splitlines() == [
        "train_cnn.sbatch: error: not inside a Slurm job: submit this file with sbatch"]


@pytest.mark.parametrize("args, fragment", [
    (["--phase2-data", "x", "--output-dir", "y"], "--phase1-data is required"),
    (["--phase1-data", "/nonexistent", "--phase2-data", "/nonexistent", "--output-dir", "y"],
     "/nonexistent has no metadata.json"),
    (["--steps", "3"], "unknown argument '--steps'"),
])
def test_submit_bert_phases_usage_errors(args, fragment):
    ran = launch([SLURM / "submit_bert_phases.sh", *args], timeout=30)
    assert ran.returncode == 2, ran.describe()
    lines = ran.output.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], ran.describe()


# ---------------------------------------------------------------- helpers
def submit(cluster, sbatch_file, output, args, launcher="srun", extra=(), env=None):
    """sbatch with our own log file; the job's environment is the test's plus LAUNCHER and ``env``."""
    return cluster.sbatch(["--output", output, *extra, sbatch_file, *map(str, args)],
                          env={"LAUNCHER": launcher, **(env or {})})


def wait_for_text(path, text, timeout, cluster, job):
    """Poll a job's log until ``text`` appears (the job must still be alive)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        info = cluster.job(job)
        if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job {job} ended before {text!r}: {info}\n{cluster.job_output(info)}")
        time.sleep(0.5)
    pytest.fail(f"job {job}: no {text!r} after {timeout} s\n{path.read_text() if path.exists() else ''}")


def slurm_time(value):
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S")


# ---------------------------------------------------------------- jobs on the cluster
@pytest.mark.scale  # the seams' proof is test_adapting.py's (horovodrun, mpirun); this is its sbatch form
def test_their_model_and_data_train_under_sbatch(slurm_cluster, need_horovod, tmp_path):
    """train_cnn.sbatch with a model and a data set the project has never seen (support/user_task.py:
    a Hugging Face ViT on dict samples), stopped by --stop-after, then resumed by a second job to the
    end: the seams under srun."""
    log, out = tmp_path / "job.out", tmp_path / "out"
    args = [*write_task(tmp_path, hugging_face=True), "--precision", "fp32", "--epochs", "2", "--batch-size", "8",
            "--output-dir", out]
    job = submit(slurm_cluster, SLURM / "train_cnn.sbatch", log, [*args, "--stop-after", "7"])
    info = slurm_cluster.wait_for_end(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED" and "stopped by --stop-after 7" in log.read_text(), f"{info}\n{log.read_text()}"
    log = tmp_path / "resumed.out"
    job = submit(slurm_cluster, SLURM / "train_cnn.sbatch", log, args)
    info = slurm_cluster.wait_for_end(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log.read_text()}"
    assert "resuming at epoch 1 sample 16 (step 7)" in log.read_text(), log.read_text()
    assert json.loads((out / "results.json").read_text())["steps"] == 12


# docs/adapting.md's form for a trainer copied out of the repository, submitted from its folder.
COPIED_TRAINER = ("HVD_REPO=~/hvd-training-scripts sbatch ~/hvd-training-scripts/slurm/train.sbatch my_trainer.py "
                  "--output-dir runs/mine")


def test_a_trainer_outside_the_repository_is_submitted_with_sbatch(slurm_cluster, need_horovod, tmp_path):
    """docs/adapting.md's copied trainer: scripts/train_signals.py copied to a folder of its own and
    submitted from there by its relative path with slurm/train.sbatch (hvd_run put the repository
    before every script)."""
    assert COPIED_TRAINER in (REPO / "docs" / "adapting.md").read_text(), "docs/adapting.md no longer shows it"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(SCRIPTS / "train_signals.py", elsewhere / "my_trainer.py")
    log = tmp_path / "job.out"
    job = slurm_cluster.sbatch(["--output", log, REPO / "slurm" / "train.sbatch", "my_trainer.py", "--samples", "128",
                                "--length", "32", "--epochs", "1", "--batch-size", "16", "--output-dir", "runs/mine"],
                               env={"LAUNCHER": "srun", "HVD_REPO": str(REPO)}, cwd=elsewhere)
    info = slurm_cluster.wait_for_end(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log.read_text()}"
    assert f"python {elsewhere / 'my_trainer.py'} --samples" in log.read_text(), log.read_text()
    assert ", 2 ranks," in log.read_text(), log.read_text()
    assert json.loads((elsewhere / "runs" / "mine" / "results.json").read_text())["completed"], log.read_text()


@pytest.mark.parametrize("setting, line", [
    ({"LAUNCHER": "ssh"}, "LAUNCHER=ssh: choose srun, mpirun, horovodrun or horovodrun-elastic"),
    ({"MIN_NODES": "0"}, "MIN_NODES=0: give the fewest nodes a requeued run may start on, a number from 1"),
], ids=["LAUNCHER", "MIN_NODES"])
def test_a_bad_setting_fails_the_job_with_one_line(slurm_cluster, tmp_path, setting, line):
    log = tmp_path / "job.out"
    job = submit(slurm_cluster, SLURM / "train_cnn.sbatch", log, ["--max-steps", "1"], env=setting)
    info = slurm_cluster.wait_for_end(job, 60)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    assert log.read_text().strip().splitlines() == [f"train-cnn: error: {line}"]


# On two nodes in `make test` (test_slurm_two_nodes.py's probes): there the rank on the batch
# shell's node gets USR1 itself under every launcher, as both ranks do here.
@pytest.mark.scale
def test_usr1_reaches_every_rank_then_requeue_and_resume_with_every_launcher(
        slurm_cluster, need_horovod, need_mpi, tmp_path):
    """The batch shell's trap forwards USR1 to each rank through srun, mpirun and horovodrun."""
    sbatch_file, total = probe_sbatch(tmp_path), 25
    jobs = {}
    for launcher in LAUNCHERS:
        out = tmp_path / launcher
        jobs[launcher] = submit(slurm_cluster, sbatch_file, tmp_path / f"{launcher}.out",
                                [out, total, 0.3], launcher=launcher)
    for launcher, job in jobs.items():
        out = tmp_path / launcher
        deadline = time.monotonic() + JOB_TIMEOUT
        while not (events(out, 0) and events(out, 1)) and time.monotonic() < deadline:
            assert slurm_cluster.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING")
            time.sleep(0.5)
        send_usr1_to_batch_shell(slurm_cluster, job)

    for launcher, job in jobs.items():
        info = slurm_cluster.wait_for_end(job, JOB_TIMEOUT)
        log = (tmp_path / f"{launcher}.out").read_text()
        assert_requeued_once(slurm_cluster, job, info, log)
        assert f"launcher {launcher}" in log
        for rank in (0, 1):
            seen = [(e["event"], e["restart"]) for e in events(tmp_path / launcher, rank)]
            assert seen == [("start", 0), ("stop", 0), ("start", 1), ("done", 1)], (launcher, rank, seen)
            start, stop, resumed, done = events(tmp_path / launcher, rank)
            # This rank was signalled itself (not only told by the others), stopped
            # early, and the requeued run went on from the checkpointed step.
            assert stop["signal"] == "SIGUSR1", (launcher, rank, stop)
            assert 0 < stop["step"] < total, (launcher, rank, stop)
            assert resumed["step"] == stop["step"] and done["step"] == total
            assert start["size"] == resumed["size"] == 2


# Image folder runs with DataLoader workers, stopped mid-run: 15 steps per epoch. Every step
# votes on a stop (--stop-check-every 1): a signal held ranks get at step 5 or at step 35 stops
# them at their next step, never losing the race to --max-steps (its check comes first at 40).
IMAGE_RUN = ["--dataset", "imagefolder", "--model", "convnet", "--image-size", "16", "--batch-size", "2",
             "--workers", "2", "--epochs", "20", "--checkpoint-every", "5", "--keep-checkpoints", "1",
             "--stop-check-every", "1"]
IMAGE_STEPS = 40
HOLD_SECONDS = 20  # the longest a job's ranks wait stopped for their signal, far below the watchdog's 60 s


def signal_at_first_checkpoint(cluster, jobs, signals, root):
    """Send each job in ``signals`` ({name: USR1 or TERM}) its signal at its first periodic
    checkpoint (its DataLoader workers deliver batches), its two ranks held meanwhile (SIGSTOP),
    so that the signal lands mid-run: a 40-step run takes about 3 s, less than a poll and a
    scancel may. Nothing in the loop waits: while one job's ranks wait for their signal, the next
    job's first checkpoint is still seen within a poll (a CI run whose loop waited on each job in
    turn held a job at its step 30 and lost the signal to --max-steps)."""
    waiting, held = dict(signals), {}
    deadline, next_check = time.monotonic() + JOB_TIMEOUT, time.monotonic()
    while waiting or held:
        for name in [name for name in waiting if any_checkpoint(root / name)]:
            # "DIR " with its space: job "horovodrun"'s marker must not match "horovodrun-term"'s ranks
            pids = sorted({pid for rank in (0, 1) for pid in rank_pids(f"{root / name} ", rank)})
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            assert len(pids) == 2, f"{name}: rank processes {pids}"
            held[name] = HeldJob(cluster, jobs[name], pids, waiting.pop(name))
        for name in [name for name, job in held.items() if job.signalled()]:
            held.pop(name).resume()
        if time.monotonic() >= next_check:  # scontrol costs a process: not at every poll
            next_check = time.monotonic() + 1
            for name in waiting:
                info = cluster.job(jobs[name])
                if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING") or time.monotonic() > deadline:
                    pytest.fail(f"job {jobs[name]}: no checkpoint in {root / name}: {info}\n{cluster.job_output(info)}")
        time.sleep(0.05)


class HeldJob:
    """A job whose ranks are stopped: ``scancel --signal=NAME --batch`` at once; ``signalled()``
    once the signal is pending in each rank (it reaches them through the launcher) or after
    HOLD_SECONDS; ``resume()`` sends them SIGCONT."""

    def __init__(self, cluster, job, pids, name):
        self.pids, self.bit = pids, 1 << (signal.Signals[f"SIG{name}"] - 1)
        self.until = time.monotonic() + HOLD_SECONDS
        run(["scancel", f"--signal={name}", "--batch", job], env=cluster.env())

    def signalled(self):
        return time.monotonic() > self.until or all(pending_signals(pid) & self.bit for pid in self.pids)

    def resume(self):
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)


def pending_signals(pid):
    """The signals pending for process ``pid`` (a bit mask; 0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(re.search(r"^ShdPnd:\s*(\w+)", status, re.MULTILINE).group(1), 16) | \
        int(re.search(r"^SigPnd:\s*(\w+)", status, re.MULTILINE).group(1), 16)


IMAGES = "images"


@pytest.fixture(scope="module")
def image_jobs(request, slurm_cluster, tmp_path_factory):
    """train_cnn.sbatch on an image folder with DataLoader workers, jobs side by side on the
    image folder IMAGES beside their output: "uninterrupted" under srun, straight through; one
    under each selected LAUNCHER that gets USR1 once its workers deliver batches (its first
    checkpoint); "horovodrun-term", whose batch shell gets TERM. Returns {name: Ended}."""
    require_module("horovod.torch")
    require_program("mpirun", "install Open MPI or `make setup` as root")
    root = tmp_path_factory.mktemp("image-jobs")
    data = make_image_folder(root / IMAGES, train_per_class=20)
    usr1 = selected_values(request, "test_usr1_requeues_and_resumes_bit_identical_to_an_uninterrupted_job", "launcher")
    signalled = {launcher: (launcher, "USR1") for launcher in usr1}
    if is_selected(request, "test_term_to_a_horovodrun_batch_shell_reaches_the_ranks_and_resumes"):
        signalled["horovodrun-term"] = ("horovodrun", "TERM")
    runs = {"uninterrupted": "srun", **{name: launcher for name, (launcher, _) in signalled.items()}}
    jobs = {name: submit(slurm_cluster, SLURM / "train_cnn.sbatch", root / f"{name}.out",
                         ["--data", data, "--output-dir", root / name, *IMAGE_RUN, "--max-steps", IMAGE_STEPS],
                         launcher=launcher)
            for name, launcher in runs.items()}
    signal_at_first_checkpoint(slurm_cluster, jobs, {name: sig for name, (_, sig) in signalled.items()}, root)
    return {name: ended(slurm_cluster, job, root / f"{name}.out", root / name, JOB_TIMEOUT)
            for name, job in jobs.items()}


# mpirun's form in `make test-scale`: its USR1 reaches a rank beside its DataLoader workers in
# test_train_cnn.py (no Slurm) and every rank under Slurm in the probes (test_slurm_two_nodes.py).
@pytest.mark.parametrize("launcher", [pytest.param(launcher, marks=pytest.mark.scale) if launcher == "mpirun"
                                      else launcher for launcher in LAUNCHERS])
def test_usr1_requeues_and_resumes_bit_identical_to_an_uninterrupted_job(image_jobs, launcher):
    """Slurm and the launchers signal a rank's whole process tree: DataLoader workers leave USR1
    to their rank, which checkpoints and stops; the job is requeued, resumes there and ends with
    the model and optimizer of the job that ran straight through, bit for bit."""
    straight = image_jobs["uninterrupted"]
    assert straight.info["JobState"] == "COMPLETED" and straight.info.get("Restarts") == "0", straight
    info, log, out = image_jobs[launcher]
    assert_requeued_once(None, info.get("JobId"), info, log)
    assert f"launcher {launcher}" in log and re.search(r"stopped by SIGUSR1 \(rank \d\) at step \d+", log), log
    assert "Traceback" not in log and "exited unexpectedly" not in log, log
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == IMAGE_STEPS and results["world_size"] == 2, results
    final, baseline = checkpoint_at(out, IMAGE_STEPS), checkpoint_at(straight.out, IMAGE_STEPS)
    assert_same_tensors(final["model"], baseline["model"], f"{launcher} model")
    assert_same_tensors(final["optimizer"], baseline["optimizer"], f"{launcher} optimizer")


def test_term_to_a_horovodrun_batch_shell_reaches_the_ranks_and_resumes(image_jobs):
    """horovodrun does not forward SIGTERM: the batch shell signals the ranks itself;
    they checkpoint and exit 0, the job ends without a requeue, a relaunch resumes."""
    info, log, out = image_jobs["horovodrun-term"]
    data = out.parent / IMAGES
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "0", f"{info}\n{log}"
    stopped = re.search(r"stopped by SIGTERM \(rank \d\) at step (\d+)", log)
    assert stopped and "Traceback" not in log, log
    step = int(stopped.group(1))
    assert checkpoint_at(out, step)["train_state"]["step"] == step < IMAGE_STEPS
    resumed = horovodrun(2, [SCRIPTS / "train_cnn.py", "--data", data, "--output-dir", out, *IMAGE_RUN,
                             "--max-steps", step + 2], timeout=JOB_TIMEOUT)
    ok(resumed)
    assert f"(step {step})" in resumed.output, resumed.describe()
    assert json.loads((out / "results.json").read_text())["steps"] == step + 2


def test_bert_phase1_then_phase2_in_order(slurm_cluster, need_horovod, tmp_path):
    # One data set for both phases keeps the test short; the chain is what is tested.
    prepare_bert_data(tmp_path / "data", 32)
    submitted = launch([SLURM / "submit_bert_phases.sh", "--phase1-data", tmp_path / "data",
                        "--phase2-data", tmp_path / "data", "--output-dir", tmp_path / "bert",
                        "--phase1", "--steps 4", "--phase2", "--steps 3",
                        "--sbatch", f"--output={tmp_path}/%x-%j.out",
                        "--", "--model", "tiny", "--batch-size", "8", "--checkpoint-every", "0"],
                       timeout=60, env={"SLURM_CONF": str(slurm_cluster.conf)})
    ok(submitted)
    phase1, phase2 = re.findall(r"phase \d: job (\d+)", submitted.output)

    waiting = slurm_cluster.job(phase2)
    assert f"afterok:{phase1}" in waiting.get("Dependency", ""), waiting
    assert waiting["JobState"] == "PENDING", waiting

    first = slurm_cluster.wait_for_end(phase1, JOB_TIMEOUT)
    second = slurm_cluster.wait_for_end(phase2, JOB_TIMEOUT)
    log2 = Path(second["StdOut"]).read_text()
    assert first["JobState"] == "COMPLETED", f"{first}\n{Path(first['StdOut']).read_text()}"
    assert second["JobState"] == "COMPLETED", f"{second}\n{log2}"
    assert slurm_time(second["StartTime"]) >= slurm_time(first["EndTime"])
    assert f"--init-checkpoint {tmp_path}/bert/phase1" in log2
    results1 = json.loads((tmp_path / "bert" / "phase1" / "results.json").read_text())
    results2 = json.loads((tmp_path / "bert" / "phase2" / "results.json").read_text())
    assert results1["steps"] == 4 and results2["steps"] == 3, (results1, results2)


def test_bert_phase2_is_cancelled_when_phase1_fails(slurm_cluster, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "metadata.json").write_text("{}")  # passes the submit check, fails in the job
    submitted = launch([SLURM / "submit_bert_phases.sh", "--phase1-data", data, "--phase2-data", data,
                        "--output-dir", tmp_path / "bert", "--sbatch", f"--output={tmp_path}/%x-%j.out",
                        "--", "--no-such-option"],
                       timeout=60, env={"SLURM_CONF": str(slurm_cluster.conf)})
    ok(submitted)
    phase1, phase2 = re.findall(r"phase \d: job (\d+)", submitted.output)
    first = slurm_cluster.wait_for_end(phase1, JOB_TIMEOUT)
    assert first["JobState"] == "FAILED", first
    second = slurm_cluster.wait_for_end(phase2, 60)
    # Never started: no output file, no start time. (A pending job that Slurm cancels reads
    # RunTime 00:00:00, or, seen once in CI, StartTime Unknown and a RunTime counted from 1970.)
    assert second["JobState"] == "CANCELLED" and not list(tmp_path.glob(f"*-{phase2}.out")), second
    assert second.get("RunTime") == "00:00:00" or second.get("StartTime") in ("Unknown", "None"), second


# ---------------------------------------------------------------- the output directory's lock
def test_output_dir_lock_across_jobs_and_requeues(slurm_cluster, need_horovod, tmp_path):
    """A lock held by another running job (on another node) stops a job with exit 2; once
    squeue says that job ended, its lock is taken over; a requeued job (its earlier run's
    lock, from a node that died) takes over its own lock."""
    args = ["--model", "convnet", "--image-size", "8", "--batch-size", "16", "--epochs", "1", "--stop-after", "2"]
    out = tmp_path / "out"
    out.mkdir()
    holder = slurm_cluster.sbatch(["--output", tmp_path / "holder.out", "--wrap", "sleep 300"])
    slurm_cluster.wait_for_state(holder, "RUNNING", 60)
    (out / "run.lock").write_text(lock_of(4242, host="node-elsewhere", slurm_job_id=holder))
    log = tmp_path / "refused.out"
    job = submit(slurm_cluster, SLURM / "train_cnn.sbatch", log, ["--output-dir", out, *args])
    info = slurm_cluster.wait_for_end(job, JOB_TIMEOUT)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{log.read_text()}"
    assert (f"{out} is in use by another run (pid 4242 on node-elsewhere, Slurm job {holder}, started "
            in log.read_text()), log.read_text()

    run(["scancel", holder], env=slurm_cluster.env())
    slurm_cluster.wait_for_end(holder, 60)
    log = tmp_path / "taken.out"
    job = submit(slurm_cluster, SLURM / "train_cnn.sbatch", log, ["--output-dir", out, *args])
    info = slurm_cluster.wait_for_end(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log.read_text()}"
    assert (f"taking over the lock on {out} from pid 4242 on node-elsewhere, Slurm job {holder}"
            in log.read_text()), log.read_text()
    assert "squeue reports that job CANCELLED" in log.read_text(), log.read_text()
    assert not (out / "run.lock").exists()

    requeued = tmp_path / "requeued"
    requeued.mkdir()
    log = tmp_path / "requeued.out"
    job = submit(slurm_cluster, SLURM / "train_cnn.sbatch", log, ["--output-dir", requeued, *args],
                 extra=["--hold"])
    (requeued / "run.lock").write_text(lock_of(4242, host="node-that-died", slurm_job_id=job))
    run(["scontrol", "release", job], env=slurm_cluster.env())
    info = slurm_cluster.wait_for_end(job, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log.read_text()}"
    assert "it was an earlier run of this Slurm job (requeued)" in log.read_text(), log.read_text()
    assert checkpoint_file(requeued, 2).is_file() and not (requeued / "run.lock").exists()


def slow_scontrol_update(tmp_path, delay=3):
    """A PATH whose `scontrol update` answers ``delay`` s late, like a busy controller's:
    the requeue's update must outlive the SIGTERM that `requeuehold` sends the batch
    script (a CI run failed when it did not: the job stayed held, no node excluded)."""
    real = shutil.which("scontrol")
    shim = tmp_path / "slow-scontrol"
    shim.mkdir()
    (shim / "scontrol").write_text(f'#!/bin/bash\n[ "$1" = update ] && sleep {delay}\nexec {real} "$@"\n')
    (shim / "scontrol").chmod(0o755)
    return f"{shim}:{os.environ['PATH']}"


def test_a_straggler_requeues_the_job_without_its_node(slurm_cluster, need_horovod, tmp_path):
    """--straggler-action checkpoint-exit under sbatch: the ranks exit 5 naming the slow rank's node,
    and the job goes back to the queue with that node excluded (here the only node: it stays pending)."""
    require_cpu_cgroup()
    out, log = tmp_path / "run", tmp_path / "job.out"
    args = [*QUICK_CNN, "--threads", "1", "--epochs", "3", "--output-dir", out, *SLOW_RANK_WATCH,
            "--straggler-action", "checkpoint-exit"]
    with cpu_share(SLOW_SHARE) as share:
        job = slurm_cluster.sbatch(["--output", log, SLURM / "train_cnn.sbatch", *map(str, args)],
                                   env={"LAUNCHER": "srun", "PATH": slow_scontrol_update(tmp_path)})
        deadline = time.monotonic() + JOB_TIMEOUT
        while not ((out / "run.lock").exists() and rank_pids(str(out), rank=1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in rank_pids(str(out), rank=1):
            share.add(pid)
        node = slurm_cluster.nodes[0][0]
        info = slurm_cluster.wait_for(job, lambda i: node in i.get("ExcNodeList", "") and i.get("JobState") == "PENDING",
                                      "requeued without its node", JOB_TIMEOUT)
    slurm_cluster.run(["scancel", job], check=False)
    text = log.read_text()
    assert f"rank 1 on {socket.gethostname()} is the straggler" in text, text
    assert f"requeueing job {job} without node {node} (a straggler)" in text, text
    assert info["JobState"] == "PENDING" and info.get("Restarts") == "1", info
    assert 0 < json.loads((out / "results.json").read_text())["steps"], text
