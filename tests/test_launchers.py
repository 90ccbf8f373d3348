"""The launch forms outside Slurm, with the real launchers and the repository's hostfiles.

    horovodrun --hostfile FILE with a comment in FILE (fails; make_hostfile.py says why)
    horovodrun --host-discovery-script "python scripts/discover_hosts.py FILE" ...  (elastic, growing)

and mpirun and horovodrun across two real hosts (network namespaces with sshd,
see support/hosts.py). The one-machine forms with hostfiles/localhost* run as the
README writes them in test_readme.py.
"""
import contextlib
import os
import subprocess
import json
import sys
import time

import pytest

from support.checkpoints import any_checkpoint
from support.checks import ok, the_error_line
from support.launch import REPO, SCRIPTS, launch, python, wait_then
from support.hosts import INTERFACE, Hosts, require_hosts
from support.ranks import waits_held

HOSTFILES = REPO / "hostfiles"
TINY_CNN = [SCRIPTS / "train_cnn.py", "--model", "convnet", "--epochs", "1", "--max-steps", "3"]


def assert_two_rank_run(ran, output_dir):
    ok(ran)
    results = json.loads((output_dir / "results.json").read_text())
    assert results["world_size"] == 2 and results["steps"] == 3, results


def test_horovodrun_cannot_read_a_commented_hostfile_and_make_hostfile_says_why(need_horovod):
    """Why hostfiles/localhost-horovodrun has no comment header."""
    ran = launch(["horovodrun", "-np", "2", "--hostfile", HOSTFILES / "localhost",
                  sys.executable, "-c", "pass"], timeout=60)
    assert ran.returncode != 0, ran.describe()
    checked = python([SCRIPTS / "make_hostfile.py", "--hostfile", HOSTFILES / "localhost",
                      "--input-format", "horovodrun"], timeout=30)
    assert checked.returncode == 2
    assert "line 1: horovodrun --hostfile cannot read comments" in checked.output


def test_elastic_job_grows_when_the_discovered_hostfile_grows(need_horovod, tmp_path):
    hostfile, out = tmp_path / "hosts", tmp_path / "out"
    hostfile.write_text("# one slot to start with\nlocalhost slots=1\n")
    rank0 = out / "sizes-rank0.txt"

    def grow():  # atomically, as discover_hosts.py asks
        new = tmp_path / "hosts.new"
        new.write_text("localhost slots=2\n")
        new.replace(hostfile)

    watcher = wait_then(lambda: rank0.exists() and rank0.read_text().startswith("1 1\n"), grow, 200)
    discovery = f"{sys.executable} {SCRIPTS / 'discover_hosts.py'} {hostfile}"
    # --network-interface: an elastic job otherwise waits for two hosts to compare NICs.
    ran = launch(["horovodrun", "-np", "1", "--min-np", "1", "--max-np", "2", "--network-interface", "lo",
                  "--host-discovery-script", discovery,
                  sys.executable, REPO / "tests" / "workers" / "elastic_grow.py", out, 2], timeout=240)
    watcher.join(timeout=1)
    ok(ran)
    seen0 = rank0.read_text().split("\n")
    assert seen0[0] == "1 1" and "2 2" in seen0, seen0  # alone first, then two ranks agreeing
    assert "2 2" in (out / "sizes-rank1.txt").read_text().split("\n")


# ---------------------------------------------------------------- two hosts
def two_host_hostfile(tmp_path, fmt):
    """hvd-a and hvd-b with one slot each, written by make_hostfile.py."""
    path = tmp_path / f"hosts.{fmt}"
    made = python([SCRIPTS / "make_hostfile.py", "--hosts", "hvd-a:1,hvd-b:1", "--format", fmt,
                   "-o", path], timeout=30)
    ok(made)
    return path


def test_mpirun_across_two_hosts(need_horovod, need_mpi, two_hosts, tmp_path):
    """One slot per host and no oversubscription: rank 1 can only run on hvd-b, over ssh."""
    hostfile = two_host_hostfile(tmp_path, "openmpi")
    ran = launch(two_hosts.on_first([
        *two_hosts.mpirun(2, hostfile), sys.executable, *TINY_CNN, "--output-dir", tmp_path / "run"]),
        timeout=240, env={**two_hosts.env(), "OMPI_MCA_rmaps_base_oversubscribe": "0"})
    assert_two_rank_run(ran, tmp_path / "run")


