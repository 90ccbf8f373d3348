"""Pytest's hooks and the shared fixtures; the helpers themselves are in tests/support/.

Under CI=true a missing component fails; elsewhere it skips (support/needs.py).
"""
import pytest

from support.needs import cuda_gpus, require_module, require_program
from support.slurm_cluster import SlurmCluster, require_slurm
from support.two_hosts import TwoHosts, require_two_hosts


@pytest.fixture
def need_horovod():
    require_module("horovod.torch")
    require_program("horovodrun", "run `make setup`")


@pytest.fixture
def need_mpi():
    require_program("mpirun", "install Open MPI (apt-get install openmpi-bin libopenmpi-dev) or `make setup` as root")


# The session fixtures that several test modules use, defined once here: one
# imported into two modules would be two fixtures, each started once per session
# (two_hosts would then create its namespaces twice, slurm_cluster would run two
# clusters side by side). Under pytest-xdist a session is one worker's: the tests
# that use them are kept on one worker each (see pytest_collection_modifyitems).
@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node Slurm cluster for the whole test session."""
    require_slurm()
    cluster = SlurmCluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def two_hosts():
    """hvd-a and hvd-b, two network namespaces with sshd on hvd-b, for the session."""
    require_two_hosts()
    hosts = TwoHosts().start()
    try:
        yield hosts
    finally:
        hosts.stop()


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
