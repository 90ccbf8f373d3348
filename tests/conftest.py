"""Pytest's hooks and the shared fixtures; the helpers themselves are in tests/support/.

Under CI=true a missing component fails; elsewhere it skips (support/needs.py).
"""
import os

import pytest

from support import machine
from support.needs import cuda_gpus, require_module, require_program
from support.slurm_cluster import running_on
from support.hosts import Hosts, require_hosts


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
    with running_on() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def two_hosts():
    """hvd-a and hvd-b, two network namespaces with sshd, for the session."""
    yield from _hosts(["hvd-a", "hvd-b"], "10.77.0")


@pytest.fixture(scope="session")
def four_hosts():
    """node1-node4 on one bridge, each with sshd: the four-node cluster, for the session."""
    yield from _hosts([f"node{i}" for i in range(1, 5)], "10.78.0")


def _hosts(names, subnet):
    require_hosts()
    hosts = Hosts(names, subnet).start()
    try:
        yield hosts
    finally:
        hosts.stop()


def pytest_configure(config):
    """Under pytest-xdist, its scheduler for the groups below (support/xdist_groups.py)."""
    if config.pluginmanager.hasplugin("xdist"):
        from support import xdist_groups
        config.pluginmanager.register(xdist_groups, "hvdtest-xdist-groups")  # its pytest_configure runs now


EXTENDED_ENV = "HVDTEST_EXTENDED"  # 1: also the `extended` tests (make test-extended)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Deselect the `gpu` tests where no CUDA GPU is visible: the one exception to
    "under CI=true a missing component fails", since CI here has no GPU. Then
    group the tests that share a fixture for pytest-xdist."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and cuda_gpus() == 0:
        config.hook.pytest_deselected(items=gpu_tests)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.stash[_GPU_DESELECTED] = len(gpu_tests)
    extended = [item for item in items if item.get_closest_marker("extended")]
    if extended and os.environ.get(EXTENDED_ENV) != "1":
        # Second forms of what the default run already proves on four hosts: together about
        # 10 minutes on 2 cores, which CI's 90-minute limit does not leave (docs/testing.md).
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]
    groups = shared_fixture_groups(items)
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    if config.pluginmanager.has_plugin("hvdtest-xdist-groups"):
        config.pluginmanager.get_plugin("hvdtest-xdist-groups").record(config, groups)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test with the fixtures it starts holds the machine: alone if marked
    `whole_machine`, beside the other tests otherwise (support/machine.py)."""
    with machine.share(whole=item.get_closest_marker("whole_machine") is not None):
        return (yield)


def shared_fixture_groups(items):
    """{test: group} for the tests that share one of this suite's fixtures that outlive
    a test (a module's prepared data or trained model, the session's Slurm cluster or
    hosts), directly or through other fixtures: `pytest -n N --dist loadgroup` runs
    each group on one worker, so each such fixture starts once, as without xdist,
    and no two workers run a Slurm cluster or the two hosts side by side. A group is
    named after its widest fixture: "slurm_cluster", "two_hosts", "data_dir"."""
    widest = {"session": 0, "package": 1, "module": 2, "class": 3}
    parent = {}

    def root(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        keys = sorted((widest[definition.scope], definition.baseid, name)
                      for name, definitions in (info.name2fixturedefs.items() if info else ())
                      for definition in definitions[-1:]
                      if definition.scope != "function" and definition.baseid)  # baseid "": pytest's own
        if keys:
            shared[item] = keys[0]
            for key in keys[1:]:
                first, other = sorted((root(keys[0]), root(key)))
                parent[other] = first
    return {item: root(key)[2] for item, key in shared.items()}


def pytest_terminal_summary(terminalreporter, config):
    count = config.stash.get(_GPU_DESELECTED, 0)
    if count:
        terminalreporter.write_line(
            f"{count} GPU test{'s' if count != 1 else ''} deselected: no CUDA GPU visible "
            "(torch.cuda.is_available() is False); run them on a GPU machine with "
            "`.venv/bin/python -m pytest -m gpu tests`")


_GPU_DESELECTED = pytest.StashKey[int]()
