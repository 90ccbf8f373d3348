"""Shared fixtures. Under CI=true a missing component fails; elsewhere it skips."""
import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition, what, install_hint):
    """Fail under CI, skip elsewhere, when a component the test needs is absent."""
    if condition:
        return
    message = f"{what} is missing: {install_hint}"
    if IN_CI:
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


def require_program(name, install_hint):
    require(shutil.which(name) or (Path(sys.executable).parent / name).exists(),
            f"`{name}`", install_hint)


def require_module(name, install_hint="run `make setup`"):
    try:
        importlib.import_module(name)
        found = True
    except ImportError:
        found = False
    require(found, name, install_hint)


@pytest.fixture
def need_horovod():
    require_module("horovod.torch")
    require_program("horovodrun", "run `make setup`")


@pytest.fixture
def need_mpi():
    require_program("mpirun", "install Open MPI (apt-get install openmpi-bin libopenmpi-dev) or `make setup` as root")


def cuda_gpus():
    """CUDA GPUs this process sees (0 without CUDA, or with a CPU build of torch)."""
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    """Deselect the `gpu` tests where no CUDA GPU is visible: the one exception to
    "under CI=true a missing component fails", since CI here has no GPU."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests or cuda_gpus() > 0:
        return
    config.hook.pytest_deselected(items=gpu_tests)
    items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    config.stash[_GPU_DESELECTED] = len(gpu_tests)


def pytest_terminal_summary(terminalreporter, config):
    count = config.stash.get(_GPU_DESELECTED, 0)
    if count:
        terminalreporter.write_line(
            f"{count} GPU test{'s' if count != 1 else ''} deselected: no CUDA GPU visible "
            "(torch.cuda.is_available() is False); run them on a GPU machine with "
            "`.venv/bin/python -m pytest -m gpu tests`")


_GPU_DESELECTED = pytest.StashKey[int]()

# The session fixtures that several test modules use, defined once here: one
# imported into two modules would be two fixtures, each started once per session
# (two_hosts would then create its namespaces twice, slurm_cluster would run two
# clusters side by side). Imported last: they import require() and
# require_program() from this module.
from slurm_cluster import slurm_cluster  # noqa: E402,F401
from two_hosts import two_hosts  # noqa: E402,F401
