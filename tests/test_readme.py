"""The single-machine commands of the README and of docs/, run as written.

Each command below is quoted from README.md or a docs/ page (the test first
checks that each page it names still holds it, continuation lines joined; a
command the README shows and a docs page repeats is checked in both), then run by bash in a
scratch directory where `scripts/`, `hostfiles/` and `tests/` point into the
repository and `.venv` to the environment running the tests, so the commands'
`runs/` and `data/` land in the scratch directory.
Only flags the README documents for a quick try are appended (`--epochs 1`,
`--steps N`, `--dupe-factor 1`, `--stop-after N`); appended flags override the
command's own. Open MPI's oversubscription stays off, as on a user's machine.
A README or docs command that stops working, or an option it names that
disappears, fails here. So does a relative link or anchor that leads nowhere, a
repository path that no longer exists, or development history in a user page.
"""
import json
import re

import pytest

from support.checks import ok, one_error_line
from support.image_data import make_cifar10
from support.launch import REPO, VENV_BIN, launch

pytestmark = pytest.mark.usefixtures("need_horovod", "need_mpi")

# The user pages: the README and everything under docs/.
PAGE_NAMES = ["README.md", *sorted(str(path.relative_to(REPO)) for path in (REPO / "docs").rglob("*.md"))]
# Joined continuation lines: a command spread over several lines of a page reads as one.
PAGES = {name: re.sub(r" *\\\n\s*", " ", (REPO / name).read_text()) for name in PAGE_NAMES}
README = PAGES["README.md"]
AS_A_USER = {"OMPI_MCA_rmaps_base_oversubscribe": "0", "HVDTRAIN_PROGRESS_SECONDS": "0.05"}
# A rank tag anywhere but at the start of a line: a line's text and its newline written separately.
GLUED_TAG = re.compile(r"(?<=.)\[\d+(?:,\d+)?\]<std(?:out|err)>:")
PROGRESS = re.compile(r"progress: step (\d+)/(\d+) \(\d+%\), [\d.e+-]+ steps/s, about (\d+ s|\d+ min \d+ s) left")