def test_horovodrun_across_two_hosts(need_horovod, two_hosts, tmp_path):
    hostfile = two_host_hostfile(tmp_path, "horovodrun")
    ran = launch(two_hosts.on_first([
        "horovodrun", "-np", "2", "--hostfile", hostfile, "--gloo", "--network-interface", INTERFACE,
        sys.executable, *TINY_CNN, "--output-dir", tmp_path / "run"]),
        timeout=240, env=two_hosts.env())
    assert_two_rank_run(ran, tmp_path / "run")


@pytest.mark.parametrize("names", [pytest.param("distinct", marks=pytest.mark.scale), "one host name"])
def test_a_partitioned_host_ends_an_mpirun_job_with_one_line_naming_it(need_horovod, need_mpi, two_hosts, tmp_path,
                                                                       names):
    """hvd-b's link goes down mid-training (its processes alive, its packets lost): mpirun cannot
    reach hvd-b's daemon to end the job, so rank 0, having named the lost rank, ends mpirun.
    "one host name": hvd-b says it is hvd-a too (cloned VMs); the heartbeat tells the nodes apart
    by kernel and network namespace, names hvd-b by its address, and mpirun still ends."""
    hostfile = two_host_hostfile(tmp_path, "openmpi")
    out = tmp_path / "run"
    cut = {}

    def partition(hold):
        cut["at"] = time.monotonic()
        two_hosts.link("hvd-b", "down")
        hold()  # both ranks now wait in MPI, which polls

    watcher = None
    try:
        with waits_held(str(out), 2) as hold, \
                (two_hosts.named("hvd-b", "hvd-a") if names == "one host name" else contextlib.nullcontext()):
            # Training has begun once the first periodic checkpoint is on disk.
            watcher = wait_then(lambda: any_checkpoint(out), lambda: partition(hold), 200)
            ran = launch(two_hosts.on_first([
                *two_hosts.mpirun(2, hostfile, pass_env=["HVDTRAIN_WATCHDOG_FLOOR_SECONDS"]),
                sys.executable, SCRIPTS / "train_cnn.py", "--dataset", "synthetic", "--synthetic-samples", "100000",
                "--model", "convnet", "--image-size", "8", "--epochs", "20", "--checkpoint-every", "10",
                "--output-dir", out]),
                timeout=400, env={**two_hosts.env(), "OMPI_MCA_rmaps_base_oversubscribe": "0",
                                  "HVDTRAIN_WATCHDOG_FLOOR_SECONDS": "20"})
        ended = time.monotonic()
    finally:
        if watcher is not None:
            watcher.join(timeout=1)
        two_hosts.link("hvd-b", "up")  # for the next tests
    assert "at" in cut, ran.describe()
    assert not ran.timed_out and ran.returncode != 0, ran.describe()
    assert ended - cut["at"] < 120, f"ended {ended - cut['at']:.0f} s after the partition\n{ran.describe()}"
    lost = ("rank 1 (all 1 on hvd-b)" if names == "distinct"
            else f"rank 1 (all 1 on the node at {two_hosts.addresses['hvd-b']}, one of 2 named hvd-a)")
    the_error_line(ran.output, f"not heard from {lost}", shown=ran.describe())
    warnings = [line for line in ran.output.splitlines() if "nodes report the host name" in line]
    assert warnings == ([] if names == "distinct" else [
        "warning: 2 nodes report the host name hvd-a (cloned machines or containers?): "
        "the job's lines name a lost one by its address"]), ran.describe()
    print(f"partition: the job ended {ended - cut['at']:.0f} s after hvd-b's link went down")


def test_simulated_hosts_side_by_side_survive_each_other_s_end():
    """Two instances of support/hosts.py side by side (the suite's two and four hosts, tools/chaos.py
    --hosts): the first one stopped removed sshd's privilege separation directory, which it had
    created, and the other's sshd reset every connection from then on (a make test-scale run:
    15 four-host tests failed with `kex_exchange_identification: Connection reset by peer`)."""
    require_hosts()
    first = Hosts(["solo-a"], "10.81.0").start()
    try:
        second = Hosts(["solo-b"], "10.82.0").start()
    finally:
        first.stop()
    try:
        probe = subprocess.run(second.on_first(["ssh", "solo-b", "hostname"]), env={**os.environ, **second.env()},
                               capture_output=True, text=True, timeout=30)
        assert probe.stdout.strip() == "solo-b", probe.stderr
    finally:
        second.stop()
