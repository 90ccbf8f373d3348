"""`make setup` is idempotent: a second run reuses the cached Horovod wheel."""
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from support.checks import ok
from support.hosts import no_network
from support.launch import REPO, launch


def test_second_setup_is_quick_and_horovod_has_every_backend(need_horovod):
    started = time.monotonic()
    run = launch(["bash", "scripts/setup/setup.sh"], timeout=300)
    ok(run)
    assert "building Horovod" not in run.output, "setup rebuilt Horovod instead of reusing it"
    assert "PyTorch, MPI and Gloo available" in run.output
    print(f"second setup took {time.monotonic() - started:.1f} s")

    check = launch(["horovodrun", "--check-build"], timeout=60)
    for feature in ("PyTorch", "MPI", "Gloo"):
        assert re.search(rf"\[X\] {feature}\b", check.output), check.describe()



SETUP = "scripts/setup/setup.sh"
TEST_ONLY = ("slurm-wlm", "munge", "openssh-server", "openssh-client", "iproute2")


def bare_path(tmp_path):
    """A PATH with only what setup.sh's dry run uses: no MPI, cmake, g++, make, patch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "sed", "grep", "cat", "xargs", "sha256sum", "cut", "wc"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def dry_run(env=None, args=("--dry-run",)):
    return launch(["bash", SETUP, *args], timeout=60, env={"PYTHON": sys.executable, **(env or {})})


def test_setup_installs_what_the_scripts_need_and_no_test_only_packages(tmp_path):
    run = dry_run({"PATH": bare_path(tmp_path)})
    ok(run)
    (line,) = [line for line in run.output.splitlines() if "apt-get install" in line]
    packages = line.split("apt-get install", 1)[1].split()
    assert packages == ["openmpi-bin", "libopenmpi-dev", "cmake", "g++", "make", "patch"], line
    assert not set(TEST_ONLY) & set(packages)


@pytest.mark.parametrize("env, user, said", [
    ({"MPI": "none"}, None, "MPI=none: Horovod is built with Gloo only"),
    ({}, "nobody (65534)", "no MPI: no mpicc on PATH and not root to install Open MPI"),
], ids=["MPI=none", "no mpicc, not root"])
def test_without_mpi_setup_builds_horovod_with_gloo_only(tmp_path, env, user, said):
    """No MPI and none to install: no Open MPI packages asked for, a Gloo-only Horovod, no mpi4py
    (the build itself, offline: test_with_no_network_and_no_mpi_..., make test-scale)."""
    command = ["bash", SETUP, "--dry-run"]
    if user:  # pytest's tmp_path is root's alone: the bare PATH in a folder nobody can read
        tmp_path = Path(tempfile.mkdtemp(prefix="hvdtest-bare-"))
        tmp_path.chmod(0o755)
        command = [shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    try:
        run = launch(command, timeout=60, env={"PYTHON": sys.executable, "PATH": bare_path(tmp_path), **env})
    finally:
        if user:
            shutil.rmtree(tmp_path)
    ok(run)
    assert said in run.output and "mpirun does not" in run.output, run.describe()
    assert "Horovod with Gloo only (HOROVOD_WITHOUT_MPI=1), no mpi4py" in run.output, run.describe()
    assert "openmpi" not in run.output, run.describe()


def test_test_deps_are_installed_by_make_test_not_make_setup():
    test_plan = launch(["make", "-n", "test"], timeout=30)
    setup_plan = launch(["make", "-n", "setup"], timeout=30)
    assert "scripts/setup/test-deps.sh" in test_plan.output, test_plan.describe()
    assert "scripts/setup/test-deps.sh" not in setup_plan.output, setup_plan.describe()
    source = (REPO / "scripts/setup/test-deps.sh").read_text()
    for package in TEST_ONLY:
        assert f"missing+=({package})" in source
    deps = launch(["bash", "scripts/setup/test-deps.sh", "--dry-run"], timeout=30)
    ok(deps)
    assert "[test-deps] dry run: apt-get install" in deps.output, deps.describe()


@pytest.mark.parametrize("variant, expected", [
    ({}, "torch: pip install torch==2.13.0 (TORCH_VARIANT=auto)"),
    ({"TORCH_VARIANT": "cuda"}, "torch: pip install torch==2.13.0 (TORCH_VARIANT=cuda)"),
    ({"TORCH_VARIANT": "cpu"},
     "torch: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (TORCH_VARIANT=cpu)"),
    ({"TORCH_VARIANT": "cpu", "TORCH_INDEX_URL": "https://mirror.example/cpu"},
     "torch: pip install torch==2.13.0 --index-url https://mirror.example/cpu (TORCH_VARIANT=cpu)"),
    ({"USE_SYSTEM_TORCH": "1"}, "torch: the one"),
])
def test_torch_variant_choices(variant, expected):
    run = dry_run(variant)
    ok(run)
    assert expected in run.output, run.describe()


@pytest.mark.parametrize("env, fragment", [
    ({"TORCH_VARIANT": "gpu"}, "TORCH_VARIANT=gpu: use auto (pip's default torch), cpu or cuda"),
    ({"USE_SYSTEM_TORCH": "yes"}, "USE_SYSTEM_TORCH=yes: use 1"),
    ({"USE_SYSTEM_TORCH": "1", "TORCH_VARIANT": "cpu"}, "do not combine it with TORCH_VARIANT"),
    ({}, "unknown argument '--fast'"),
    ({"MPI": "openmpi"}, "MPI=openmpi: use auto"),
])
def test_bad_setup_settings_are_one_line_errors(env, fragment):
    run = dry_run(env, args=("--dry-run", "--fast") if not env else ("--dry-run",))
    assert run.returncode != 0, run.describe()
    assert run.output.strip().splitlines() == [f"[setup] error: {run.output.split('error: ', 1)[1].strip()}"]
    assert fragment in run.output, run.describe()


def test_existing_torch_mode_keeps_that_torch_and_adds_horovod(tmp_path, need_horovod):
    """USE_SYSTEM_TORCH=1 on top of an environment that has torch (here the project's
    own venv stands in for a container's or a module's Python): the new venv uses
    that torch, installs no torch of its own, and gets the cached Horovod wheel."""
    import torch
    torch_file = Path(torch.__file__)
    before = (torch_file.stat().st_mtime_ns, torch.__version__)
    venv = tmp_path / "venv"
    run = launch(["bash", SETUP], timeout=600,
                 env={"PYTHON": sys.executable, "USE_SYSTEM_TORCH": "1", "VENV": str(venv)})
    ok(run)
    assert "building Horovod" not in run.output, "the cached wheel should have been reused"
    assert f"using torch {torch.__version__} from {torch_file}" in run.output, run.describe()
    probe = launch([venv / "bin/python", "-c", "import torch, horovod; print(torch.__file__); print(horovod.__file__)"],
                   timeout=60)
    torch_seen, horovod_seen = probe.output.split()
    assert Path(torch_seen) == torch_file, probe.describe()
    assert Path(horovod_seen).is_relative_to(venv), probe.describe()  # our build, in the new venv
    assert not list(venv.glob("lib/python*/site-packages/torch")), "a second torch was installed"
    assert (torch_file.stat().st_mtime_ns, torch.__version__) == before


def path_without_mpi(folder):
    """A PATH of every program on this one except MPI's (mpicc, mpirun, orted, ...)."""
    folder.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        for program in Path(directory).glob("*") if Path(directory).is_dir() else ():
            if not program.name.startswith(("mpi", "orte", "ompi", "oshmem", "opal")) \
                    and not (folder / program.name).exists():
                (folder / program.name).symlink_to(program)
    return str(folder)