@pytest.fixture
def workdir(tmp_path):
    for name in ("scripts", "hostfiles", "tests", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(VENV_BIN.parent)  # the environment running these tests
    return tmp_path


def readme(command, pages=("README.md",)):
    """``command``, after checking that every page in ``pages`` still holds it."""
    for page in pages:
        assert command in PAGES[page], f"{page} no longer holds this command: {command}"
    return command


def run(workdir, command, quick="", timeout=240, env=None, replace=None, pages=("README.md",)):
    """``command`` (from ``pages``) plus ``quick`` flags, in bash, in ``workdir``."""
    line = readme(command, pages)
    for old, new in (replace or {}).items():
        line = line.replace(old, new)
    return launch(["bash", "-c", f"{line} {quick}"], timeout, env={**AS_A_USER, **(env or {})}, cwd=workdir)


def ran_as_documented(ran):
    """ok (support/checks.py), and no rank tag glued inside a line of the output."""
    ok(ran)
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
    ran = ran_as_documented(run(workdir, command, "--epochs 1", pages=("README.md", "docs/launching.md")))
    summary = results(workdir / command.split("--output-dir ")[1])
    assert summary["world_size"] == 2 and summary["epochs"] == 1 and summary["steps"] == 44, summary
    # No terminal under a launcher: periodic progress lines (every 0.05 s here) instead of a bar.
    steps = [(int(m[1]), int(m[2])) for m in PROGRESS.finditer(ran.output)]
    assert steps and all(total == 44 and 0 < step <= 44 for step, total in steps), ran.describe()
    assert "images/s; results in runs/" in ran.output, ran.describe()


# ---------------------------------------------------------------- docs/adapting.md: your own
ADAPTING = ("docs/adapting.md",)
OWN_MODEL = "horovodrun -np 2 python scripts/train_cnn.py --model examples/my_model.py:build --output-dir runs/my-model"
OWN_DATA = ("horovodrun -np 2 python scripts/train_cnn.py --dataset examples/my_data.py:load "
            "--model examples/my_model.py:build --lr 0.025 --output-dir runs/my-data")
OWN_TRAINER = "horovodrun -np 2 python scripts/train_signals.py --output-dir runs/signals"


def test_adapting_commands_train_your_model_data_and_trainer(workdir):
    ran_as_documented(run(workdir, OWN_MODEL, "--epochs 1", pages=ADAPTING))
    assert results(workdir / "runs" / "my-model")["model"] == "examples/my_model.py:build"
    ran_as_documented(run(workdir, OWN_DATA, "--epochs 2", pages=ADAPTING))
    assert results(workdir / "runs" / "my-data")["val_top1"] > 0.9  # the stripes are learnt in two epochs
    ran = ran_as_documented(run(workdir, OWN_TRAINER, "--epochs 1 --samples 256", pages=ADAPTING))
    assert "results in runs/signals/results.json" in ran.output, ran.describe()


# ---------------------------------------------------------------- the CNN examples
CNN = "horovodrun -np 2 python scripts/train_cnn.py --output-dir runs/cnn"
CIFAR = ("mpirun -np 2 -hostfile hostfiles/localhost python scripts/train_cnn.py --dataset cifar10 "
         "--data /data/cifar-10-batches-py --model resnet56 --epochs 160 --batch-size 32 --lr 0.025 "
         "--output-dir runs/cifar10")
DEMO = "horovodrun -np 2 .venv/bin/python scripts/train_cnn.py --output-dir runs/demo-cnn --no-resume"
NP4 = "mpirun -np 4 --oversubscribe -hostfile hostfiles/localhost python scripts/train_cnn.py --output-dir runs/cnn-np4"
CNN_PAGES = ("README.md", "docs/cnn.md")
TROUBLESHOOTING = ("docs/troubleshooting.md",)
SHA256_CHECK = "cd DIR && sha256sum -c step-*.pt.sha256"


def test_cnn_example_then_its_relaunch_changes_nothing(workdir):
    ran_as_documented(run(workdir, CNN, "--epochs 1", pages=CNN_PAGES))
    out = workdir / "runs" / "cnn"
    # docs/checkpoints.md: the sidecars check by hand with sha256sum.
    checked = ran_as_documented(run(workdir, SHA256_CHECK, replace={"DIR": "runs/cnn"}, timeout=60, pages=("docs/checkpoints.md",)))
    assert re.search(r"^step-\d+\.pt: OK$", checked.output, re.M), checked.describe()
    before = {name: (out / name).read_bytes() for name in ("results.json", "metrics.jsonl")}
    again = ran_as_documented(run(workdir, CNN, "--epochs 1", pages=CNN_PAGES))
    assert "holds a finished run" in again.output and "runs/cnn/results.json" in again.output, again.describe()
    assert before == {name: (out / name).read_bytes() for name in before}


def test_cifar10_example_on_the_2_slot_hostfile(workdir):
    """The README's data path is swapped for a small file in CIFAR-10's layout."""
    data = make_cifar10(workdir / "cifar")
    ran_as_documented(run(workdir, CIFAR, "--epochs 1", replace={"/data/cifar-10-batches-py": str(data)}, pages=CNN_PAGES))
    summary = results(workdir / "runs" / "cifar10")
    assert summary["dataset"] == "cifar10" and summary["model"] == "resnet56" and summary["world_size"] == 2


def test_make_demo_stopped_prints_a_command_that_resumes(workdir):
    """`make demo` has --no-resume: "relaunch the same command" would start over."""
    demo_line = re.search(r"^demo:.*\n\t(.*)$", (REPO / "Makefile").read_text(), re.M)[1]
    for variable, value in (("$(VENV)/bin/", ""), ("$(NP)", "2"), ("$(PY)", ".venv/bin/python")):
        demo_line = demo_line.replace(variable, value)
    assert demo_line == DEMO  # the README's "make demo # = ..." is what make runs
    stopped = ran_as_documented(run(workdir, DEMO, "--epochs 1 --stop-after 3", pages=CNN_PAGES))
    said = re.search(r"stopped by --stop-after 3 at step 3: .*relaunch with the same launcher: (.*)$",
                     stopped.rank_output(0), re.M)
    assert said, stopped.describe()
    again = said[1]
    assert "--no-resume" not in again and "--stop-after" not in again, again
    resumed = ran_as_documented(launch(["bash", "-c", f"horovodrun -np 2 {again}"], 240, env=AS_A_USER, cwd=workdir))
    assert "restored step 3" in resumed.output, resumed.describe()
    assert results(workdir / "runs" / "demo-cnn")["completed"] is True


# ---------------------------------------------------------------- the BERT examples
PREPARE = "python scripts/prepare_bert_data.py --output-dir data/bert128"
PREPARE_512 = ("python scripts/prepare_bert_data.py --vocab data/bert128/tokenizer --max-seq-length 512 "
               "--bin-size 64 --output-dir data/bert512")
PHASE1 = "horovodrun -np 2 python scripts/pretrain_bert.py --data data/bert128 --model tiny --output-dir runs/bert"
PHASE2 = ("horovodrun -np 2 python scripts/pretrain_bert.py --data data/bert512 --init-checkpoint runs/bert "
          "--max-seq-length 512 --output-dir runs/bert-phase2")
BERT_PAGES = ("README.md", "docs/bert.md")
BERT_ELASTIC = ('horovodrun -np 2 --min-np 1 --max-np 2 --network-interface lo --blacklist-cooldown-range 10 60 '
                '--host-discovery-script "python scripts/discover_hosts.py hostfiles/elastic" '
                'python scripts/pretrain_bert.py --elastic --data data/bert128 --model tiny --output-dir runs/bert-elastic')


def test_bert_examples_in_order_and_their_relaunches(workdir):
    ran_as_documented(run(workdir, PREPARE, "--dupe-factor 1", timeout=180, pages=BERT_PAGES))
    ran_as_documented(run(workdir, PREPARE_512, "--dupe-factor 1", timeout=180, pages=BERT_PAGES))
    for command, out, steps in ((PHASE1, "runs/bert", 20), (PHASE2, "runs/bert-phase2", 4)):
        ran = ran_as_documented(run(workdir, command, f"--steps {steps} --log-every 2", timeout=300, pages=BERT_PAGES))
        summary = results(workdir / out)
        assert summary["completed"] and summary["steps"] == steps and summary["world_size"] == 2, summary
        assert (workdir / out / "model" / "config.json").is_file()
        assert f"finished at step {steps}: " in ran.output, ran.describe()
        assert "Writing model shards" not in ran.output, ran.describe()  # no Transformers progress bar
    # (A finished BERT run's relaunch: test_bert.py::test_resume_is_bit_exact; the CNN's, as the README
    # documents it: test_cnn_example_then_its_relaunch_changes_nothing.)
    # docs/launching.md: elastic BERT on the phase-1 data prepared above.
    ran = ran_as_documented(run(workdir, BERT_ELASTIC, "--steps 10 --log-every 2", timeout=240, pages=("docs/launching.md",)))
    summary = results(workdir / "runs" / "bert-elastic")
    assert summary["completed"] and summary["steps"] == 10 and summary["world_size"] == 2, (summary, ran.describe())


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
    ran = run(workdir, command, env=env, timeout=60, pages=("README.md", "docs/launching.md"))
    ok(ran)
    written = workdir / "hosts.txt"
    assert (written.read_text() if "-o hosts.txt" in command else ran.output) == expected, ran.describe()


def test_elastic_example(workdir):
    ran = ran_as_documented(run(workdir, 'horovodrun -np 2 --min-np 1 --max-np 4 --network-interface lo --host-discovery-script '
                          '"python scripts/discover_hosts.py hostfiles/elastic" '
                          'python tests/workers/elastic_grow.py runs/elastic 2', timeout=180,
                 pages=("docs/launching.md",)))
    assert "2 2" in (workdir / "runs" / "elastic" / "sizes-rank1.txt").read_text().split("\n"), ran.describe()


def test_elastic_cnn_example(workdir):
    ran = ran_as_documented(run(workdir, 'horovodrun -np 2 --min-np 1 --max-np 4 --network-interface lo --host-discovery-script '
                          '"python scripts/discover_hosts.py hostfiles/elastic" '
                          'python scripts/train_cnn.py --elastic --output-dir runs/cnn-elastic', "--epochs 1",
                 timeout=180, pages=("README.md", "docs/launching.md")))
    row = json.loads((workdir / "runs" / "cnn-elastic" / "metrics.jsonl").read_text())
    assert row["world_size"] == 2 and row["train_samples"] == 1438, (row, ran.describe())


# ---------------------------------------------------------------- Troubleshooting
def test_not_enough_slots_named_by_make_hostfile_and_oversubscribe_runs(workdir):
    check = run(workdir, "python scripts/make_hostfile.py --hostfile hostfiles/localhost -np 4", timeout=60,
                pages=TROUBLESHOOTING)
    assert check.returncode == 2, check.describe()
    one_error_line(check, "make_hostfile.py: error:", "line 3: localhost 2 slots")
    refused = run(workdir, NP4, replace={"--oversubscribe ": ""}, timeout=60, pages=TROUBLESHOOTING)
    assert refused.returncode != 0 and "not enough slots" in refused.output, refused.describe()
    ran_as_documented(run(workdir, NP4, "--epochs 1 --stop-after 3", timeout=240, pages=TROUBLESHOOTING))
    assert results(workdir / "runs" / "cnn-np4")["world_size"] == 4


def test_horovodrun_hostfile_check_and_conversion(workdir):
    check = run(workdir, "python scripts/make_hostfile.py --hostfile FILE --input-format horovodrun",
                replace={"FILE": "hostfiles/localhost"}, timeout=60, pages=TROUBLESHOOTING)
    assert check.returncode == 2 and "line 1: horovodrun --hostfile cannot read comments" in check.output
    readme("or convert it with `--hostfile FILE --format horovodrun`", TROUBLESHOOTING)
    converted = run(workdir, "python scripts/make_hostfile.py --hostfile FILE --input-format horovodrun",
                    replace={"FILE": "hostfiles/localhost", "--input-format": "--format"}, timeout=60,
                    pages=TROUBLESHOOTING)
    ok(converted)
    assert converted.output == "localhost slots=2\n", converted.describe()


@pytest.mark.parametrize("command, status, report", [
    ("horovodrun -np 2 python scripts/train_cnn.py --batch-size 0", 2, "Primary job  terminated normally"),
    ("horovodrun --gloo -np 2 python scripts/train_cnn.py --batch-size 0", 1, "Exit code: 2"),
], ids=["through mpirun", "gloo"])
def test_exit_status_of_bad_input_as_documented(workdir, command, status, report):
    ran = run(workdir, command, timeout=120, pages=TROUBLESHOOTING)
    assert ran.returncode == status and report in ran.output, ran.describe()
    one_error_line(ran, "train_cnn.py: error:", "must be at least 1, got 0")
    assert f"`{command}` (exit {status})" in PAGES["docs/troubleshooting.md"]


def test_commands_run_one_after_another_have_distinct_output_dirs():
    """A second command into the first one's directory would only find a finished run."""
    commands = {**{command: ("README.md", "docs/launching.md") for command in ONE_MACHINE.values()},
                CNN: CNN_PAGES, CIFAR: CNN_PAGES, DEMO: CNN_PAGES, NP4: TROUBLESHOOTING,
                PHASE1: BERT_PAGES, PHASE2: BERT_PAGES, BERT_ELASTIC: ("docs/launching.md",)}
    dirs = [readme(command, pages).split("--output-dir ")[1].split()[0] for command, pages in commands.items()]
    assert len(set(dirs)) == len(dirs), dirs


# ---------------------------------------------------------------- benchmark.py, as the README and docs/benchmark.md show it
BENCH_QUICK = "--warmup-steps 1 --windows 2 --window-steps 2 --output bench.json"
BENCH_TRAIN = {
    "horovod": ("horovodrun -np 2 .venv/bin/python scripts/benchmark.py train --model resnet20",
                ("README.md", "docs/benchmark.md")),
    "ddp": ("horovodrun -np 2 .venv/bin/python scripts/benchmark.py train --model resnet20 --baseline ddp",
            ("README.md", "docs/benchmark.md")),
    "none": (".venv/bin/python scripts/benchmark.py train --model resnet20 --baseline none", ("docs/benchmark.md",)),
}


@pytest.mark.parametrize("kind", BENCH_TRAIN)
def test_benchmark_train_commands(workdir, kind):
    command, pages = BENCH_TRAIN[kind]
    ran = ran_as_documented(run(workdir, command, BENCH_QUICK, timeout=240, pages=pages))
    assert (workdir / "bench.json").is_file(), ran.describe()
    assert "images/s" in ran.output, ran.describe()


# ---------------------------------------------------------------- the pages themselves
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A repository path the pages name (not one inside another path, not FILE:LINE quoted from a program's output).
REPO_PATH = re.compile(r"(?<![\w./~-])((?:scripts|tests|tools|docs|hostfiles|slurm|\.ci)/[\w./-]*\w)(:\d+)?")
HISTORY = re.compile(r"\bcommit [0-9a-f]{7}|\bissue \d|\bthis project\b|\bsessions?\b|\bthe merge\b|\bbranch `"
                     r"|(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])", re.I)


def raw_page(name):
    return (REPO / name).read_text()


def anchors(name):
    """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces as hyphens."""
    seen, result = {}, set()
    for heading in re.findall(r"^#+ +(.+?) *$", FENCE.sub("", raw_page(name)), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        result.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return result


def test_pages_exist_and_the_readme_stays_short():
    assert "docs/README.md" in PAGES and len(PAGE_NAMES) >= 10, PAGE_NAMES
    lines = raw_page("README.md").count("\n")
    assert lines <= 330, f"README.md has {lines} lines; the rest belongs in docs/"
    for name in PAGE_NAMES[1:]:  # every docs page can be reached from the README or the docs index
        if name.count("/") == 1:
            target = name.removeprefix("docs/")
            assert f"]({name})" in raw_page("README.md") or f"]({target})" in raw_page("docs/README.md"), name


@pytest.mark.parametrize("name", PAGE_NAMES)
def test_relative_links_and_anchors_resolve(name):
    page = REPO / name
    broken = []
    for target in LINK.findall(FENCE.sub("", raw_page(name))):
        if re.match(r"[a-z]+:", target):
            continue  # an outside address
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(str(resolved.relative_to(REPO))):
            broken.append(target)
    assert not broken, f"{name}: links that lead nowhere: {broken}"


@pytest.mark.parametrize("name", PAGE_NAMES)
def test_repository_paths_named_exist(name):
    named = {path for path, line in REPO_PATH.findall(raw_page(name)) if not line}
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, f"{name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("name", PAGE_NAMES)
def test_pages_hold_no_development_history(name):
    found = sorted({match.group(0) for match in HISTORY.finditer(raw_page(name))})
    assert not found, f"{name}: commit hashes or development history: {found}"
