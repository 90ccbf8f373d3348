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
