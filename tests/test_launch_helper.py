"""The helpers every launcher test relies on: timeouts kill the whole group; a
whole-machine test runs alone."""
import os
import sys
import threading
import time

from support import machine
from support.launch import launch


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it only waits to be reaped by its parent.
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().split()[2] != "Z"


def test_timeout_kills_every_process_in_the_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    run = launch(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; echo started; wait"], timeout=2)
    assert run.timed_out
    assert time.monotonic() - started < 30
    assert "started" in run.output
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the background child outlived the timeout"


def test_timeout_also_kills_a_child_that_left_the_group_and_holds_the_output(tmp_path):
    """Open MPI starts each ssh to a remote host in a process group of its own; one that
    outlives mpirun (its host cut off) held the launch's output open, and the helper waited
    for the end of that output forever after killing the group (seen in CI: the suite hung
    in the two-host partition test). It belongs to the launch's session: that is killed too."""
    pid_file = tmp_path / "child.pid"
    holder = (f"import os, subprocess, time; child = subprocess.Popen(['sleep', '300'], process_group=0); "
              f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(300)")
    finished = {}
    worker = threading.Thread(target=lambda: finished.update(run=launch([sys.executable, "-c", holder], timeout=3)),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert "run" in finished, "the launch helper still waits 60 s after its 3 s timeout"
    assert finished["run"].timed_out and "started" in finished["run"].output
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_output_and_exit_status_come_back():
    run = launch(["bash", "-c", "echo one; echo two >&2; exit 3"], timeout=30)
    assert not run.timed_out
    assert run.returncode == 3
    assert "one" in run.output and "two" in run.output


def test_rank_output_reads_both_tag_styles():
    run = launch(["printf", "[0]<stdout>:gloo zero\n[1,1]<stdout>:mpi one\n[1,0]<stderr>:mpi zero\n"],
                 timeout=30)
    assert run.rank_output(0) == "gloo zero\nmpi zero"
    assert run.rank_output(1) == "mpi one"


def test_rank_output_reassembles_chunks_split_mid_line():
    # Measured under horovodrun --mpi: rank 1's text and its newline arrived as
    # two chunks with rank 0's whole line between them.
    run = launch(["printf", "[1,1]<stdout>:ok rank=1[1,0]<stdout>:ok rank=0\n[1,1]<stdout>:\n"
                  "launcher says hi\n"], timeout=30)
    assert run.rank_output(0) == "ok rank=0"
    assert run.rank_output(1) == "ok rank=1"


def test_a_whole_machine_test_waits_for_the_running_tests_and_goes_before_later_ones(tmp_path):
    """support/machine.py: a shared holder keeps a whole-machine request waiting; a shared
    request made while it waits comes after it, not beside the first holder. (Each thread a
    worker: a Machine of its own.)"""
    events = []

    def hold(whole, name):
        with machine.Machine(tmp_path).share(whole):
            events.append(f"{name} in")
            time.sleep(0.3)
            events.append(f"{name} out")

    whole, later = (threading.Thread(target=hold, args=(True, "whole")),
                    threading.Thread(target=hold, args=(False, "later")))
    with machine.Machine(tmp_path).share(False):
        whole.start()
        time.sleep(0.5)  # the whole-machine request is queued by now
        later.start()
        time.sleep(0.5)
        assert events == [], events
    whole.join(10)
    later.join(10)
    assert events == ["whole in", "whole out", "later in", "later out"], events


def test_consecutive_whole_machine_tests_keep_the_machine_between_them(tmp_path):
    """A worker whose next test needs the whole machine too keeps it: a shared request made
    during the first waits for the second to end, not only the first."""
    events = []
    worker = machine.Machine(tmp_path)

    def shared():
        with machine.Machine(tmp_path).share(False):
            events.append("shared in")

    with worker.share(True, keep=True):
        other = threading.Thread(target=shared)
        other.start()
        time.sleep(0.3)
    time.sleep(0.3)  # between the two tests: the shared request still waits
    assert events == [], events
    with worker.share(True, keep=False):
        events.append("second whole")
    other.join(10)
    assert events == ["second whole", "shared in"], events