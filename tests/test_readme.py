"""The README's single-machine commands, run as written.

Each command below is quoted from README.md (the test first checks that the
README still holds it, continuation lines joined), then run by bash in a
scratch directory where `scripts/`, `hostfiles/` and `tests/` point into the
repository and `.venv` to the environment running the tests, so the commands'
`runs/` and `data/` land in the scratch directory.
Only flags the README documents for a quick try are appended (`--epochs 1`,
`--steps N`, `--dupe-factor 1`, `--stop-after N`); appended flags override the
command's own. Open MPI's oversubscription stays off, as on a user's machine.
A README command that stops working, or an option it names that disappears,
fails here.
"""
import json
import re

import pytest

from support.image_data import make_cifar10
from support.launch import RANK_TRACEBACK, REPO, VENV_BIN, launch

pytestmark = pytest.mark.usefixtures("need_horovod", "need_mpi")

# Joined continuation lines: a command spread over several README lines reads as one.
README = re.sub(r" *\\\n\s*", " ", (REPO / "README.md").read_text())
AS_A_USER = {"OMPI_MCA_rmaps_base_oversubscribe": "0", "HVDTRAIN_PROGRESS_SECONDS": "0.05"}
# A rank tag anywhere but at the start of a line: a line's text and its newline written separately.
GLUED_TAG = re.compile(r"(?<=.)\[\d+(?:,\d+)?\]<std(?:out|err)>:")
PROGRESS = re.compile(r"progress: step (\d+)/(\d+) \(\d+%\), [\d.e+-]+ steps/s, about (\d+ s|\d+ min \d+ s) left")


