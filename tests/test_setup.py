"""`make setup` is idempotent: a second run reuses the cached Horovod wheel."""
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from support.launch import REPO, launch


def test_second_setup_is_quick_and_horovod_has_every_backend(need_horovod):
    started = time.monotonic()
    run = launch(["bash", "scripts/setup/setup.sh"], timeout=300)
    assert run.returncode == 0, run.describe()
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
    for tool in ("bash", "dirname", "sed", "grep"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def dry_run(env=None, args=("--dry-run",)):
    return launch(["bash", SETUP, *args], timeout=60, env={"PYTHON": sys.executable, **(env or {})})


def test_setup_installs_what_the_scripts_need_and_no_test_only_packages(tmp_path):
    run = dry_run({"PATH": bare_path(tmp_path)})
    assert run.returncode == 0, run.describe()
    (line,) = [line for line in run.output.splitlines() if "apt-get install" in line]
    packages = line.split("apt-get install", 1)[1].split()
    assert packages == ["openmpi-bin", "libopenmpi-dev", "cmake", "g++", "make", "patch"], line
    assert not set(TEST_ONLY) & set(packages)


def test_test_deps_are_installed_by_make_test_not_make_setup():
    test_plan = launch(["make", "-n", "test"], timeout=30)
    setup_plan = launch(["make", "-n", "setup"], timeout=30)
    assert "scripts/setup/test-deps.sh" in test_plan.output, test_plan.describe()
    assert "scripts/setup/test-deps.sh" not in setup_plan.output, setup_plan.describe()
    source = (REPO / "scripts/setup/test-deps.sh").read_text()
    for package in TEST_ONLY:
        assert f"missing+=({package})" in source
    deps = launch(["bash", "scripts/setup/test-deps.sh", "--dry-run"], timeout=30)
    assert deps.returncode == 0 and "[test-deps] dry run: apt-get install" in deps.output, deps.describe()


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
    assert run.returncode == 0 and expected in run.output, run.describe()


@pytest.mark.parametrize("env, fragment", [
    ({"TORCH_VARIANT": "gpu"}, "TORCH_VARIANT=gpu: use auto (pip's default torch), cpu or cuda"),
    ({"USE_SYSTEM_TORCH": "yes"}, "USE_SYSTEM_TORCH=yes: use 1"),
    ({"USE_SYSTEM_TORCH": "1", "TORCH_VARIANT": "cpu"}, "do not combine it with TORCH_VARIANT"),
    ({}, "unknown argument '--fast'"),
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
    assert run.returncode == 0, run.describe()
    assert "building Horovod" not in run.output, "the cached wheel should have been reused"
    assert f"using torch {torch.__version__} from {torch_file}" in run.output, run.describe()
    probe = launch([venv / "bin/python", "-c", "import torch, horovod; print(torch.__file__); print(horovod.__file__)"],
                   timeout=60)
    torch_seen, horovod_seen = probe.output.split()
    assert Path(torch_seen) == torch_file, probe.describe()
    assert Path(horovod_seen).is_relative_to(venv), probe.describe()  # our build, in the new venv
    assert not list(venv.glob("lib/python*/site-packages/torch")), "a second torch was installed"
    assert (torch_file.stat().st_mtime_ns, torch.__version__) == before
