"""What a test needs: under CI=true a missing component fails; elsewhere the test skips."""
import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest

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


def cuda_gpus():
    """CUDA GPUs this process sees (0 without CUDA, or with a CPU build of torch)."""
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0
