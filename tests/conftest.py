"""Pytest's hooks and the shared fixtures; the helpers themselves are in tests/support/.

Under CI=true a missing component fails; elsewhere it skips (support/needs.py).
"""
import os
import shutil
import tempfile

import pytest

from support import costs, machine
from support.bert_data import SESSION_DIR_ENV
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
    """A directory for what the session makes once (support/bert_data.py's once_per_session);
    the tests' CPU cost, reported at the end (support/costs.py); under pytest-xdist, its
    scheduler for the groups below (support/xdist_groups.py). The xdist workers start
    after this and inherit the environment."""
    if SESSION_DIR_ENV not in os.environ:
        os.environ[SESSION_DIR_ENV] = tempfile.mkdtemp(prefix="hvdtest-session-")
        config.stash[_SESSION_DIR] = os.environ[SESSION_DIR_ENV]
    config.pluginmanager.register(costs.Costs(), "hvdtest-costs")
    if config.pluginmanager.hasplugin("xdist"):
        from support import xdist_groups
        config.pluginmanager.register(xdist_groups, "hvdtest-xdist-groups")  # its pytest_configure runs now


TIER_ENV = "HVDTEST_TIER"  # test (the default: make test), scale (make test-scale) or all


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Deselect the `gpu` tests where no CUDA GPU is visible: the one exception to
    "under CI=true a missing component fails", since CI here has no GPU. Keep the
    tests of the tier asked for. Then group the tests that share a fixture for
    pytest-xdist."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and cuda_gpus() == 0:
        config.hook.pytest_deselected(items=gpu_tests)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.stash[_GPU_DESELECTED] = len(gpu_tests)
    tier = os.environ.get(TIER_ENV, "test")
    if tier not in ("test", "scale", "all"):
        raise pytest.UsageError(f"{TIER_ENV}={tier}: choose test, scale or all")
    if tier != "all":
        # `scale`: the larger forms (16 and 32 ranks, other launchers of a fault, 2.4 GB) of what
        # the default tier proves at its smallest real scale (docs/testing.md's table).
        wanted = [item for item in items if (item.get_closest_marker("scale") is not None) == (tier == "scale")]
        config.hook.pytest_deselected(items=[item for item in items if item not in wanted])
        items[:] = wanted
    groups = shared_fixture_groups(items)
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    config.pluginmanager.get_plugin("hvdtest-costs").groups.update({item.nodeid: group for item, group in groups.items()})
    if config.pluginmanager.has_plugin("hvdtest-xdist-groups"):
        config.pluginmanager.get_plugin("hvdtest-xdist-groups").record(config, groups)
    return (yield)


MACHINE = machine.Machine()  # this pytest process's hold on the cores


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test with the fixtures it starts holds the machine: alone if marked
    `whole_machine`, beside the other tests otherwise (support/machine.py); a run of
    whole-machine tests on one worker keeps it from the first to the last. A plan
    (`--setup-plan`, tests/test_suite.py) runs nothing and holds nothing."""
    if item.config.option.setupplan:
        return (yield)
    whole = item.get_closest_marker("whole_machine") is not None
    keep = nextitem is not None and nextitem.get_closest_marker("whole_machine") is not None
    with MACHINE.share(whole=whole, keep=keep):
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


def pytest_unconfigure(config):
    made = config.stash.get(_SESSION_DIR, None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


_GPU_DESELECTED = pytest.StashKey[int]()
_SESSION_DIR = pytest.StashKey[str]()
