"""Every script's --help, as a user reads it: each option explained, each default shown once.

The scripts share one formatter (hvdtrain.cli.HelpFormatter); these tests read
the real `python scripts/X.py --help` output, so an option added without help,
or a help text that names its default while argparse appends another, fails.
"""
import functools
import re

import pytest

from support.checks import ok, one_error_line
from support.commands import with_heavy_modules
from support.launch import REPO, SCRIPTS, python

SCRIPT_NAMES = ["train_cnn.py", "prepare_bert_data.py", "pretrain_bert.py", "make_hostfile.py",
                "discover_hosts.py", "benchmark.py", "benchmark.py train", "benchmark.py allreduce",
                "benchmark.py scaling", "benchmark.py compare", "benchmark.py tune", "benchmark.py timeline",
                "benchmark.py predict"]
DEFAULT = re.compile(r"\(default:")


def help_entries(text):
    """{option line: its help text} from argparse's --help output.

    An entry starts on a line indented by two spaces: an option ("  --seed SEED")
    or, under "positional arguments:", a name. Its help follows on the same line
    after a gap and on the lines indented deeper below it.
    """
    entries, current, positional = {}, None, False
    for line in text.splitlines():
        if line and not line.startswith(" "):  # a section title, the usage or the epilog
            positional, current = line.startswith("positional arguments"), None
            continue
        starts = re.match(r"^  (\S.*?)(?:\s{2,}(.*))?$", line)
        if starts and (starts.group(1).startswith("-") or positional):
            current = starts.group(1)
            entries[current] = starts.group(2) or ""
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@functools.cache
def help_text(name):
    script, *subcommand = name.split()
    return ok(python([SCRIPTS / script, *subcommand, "--help"], timeout=60)).output


@pytest.fixture(params=SCRIPT_NAMES)
def script_help(request):
    return request.param, help_text(request.param)


def test_every_option_has_a_help_text(script_help):
    name, text = script_help
    entries = help_entries(text)
    usage_options = set(re.findall(r"\[(-[-\w]+)", text.split("\n\n")[0]))
    listed = {option.split()[0].rstrip(",") for option in entries}
    assert usage_options and usage_options <= listed, (name, usage_options - listed)
    missing = [option for option, help_text in entries.items() if not help_text.strip()]
    assert not missing, f"{name}: options without help: {missing}"


def test_each_default_is_shown_once_and_means_something(script_help):
    name, text = script_help
    for option, help_text in help_entries(text).items():
        assert len(DEFAULT.findall(help_text)) <= 1, f"{name} {option}: {help_text}"
        assert "(default: None)" not in help_text and "(None)" not in help_text, f"{name} {option}: {help_text}"
        takes_value = len(option.split(",")[0].split()) > 1
        paired = "--no-" in option  # --resume, --no-resume: the default is which one applies
        if not takes_value and not paired:  # a flag: True/False says nothing about what it does
            assert not re.search(r"\(default: (True|False)\)", help_text), f"{name} {option}: {help_text}"


def test_help_entries_reads_argparse_layout():
    """The parser above, on a sample: an option without help, a wrapped help, a positional."""
    sample = ("usage: x.py [-h] [--a A] [--b] [file]\n\ndescription\n\npositional arguments:\n"
              "  file        a file\n\noptions:\n"
              "  -h, --help  show this help message and exit\n  --a A\n  --b         flag help\n"
              "              wrapped (default: 1)\n\nEpilog:\n  layout line\n")
    entries = help_entries(sample)
    assert entries["--a A"] == "" and entries["--b"] == "flag help wrapped (default: 1)"
    assert entries["file"] == "a file" and "layout line" not in entries


def test_shard_format_keeps_its_layout():
    text = help_text("prepare_bert_data.py")
    assert re.search(r"\n  shard-NNNNN\.h5 +HDF5", text), text
    assert re.search(r"\n      input_ids +int32", text), text


# A bad argument of each kind the parsers check: an unknown option, a bad value, a refused combination.
BAD_ARGUMENTS = {"train_cnn.py": [["--no-such-option"], ["--batch-size", "0"]],
                 "pretrain_bert.py": [["--data", "d", "--optimizer", "adamw", "--lamb-nvlamb"],
                                      ["--data", "d", "--balance", "--elastic"]],
                 "prepare_bert_data.py": [["--output-dir", "d", "--max-seq-length", "0"]],
                 "benchmark.py": [["train", "--model", "resnet20", "--baseline", "none", "--fusion-threshold-mb", "8"],
                                  ["allreduce", "--min-bytes", "1M", "--max-bytes", "1K"]]}


# The trainers read top to bottom, their imports at the top (torch and Horovod load, about two
# seconds, before --help answers); the tools answer before their heavy imports.
ANSWER_BEFORE_TORCH = {"prepare_bert_data.py", "benchmark.py"}