def make_wheelhouse(folder, **env):
    """``make wheelhouse WHEELHOUSE=folder`` (with network), for this Python."""
    made = launch(["make", "wheelhouse", f"WHEELHOUSE={folder}"], timeout=900, env={"PYTHON": sys.executable, **env})
    ok(made)
    assert (folder / "wheelhouse.txt").is_file(), made.describe()
    assert (folder / "horovod-0.28.1.tar.gz").is_file() and (folder / "horovod-series" / "series").is_file()
    return made


def offline_setup(offline, env):
    """``make setup`` (setup.sh) run in ``offline`` (support.hosts.no_network), with no pip
    configuration of this machine's (its local wheel folders and indexes)."""
    return launch([*offline, "env", "-u", "PIP_FIND_LINKS", "PIP_CONFIG_FILE=/dev/null", "bash", SETUP],
                  timeout=1500, env=env)


HERE = f"cp{sys.version_info.major}{sys.version_info.minor}-{platform.machine()}"  # this Python, as wheelhouse.txt says it


@pytest.mark.parametrize("manifest, error", [
    (None, r"is not a wheelhouse \(no wheelhouse.txt\): make one with 'make wheelhouse WHEELHOUSE=DIR'"),
    ("python cp39-x86_64\n", rf"was made for cp39-x86_64, this PYTHON is {HERE}: make it with PYTHON"),
    (f"python {HERE}\n", rf"has nothing that installs '(setuptools|wheel)' on {HERE}: remake it with 'make wheelhouse'"),
], ids=["not a wheelhouse", "another Python", "a package missing"])
def test_a_wheelhouse_that_cannot_serve_is_one_line(tmp_path, manifest, error):
    """Each is one line, exit 1, before anything is installed from elsewhere (the last one is
    pip's own "no matching distribution" in a venv made for it, no index)."""
    (tmp_path / "wheelhouse").mkdir()
    if manifest:
        (tmp_path / "wheelhouse" / "wheelhouse.txt").write_text(manifest)
    run = launch(["bash", SETUP], timeout=120, env={"PYTHON": sys.executable, "VENV": str(tmp_path / "venv"),
                                                    "WHEELHOUSE": str(tmp_path / "wheelhouse")})
    assert run.returncode == 1, run.describe()
    (line,) = [line for line in run.output.splitlines() if "error" in line.lower()] or [run.output]
    assert re.match(rf"\[setup\] error: WHEELHOUSE=\S+ {error}", line), run.describe()


