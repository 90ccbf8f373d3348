"""`pytest -n N --dist loadgroup` with the groups conftest.py computes from the fixtures.

pytest-xdist 3.8 marks a group by appending "@group" to a test's node id, which
pytest 9's structured node ids no longer allow: the marks would be ignored and
each worker would start its own Slurm cluster and hosts. So the workers write
{node id: group} to a file at collection, and this scheduler (registered by
conftest.py where pytest-xdist is installed) reads it: a group's tests go to
one worker, the other tests one by one to whichever worker is free.
"""
import json
import os
import tempfile
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

GROUPS_FILE = "HVDTEST_XDIST_GROUPS"


def pytest_configure(config):
    """In the controller: where the workers (started after this) write their groups."""
    if not hasattr(config, "workerinput") and config.getvalue("dist") == "loadgroup":
        fd, path = tempfile.mkstemp(prefix="hvdtest-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_FILE] = path


def pytest_unconfigure(config):
    path = os.environ.get(GROUPS_FILE)
    if path and not hasattr(config, "workerinput"):
        Path(path).unlink(missing_ok=True)


def record(config, groups):
    """In a worker: {node id: group} for the controller's scheduler (every worker writes the same)."""
    path = os.environ.get(GROUPS_FILE)
    if path and hasattr(config, "workerinput"):
        text = json.dumps({item.nodeid: group for item, group in groups.items()})
        partial = f"{path}.{config.workerinput['workerid']}"
        Path(partial).write_text(text)
        os.replace(partial, path)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return FixtureGroupScheduling(config, log)
    return None


class FixtureGroupScheduling(LoadScopeScheduling):
    """LoadScopeScheduling whose scope is the test's group, or the test itself."""

    groups = None

    def _split_scope(self, nodeid):
        if self.groups is None:
            self.groups = json.loads(Path(os.environ[GROUPS_FILE]).read_text() or "{}")
        return self.groups.get(nodeid, nodeid)