@pytest.mark.parametrize("script", sorted(BAD_ARGUMENTS))
def test_help_and_bad_arguments_answer_before_horovod_starts(script):
    """--help and a usage error answer before hvd.init(): one line, exit 2, no world formed and
    no model built (transformers not loaded); the tools before torch and Horovod even load."""
    for args in (["--help"], *BAD_ARGUMENTS[script]):
        ran, loaded = with_heavy_modules([SCRIPTS / script, *args], timeout=60)
        assert ran.returncode == (0 if args == ["--help"] else 2), ran.describe()
        assert "transformers" not in loaded, ran.describe()
        if script in ANSWER_BEFORE_TORCH:
            assert loaded == [], ran.describe()
        if args != ["--help"]:
            assert one_error_line(ran).startswith(f"{script}: error: "), ran.describe()


# Options of other programs that the README and docs/ name, by program; a file's options must be in that file.
OTHER_PROGRAMS = {
    "horovodrun": {"--gloo", "--mpi", "--min-np", "--max-np", "--network-interface", "--check-build",
                   "--host-discovery-script", "--blacklist-cooldown-range", "--reset-limit",
                   "--timeline-filename", "--version"},
    "mpirun": {"--bind-to", "--mca", "--oversubscribe"},
    "torchrun": {"--standalone"},
    "sbatch, srun, scancel": {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--gpus-per-task",
                              "--cpus-per-task", "--signal", "--requeue", "--dependency", "--batch", "--mpi",
                              "--kill-on-bad-exit", "--no-kill", "--nodelist"},
    "pip, venv": {"--no-binary", "--no-deps", "--no-build-isolation", "--system-site-packages"},
    "curl": {"--max-time"},
    "pytest": {"--setup-plan"},
    "scripts/setup/setup.sh": {"--dry-run"},
    "slurm/submit_bert_phases.sh": {"--phase1", "--phase2", "--phase1-data", "--phase2-data", "--sbatch"},
    "tools/make_bench_corpus.py": {"--megabytes", "--files"},
    "tools/make_synthetic_shards.py": {"--tokenizer", "--shards", "--rows"},
    "tools/measure_prepare_rate.py": {"--megabytes", "--repeat", "--compare", "--ranks", "--rounds", "--vocab", "--input"},
    "tools/measure_horovod_vs_ddp.py": {"--controller", "--settings", "--rounds", "--env", "--ddp-host-memory"},
    "tools/measure_balance.py": {"--share", "--rounds"},
    "tools/link_study.py": {"--hosts", "--rates", "--models", "--fusion-mb", "--rounds", "--summarize-only"},
    "tools/scale_study.py": {"--ranks", "--hosts", "--steps", "--no-elastic", "--elastic-only", "--json"},
    "tools/chaos.py": {"--ranks", "--interval", "--epochs", "--faults", "--one-at-a-time", "--then-after",
                       "--relaunch", "--hosts", "--fault", "--return-after", "--spares", "--seed", "--json", "--plot",
                       "--gloo-timeout", "--horovod-log-level", "--log", "--trainer", "--model", "--steps", "--keep",
                       "--slow-share", "--commit-every", "--global-batch", "--timeout"},
    "tools/measure_optimizer_step.py": {"--device", "--compare"},
    "tools/measure_checkpoint_stall.py": {"--every", "--checkpoints", "--dir"},
    "tools/measure_image_pipeline.py": {"--image-size", "--loader-workers", "--trainer-model", "--data", "--rounds",
                                        "--per-round"},
    "tools/liveness_sim.py": {"--ranks", "--per-node", "--steady-seconds", "--port", "--output"},
    "tools/horovod_series.py": {"--sdist"},
    "tools/horovod_upstream_tests.py": {"--suites", "--output"},
    "git": {"--fixup", "--autosquash"},
    "tools/measure_flight_recorder.py": {"--model", "--batch-size", "--image-size", "--blocks", "--steps"},
}


DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", DOC_PAGES, ids=[str(page.relative_to(REPO)) for page in DOC_PAGES])
def test_every_option_the_readme_names_exists(page):
    """An option renamed or removed in a script (or one that never existed, like
    make_hostfile.py --check) fails here while the README or a docs/ page still names it."""
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", page.read_text()))
    known = set().union(*(re.findall(r"--[a-z][a-z0-9-]*", help_text(name)) for name in SCRIPT_NAMES))
    for program, options in OTHER_PROGRAMS.items():
        if "/" in program:
            source = (REPO / program).read_text()
            assert all(option in source for option in options), program
        known |= options
    assert not named - known, f"{page.relative_to(REPO)} names options no script has: {sorted(named - known)}"


MEASUREMENT_TOOLS = sorted((REPO / "tools").glob("*.py"))


@pytest.mark.parametrize("tool", MEASUREMENT_TOOLS, ids=[tool.name for tool in MEASUREMENT_TOOLS])
def test_measurement_tools_start_as_programs(tool):
    """The README's measurement tools (tools/) run as programs, outside pytest: the
    helpers they share with the tests (tests/support/) come without conftest.py."""
    ran = ok(python([tool, "--help"], timeout=60))
    assert "usage:" in ran.output, ran.describe()