@pytest.mark.scale
def test_with_no_network_and_no_mpi_a_wheelhouse_builds_horovod_for_this_torch_and_gloo_trains(tmp_path, need_horovod):
    """The GPU machine's case: no network, no MPI, a Python with its own torch. `make wheelhouse`
    here with USE_SYSTEM_TORCH=1 MPI=none (no torch, no mpi4py in it); then, in a namespace with only
    lo and no mpicc on PATH, `make setup WHEELHOUSE=DIR USE_SYSTEM_TORCH=1` on this venv's torch, with
    an empty Horovod wheel cache: MPI becomes Gloo only by itself, Horovod is built from the
    wheelhouse's sdist; `horovodrun` picks Gloo, an elastic job runs, and `horovodrun --mpi` is one
    line, exit 2."""
    wheelhouse, venv, path = tmp_path / "wheelhouse", tmp_path / "venv", path_without_mpi(tmp_path / "bin")
    make_wheelhouse(wheelhouse, USE_SYSTEM_TORCH="1", MPI="none")
    assert not list(wheelhouse.glob("torch-*")) and not list(wheelhouse.glob("mpi4py-*"))
    env = {"PYTHON": sys.executable, "USE_SYSTEM_TORCH": "1", "VENV": str(venv), "WHEELHOUSE": str(wheelhouse),
           "PATH": path, "HOROVOD_WHEEL_CACHE": str(tmp_path / "cache")}
    with no_network() as offline:
        setup = offline_setup(offline, env)
        ok(setup)
        for said in (f"installing from WHEELHOUSE={wheelhouse} alone (no index, no apt)",
                     "no MPI: no mpicc on PATH, and a WHEELHOUSE setup installs no system packages",
                     "building Horovod 0.28.1+hvdtrain.", "PyTorch and Gloo available (no MPI: Gloo only)"):
            assert said in setup.output, setup.describe()
        horovodrun, python = str(venv / "bin/horovodrun"), str(venv / "bin/python")
        check = launch([*offline, horovodrun, "--check-build"], timeout=60, env={"PATH": path})
        assert re.search(r"\[ \] MPI\b", check.output) and re.search(r"\[X\] Gloo\b", check.output), check.describe()

        cnn = [python, str(REPO / "scripts/train_cnn.py"), "--model", "convnet", "--image-size", "8", "--max-steps", "4"]
        plain = launch([*offline, horovodrun, "-np", "2", *cnn, "--output-dir", tmp_path / "plain", "--no-resume"],
                       timeout=300, env={"PATH": path})
        ok(plain)
        assert "2 workers" in plain.output, plain.describe()
        elastic = launch([*offline, horovodrun, "-np", "2", "--min-np", "1", "--max-np", "2", "--network-interface", "lo",
                          "--host-discovery-script", f"{python} {REPO / 'scripts/discover_hosts.py'} "
                          f"{REPO / 'hostfiles/elastic'}", *cnn, "--elastic", "--output-dir", tmp_path / "elastic"],
                         timeout=300, env={"PATH": path})
        ok(elastic)
        mpi = launch([*offline, horovodrun, "--mpi", "-np", "2", *cnn, "--output-dir", tmp_path / "mpi"], timeout=60,
                     env={"PATH": path})
    assert mpi.returncode == 2 and "Traceback" not in mpi.output, mpi.describe()
    assert mpi.output.strip() == ("horovodrun: error: this Horovod was built without MPI (Gloo only): launch "
                                  "with horovodrun --gloo, or load an MPI and rerun make setup for mpirun"), mpi.describe()


