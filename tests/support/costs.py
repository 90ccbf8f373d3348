"""What each test costs in CPU-seconds, printed at the end of the run (a pytest plugin).

The suite is bound by CPU (two cores, every launched rank importing torch), so a test's
wall time says little: it waits on launchers and timeouts, beside other tests. What it
costs is the CPU of everything it starts. Each pytest process (an xdist worker, or the
one process without xdist) moves itself into a cgroup v1 ``cpuacct`` group of its own
when it can: every process it starts afterwards stays in it, including what runs under
the suite's sshd hosts and Slurm daemons and every orphan, and a test's cost is the
group's usage over its setup, call and teardown (tests on one worker run one after the
other; a daemon's idle ticks go to whichever test runs then). Where no such group can be
made, the worker's own and its reaped children's resource usage stands in, and the
summary says so (it misses what an sshd or slurmd started).
"""
import json
import os
import resource
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
PROPERTY = "cpu_seconds"
SHOWN = 20


def recorded_groups():
    """{node id: group} as the xdist workers wrote them for the scheduler (support/xdist_groups.py)."""
    path = os.environ.get("HVDTEST_XDIST_GROUPS")
    try:
        return json.loads(Path(path).read_text() or "{}") if path else {}
    except OSError:
        return {}


class Meter:
    """CPU-seconds used so far by this process and all it started (see the module's text)."""

    def __init__(self):
        self.group = None
        group = CPUACCT / f"hvdtest-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
            self.group = group
        except OSError:
            pass

    @property
    def kind(self):
        return "cgroup cpuacct" if self.group else "rusage of the reaped children"

    def seconds(self):
        if self.group:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(u.ru_utime + u.ru_stime for u in usage)

    def close(self):
        """Back to the root group; the group goes once nothing is left in it."""
        if self.group:
            try:
                (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
                self.group.rmdir()
            except OSError:
                pass


class Costs:
    """The plugin: measures in the process that runs a test, reports where the summary is printed."""

    def __init__(self):
        self.meter = Meter()
        self.started = {}
        self.costs = {}  # node id -> CPU-seconds (in the process that prints the summary)
        self.walls = {}  # node id -> seconds of setup, call and teardown
        self.groups = {}  # node id -> its xdist group (conftest.py's shared_fixture_groups)
        self.kinds = set()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self.started[item.nodeid] = self.meter.seconds()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if call.when == "teardown" and item.nodeid in self.started:
            spent = self.meter.seconds() - self.started.pop(item.nodeid)
            report.user_properties.append((PROPERTY, (round(spent, 2), self.meter.kind)))
        return report

    def pytest_runtest_logreport(self, report):
        self.walls[report.nodeid] = self.walls.get(report.nodeid, 0.0) + report.duration
        for name, value in report.user_properties:
            if name == PROPERTY and report.when == "teardown":
                self.costs[report.nodeid], kind = value
                self.kinds.add(kind)

    def pytest_terminal_summary(self, terminalreporter, config):
        if not self.costs:
            return
        write = terminalreporter.write_line
        total = sum(self.costs.values())
        terminalreporter.section("CPU cost of the tests")
        write(f"{total:.0f} CPU-s in {len(self.costs)} tests and what they started "
              f"({', '.join(sorted(self.kinds))}); the {SHOWN} costliest:")
        for nodeid, seconds in sorted(self.costs.items(), key=lambda cost: -cost[1])[:SHOWN]:
            write(f"{seconds:8.1f} s  {100 * seconds / (total or 1):4.1f} %  {nodeid}")  # total 0: pure-Python tests
        # A group's tests run one after another on one worker: the longest is the run's shortest possible time.
        self.groups = self.groups or recorded_groups()  # an xdist controller collects nothing itself
        groups = {}
        for nodeid, seconds in self.walls.items():
            group = self.groups.get(nodeid)
            if group:
                groups[group] = groups.get(group, 0.0) + seconds
        if groups:
            write("wall time of the groups that each run on one worker (setup, call, teardown): " + ", ".join(
                f"{name} {seconds:.0f} s" for name, seconds in sorted(groups.items(), key=lambda g: -g[1])[:6]))
        if getattr(config, "cache", None) is not None:  # every test's figures, for a closer look: .pytest_cache/v/hvdtest/costs
            config.cache.set("hvdtest/costs", {nodeid: {"cpu_s": self.costs.get(nodeid), "wall_s": round(wall, 2),
                                                        "group": self.groups.get(nodeid)}
                                               for nodeid, wall in self.walls.items()})

    def pytest_unconfigure(self):
        self.meter.close()