@pytest.fixture
def workdir(tmp_path):
    for name in ("scripts", "hostfiles", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(VENV_BIN.parent)  # the environment running these tests
    return tmp_path


def readme(command):
    assert command in README, f"README.md no longer holds this command: {command}"
    return command


def run(workdir, command, quick="", timeout=240, env=None, replace=None):
    """``command`` (from the README) plus ``quick`` flags, in bash, in ``workdir``."""
    line = readme(command)
    for old, new in (replace or {}).items():
        line = line.replace(old, new)
    return launch(["bash", "-c", f"{line} {quick}"], timeout, env={**AS_A_USER, **(env or {})}, cwd=workdir)


def ok(ran):
    assert ran.returncode == 0 and not ran.timed_out, ran.describe()
    glued = [line for line in ran.output.splitlines() if GLUED_TAG.search(line)]
    assert not glued, f"rank tags inside lines: {glued[:3]}\n{ran.describe()}"
    return ran


def results(directory):
    return json.loads((directory / "results.json").read_text())


# ---------------------------------------------------------------- Launching: one machine
ONE_MACHINE = {
    "horovodrun": "horovodrun -np 2 python scripts/train_cnn.py --output-dir runs/cnn-horovodrun",
    "horovodrun hostfile": "horovodrun -np 2 --hostfile hostfiles/localhost-horovodrun python scripts/train_cnn.py "
                           "--output-dir runs/cnn-hostfile",
    "mpirun hostfile": "mpirun -np 2 -hostfile hostfiles/localhost --bind-to none python scripts/train_cnn.py "
                       "--output-dir runs/cnn-mpirun",
}


@pytest.mark.parametrize("form", ONE_MACHINE)
def test_one_machine_forms_train_and_report_progress(workdir, form):
    command = ONE_MACHINE[form]
    ran = ok(run(workdir, command, "--epochs 1"))
    summary = results(workdir / command.split("--output-dir ")[1])
    assert summary["world_size"] == 2 and summary["epochs"] == 1 and summary["steps"] == 44, summary
    # No terminal under a launcher: periodic progress lines (every 0.05 s here) instead of a bar.
    steps = [(int(m[1]), int(m[2])) for m in PROGRESS.finditer(ran.output)]
    assert steps and all(total == 44 and 0 < step <= 44 for step, total in steps), ran.describe()
    assert "images/s; results in runs/" in ran.output, ran.describe()


# ---------------------------------------------------------------- the CNN examples
CNN = "horovodrun -np 2 python scripts/train_cnn.py --output-dir runs/cnn"
CIFAR = ("mpirun -np 2 -hostfile hostfiles/localhost python scripts/train_cnn.py --dataset cifar10 "
         "--data /data/cifar-10-batches-py --model resnet56 --epochs 160 --batch-size 32 --lr 0.025 "
         "--output-dir runs/cifar10")
DEMO = "horovodrun -np 2 .venv/bin/python scripts/train_cnn.py --output-dir runs/demo-cnn --no-resume"
NP4 = "mpirun -np 4 --oversubscribe -hostfile hostfiles/localhost python scripts/train_cnn.py --output-dir runs/cnn-np4"


def test_cnn_example_then_its_relaunch_changes_nothing(workdir):
    ok(run(workdir, CNN, "--epochs 1"))
    out = workdir / "runs" / "cnn"
    before = {name: (out / name).read_bytes() for name in ("results.json", "metrics.jsonl")}
    again = ok(run(workdir, CNN, "--epochs 1"))
    assert "holds a finished run" in again.output and "runs/cnn/results.json" in again.output, again.describe()
    assert before == {name: (out / name).read_bytes() for name in before}


def test_cifar10_example_on_the_2_slot_hostfile(workdir):
    """The README's data path is swapped for a small file in CIFAR-10's layout."""
    data = make_cifar10(workdir / "cifar")
    ok(run(workdir, CIFAR, "--epochs 1", replace={"/data/cifar-10-batches-py": str(data)}))
    summary = results(workdir / "runs" / "cifar10")
    assert summary["dataset"] == "cifar10" and summary["model"] == "resnet56" and summary["world_size"] == 2


def test_make_demo_stopped_prints_a_command_that_resumes(workdir):
    """`make demo` has --no-resume: "relaunch the same command" would start over."""
    demo_line = re.search(r"^demo:.*\n\t(.*)$", (REPO / "Makefile").read_text(), re.M)[1]
    for variable, value in (("$(VENV)/bin/", ""), ("$(NP)", "2"), ("$(PY)", ".venv/bin/python")):
        demo_line = demo_line.replace(variable, value)
    assert demo_line == DEMO  # the README's "make demo # = ..." is what make runs
    stopped = ok(run(workdir, DEMO, "--epochs 1 --stop-after 3"))
    said = re.search(r"stopped by --stop-after 3 at step 3: .*relaunch with the same launcher: (.*)$",
                     stopped.rank_output(0), re.M)
    assert said, stopped.describe()
    again = said[1]
    assert "--no-resume" not in again and "--stop-after" not in again, again
    resumed = ok(launch(["bash", "-c", f"horovodrun -np 2 {again}"], 240, env=AS_A_USER, cwd=workdir))
    assert "restored step 3" in resumed.output, resumed.describe()
    assert results(workdir / "runs" / "demo-cnn")["completed"] is True


# ---------------------------------------------------------------- the BERT examples
PREPARE = "python scripts/prepare_bert_data.py --output-dir data/bert128"
PREPARE_512 = ("python scripts/prepare_bert_data.py --vocab data/bert128/tokenizer --max-seq-length 512 "
               "--bin-size 64 --output-dir data/bert512")
PHASE1 = "horovodrun -np 2 python scripts/pretrain_bert.py --data data/bert128 --model tiny --output-dir runs/bert"
PHASE2 = ("horovodrun -np 2 python scripts/pretrain_bert.py --data data/bert512 --init-checkpoint runs/bert "
          "--max-seq-length 512 --output-dir runs/bert-phase2")


def test_bert_examples_in_order_and_their_relaunches(workdir):
    ok(run(workdir, PREPARE, "--dupe-factor 1", timeout=180))
    ok(run(workdir, PREPARE_512, "--dupe-factor 1", timeout=180))
    for command, out, steps in ((PHASE1, "runs/bert", 20), (PHASE2, "runs/bert-phase2", 4)):
        ran = ok(run(workdir, command, f"--steps {steps} --log-every 2", timeout=300))
        summary = results(workdir / out)
        assert summary["completed"] and summary["steps"] == steps and summary["world_size"] == 2, summary
        assert (workdir / out / "model" / "config.json").is_file()
        assert f"finished at step {steps}: " in ran.output, ran.describe()
        assert "Writing model shards" not in ran.output, ran.describe()  # no Transformers progress bar
        # A plain relaunch of the finished run: says so, rewrites nothing (results.json included).
        before = (workdir / out / "results.json").read_bytes()
        again = ok(run(workdir, command, f"--steps {steps} --log-every 2", timeout=300))
        assert "holds a finished run" in again.output, again.describe()
        assert (workdir / out / "results.json").read_bytes() == before


# ---------------------------------------------------------------- make_hostfile.py and elastic
HOSTFILE_FORMS = [
    # README command, environment (the allocation), expected stdout (or the -o file's text)
    ("python scripts/make_hostfile.py --slurm -o hosts.txt",
     {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)"}, "node1 slots=4\nnode2 slots=4\n"),
    ("python scripts/make_hostfile.py --pbs --format mpich", {"PBS_NODEFILE": "nodes"}, "cn1:2\ncn2:1\n"),
    ("python scripts/make_hostfile.py --lsf --format H", {"LSB_MCPU_HOSTS": "cn1 4 cn2 4"}, "cn1:4,cn2:4\n"),
    ("python scripts/make_hostfile.py --hosts 'gpu-a[1,3-5],gpu-b7' --slots 4 --format horovodrun", {},
     "gpu-a1 slots=4\ngpu-a3 slots=4\ngpu-a4 slots=4\ngpu-a5 slots=4\ngpu-b7 slots=4\n"),
    ("python scripts/make_hostfile.py --hostfile hostfiles/openmpi --format H -np 8", {}, "node1:4,node2:4\n"),
]


@pytest.mark.parametrize("command, env, expected", HOSTFILE_FORMS, ids=[c[0].split()[2] for c in HOSTFILE_FORMS])
def test_make_hostfile_forms(workdir, command, env, expected):
    (workdir / "nodes").write_text("cn1\ncn1\ncn2\n")
    ran = run(workdir, command, env=env, timeout=60)
    assert ran.returncode == 0, ran.describe()
    written = workdir / "hosts.txt"
    assert (written.read_text() if "-o hosts.txt" in command else ran.output) == expected, ran.describe()


def test_elastic_example(workdir):
    ran = ok(run(workdir, 'horovodrun -np 2 --min-np 1 --max-np 4 --network-interface lo --host-discovery-script '
                          '"python scripts/discover_hosts.py hostfiles/elastic" '
                          'python tests/workers/elastic_grow.py runs/elastic 2', timeout=180))
    assert "2 2" in (workdir / "runs" / "elastic" / "sizes-rank1.txt").read_text().split("\n"), ran.describe()


def test_elastic_cnn_example(workdir):
    ran = ok(run(workdir, 'horovodrun -np 2 --min-np 1 --max-np 4 --network-interface lo --host-discovery-script '
                          '"python scripts/discover_hosts.py hostfiles/elastic" '
                          'python scripts/train_cnn.py --elastic --output-dir runs/cnn-elastic', "--epochs 1",
                 timeout=180))
    row = json.loads((workdir / "runs" / "cnn-elastic" / "metrics.jsonl").read_text())
    assert row["world_size"] == 2 and row["train_samples"] == 1438, (row, ran.describe())


# ---------------------------------------------------------------- Troubleshooting
def one_error_line(ran, script):
    """The one error line; no rank printed a traceback (a launcher's own report may)."""
    lines = [line for line in ran.output.splitlines() if f"{script}: error:" in line]
    assert len(lines) == 1 and not RANK_TRACEBACK.search(ran.output), ran.describe()
    return lines[0]


def test_not_enough_slots_named_by_make_hostfile_and_oversubscribe_runs(workdir):
    check = run(workdir, "python scripts/make_hostfile.py --hostfile hostfiles/localhost -np 4", timeout=60)
    assert check.returncode == 2, check.describe()
    assert "line 3: localhost 2 slots" in one_error_line(check, "make_hostfile.py")
    refused = run(workdir, NP4, replace={"--oversubscribe ": ""}, timeout=60)
    assert refused.returncode != 0 and "not enough slots" in refused.output, refused.describe()
    ok(run(workdir, NP4, "--epochs 1 --stop-after 3", timeout=240))
    assert results(workdir / "runs" / "cnn-np4")["world_size"] == 4


def test_horovodrun_hostfile_check_and_conversion(workdir):
    check = run(workdir, "python scripts/make_hostfile.py --hostfile FILE --input-format horovodrun",
                replace={"FILE": "hostfiles/localhost"}, timeout=60)
    assert check.returncode == 2 and "line 1: horovodrun --hostfile cannot read comments" in check.output
    readme("or convert it with `--hostfile FILE --format horovodrun`")
    converted = run(workdir, "python scripts/make_hostfile.py --hostfile FILE --input-format horovodrun",
                    replace={"FILE": "hostfiles/localhost", "--input-format": "--format"}, timeout=60)
    assert converted.returncode == 0 and converted.output == "localhost slots=2\n", converted.describe()


@pytest.mark.parametrize("command, status, report", [
    ("horovodrun -np 2 python scripts/train_cnn.py --batch-size 0", 2, "Primary job  terminated normally"),
    ("horovodrun --gloo -np 2 python scripts/train_cnn.py --batch-size 0", 1, "Exit code: 2"),
], ids=["through mpirun", "gloo"])
def test_exit_status_of_bad_input_as_documented(workdir, command, status, report):
    ran = run(workdir, command, timeout=120)
    assert ran.returncode == status and report in ran.output, ran.describe()
    assert "must be at least 1, got 0" in one_error_line(ran, "train_cnn.py")
    assert f"`{command}` (exit {status})" in README


def test_commands_run_one_after_another_have_distinct_output_dirs():
    """A second command into the first one's directory would only find a finished run."""
    commands = [*ONE_MACHINE.values(), CNN, CIFAR, DEMO, NP4, PHASE1, PHASE2]
    dirs = [readme(command).split("--output-dir ")[1].split()[0] for command in commands]
    assert len(set(dirs)) == len(dirs), dirs