@pytest.mark.scale
def test_with_no_network_a_wheelhouse_installs_everything_into_a_new_python(tmp_path, need_horovod, need_mpi):
    """A compute node with no route out: `make wheelhouse` here (torch as make setup chooses it,
    mpi4py as an sdist with what building it needs, Cython included), then `make setup
    WHEELHOUSE=DIR` from the system's Python in a namespace with only lo: every package from the
    wheelhouse, mpi4py compiled against this MPI, Horovod's wheel from the cache `make setup` filled
    for the same torch; horovodrun --check-build shows MPI, and mpi4py runs."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    wheelhouse, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    make_wheelhouse(wheelhouse, PYTHON=str(base))
    assert list(wheelhouse.glob("torch-*.whl")) and list(wheelhouse.glob("mpi4py-*.tar.gz"))
    assert list(wheelhouse.glob("cython-*.whl")), "mpi4py's build asks its backend for Cython"
    with no_network() as offline:
        setup = offline_setup(offline, {"PYTHON": str(base), "VENV": str(venv), "WHEELHOUSE": str(wheelhouse)})
        ok(setup)
        assert "PyTorch, MPI and Gloo available" in setup.output, setup.describe()
        assert "building Horovod" not in setup.output, setup.describe()  # make setup cached this torch's wheel
        probe = launch([*offline, venv / "bin/python", "-c", "import torch; from mpi4py import MPI; "
                        "print(MPI.COMM_WORLD.Get_size(), torch.__file__)"], timeout=60)
    size, torch_file = probe.output.split()[-2:]
    ok(probe)
    assert size == "1", probe.describe()
    assert Path(torch_file).is_relative_to(venv), probe.describe()  # the wheelhouse's torch, in the new venv


GPU_CHECK_STAGES = ("machine", "check-build", "gpu-tests", "resnet50-amp", "bert-large-phase1", "two-ranks-one-gpu")


def test_the_gpu_check_dry_runs_on_the_cpu(tmp_path, need_horovod):
    """tools/gpu_check.sh, DRY_RUN=1: every stage a CPU allows (no build, the gpu tests
    deselected, the figures' runs with the smallest models), each timed; what it would carry
    fits the device's 64 MiB; at most 8 files come back; figures.json holds each run's rate."""
    out = tmp_path / "check"
    run = launch(["bash", "tools/gpu_check.sh", out], timeout=300, env={"DRY_RUN": "1", "PYTHON": sys.executable})
    ok(run)
    for stage in GPU_CHECK_STAGES:  # pytest's 5: no test ran (all deselected without a GPU)
        status = 5 if stage == "gpu-tests" else 0
        assert re.search(rf"^\[gpu-check\] {stage}: exit {status} in \d+ s$", run.output, re.MULTILINE), run.describe()
    gpu_tests = len(re.findall(r"^def test_", (REPO / "tests" / "test_gpu.py").read_text(), re.MULTILINE))
    assert f"{gpu_tests} deselected" in (out / "gpu-tests.log").read_text()  # every one of them, none left out
    carried = re.search(r"^\[gpu-check\] carried: ([\d.]+) MiB of at most 64 ", run.output, re.MULTILINE)
    assert carried and 0 < float(carried.group(1)) <= 64, run.describe()
    assert re.search(r"^\[gpu-check\] total: \d+ s; gpu tests exit 0$", run.output, re.MULTILINE), run.describe()
    files = sorted(path.name for path in out.iterdir())
    assert len(files) <= 8 and {"summary.txt", "figures.json", "measure.log"} <= set(files), files
    figures = json.loads((out / "figures.json").read_text())["figures"]
    assert set(figures) == {"resnet50-amp", "bert-large-phase1", "two-ranks-one-gpu"}, figures
    assert all(figure["median"] > 0 for figure in figures.values()), figures
