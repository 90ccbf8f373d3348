"""Sixteen ranks on one machine (`mpirun --oversubscribe`, one thread per rank): what changes with N.

A fault at 16 ranks must still read as one line naming who failed, not one
line per surviving rank.
"""
import re
import sys
import time

import pytest

from support.checks import error_lines
from support.commands import CNN
from support.fault_cells import LIMITS, injected_at
from support.launch import launch

RANKS = 16
MPIRUN = ["mpirun", "-np", str(RANKS), "--oversubscribe", "--bind-to", "none"]
SMALL = ["--model", "convnet", "--image-size", "8", "--batch-size", "4", "--threads", "1", "--epochs", "2"]


# What each fault at 16 ranks must end in, with the default settings (the heartbeat's judgement,
# liveness/judge.py): who is faulted, and the line that names it. The seconds are fault_cells.LIMITS.
AT_SIXTEEN = {
    "stop": ("rank=12-15,step=5,kind=stop",  # a node's worth frozen at once: the 12 others stay quiet
             r"rank 0: error: .*not heard from ranks 12-15 \(4 of 16 on .*certain, not a limit"),
    # mpirun names a killed rank itself, often before rank 0's judge does ("rank 13 (1 of 16 on vm) has exited")
    "kill": ("rank=13,step=5,kind=kill",
             r"mpirun noticed that process rank 13 .* signal 9|rank 0: error: .*rank 13 \(1 of 16 on \S+\) has exited"),
    "diverge": ("rank=13,step=5,kind=skip-vote",
                r"rank 0: error: .*; rank 13 waits in .*the ranks made different collectives.*certain, not a limit"),
}


@pytest.mark.scale  # at 2 ranks under each launcher: test_faults.py; a node at 2x2: test_four_nodes.py
@pytest.mark.whole_machine
@pytest.mark.parametrize("fault", AT_SIXTEEN)
def test_a_fault_at_16_ranks_ends_the_job_within_its_bound_in_one_line(tmp_path, need_horovod, need_mpi, fault):
    """A frozen node, a dead rank, a rank-divergent collective at 16 ranks end the job within the
    same bounds as at 2 (a frozen rank 15 s, a dead one 5 s, a divergence 10 s after the fault),
    with the default watchdog settings, in one line naming the ranks."""
    spec, naming = AT_SIXTEEN[fault]
    run = launch([*MPIRUN, sys.executable, CNN, *SMALL, "--output-dir", tmp_path / "run"], timeout=300,
                 env={"HVDTRAIN_FAULT": spec})
    after = time.time() - injected_at(run.output)
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert after < LIMITS[fault], f"ended {after:.1f} s after the fault\n{run.describe()}"
    line = re.search(naming, run.output)
    assert line and len(error_lines(run.output)) <= 1, run.describe()
    print(f"{fault} at {RANKS} ranks: ended {after:.1f} s after the fault: {line.group(0)[:200]}")


def test_the_job_speaks_through_rank_0_else_its_deputy_else_each_rank_itself(need_horovod):
    """Who prints the job's one line, as each rank sees it (liveness/peers.py): rank 0 while
    heard; the first rank on another host (rank 1 on one host) when rank 0 is silent (its node
    is the one lost); a rank that hears neither speaks for itself."""
    from hvdtrain.liveness import peers

    hosts = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    assert peers.deputy_of(hosts) == 4 and peers.deputy_of(["a", "a"]) == 1 and peers.deputy_of(["a"]) is None
    now = time.monotonic()
    rank_9 = peers.Peers(9, hosts, listeners={})  # no sockets: no threads, the decision only
    rank_9.answered = {0: now, 4: now}
    assert rank_9.speaker() == 0
    rank_9.answered[0] = now - 11
    assert rank_9.speaker() == 4 and not rank_9.listens
    rank_9.answered[4] = now - 11
    assert rank_9.speaker() == 9 and rank_9.who_is_silent() == ""
    deputy = peers.Peers(4, hosts, listeners={})
    deputy.answered = {0: now}
    assert deputy.speaker() == 0 and deputy.listens
    deputy.answered[0] = now - 11
    deputy.heard = {rank: now - 11 if rank < 4 else now for rank in range(12) if rank != 4}
    assert deputy.speaker() == 4
    assert deputy.who_is_silent().startswith("not heard from ranks 0-3 (all 4 on a) for 11 s")
    rank_9.reported.set()  # the speaker's line is out: a failed collective adds none
    assert rank_9.on_peer_failure() is None


def test_a_rank_whose_watchdog_spoke_keeps_the_speaker_quiet(need_horovod):
    """Rank 1, stuck outside any collective, prints the job's line and exits; rank 0's collective
    then fails. Rank 1 tells the listeners before it exits, so rank 0 adds no second line (it
    did, where the launcher was slow to end it: a CI run under load)."""
    from hvdtrain.liveness import peers

    listening, beating = peers._udp_socket(0), peers._udp_socket(0)
    rank_0 = peers.Peers(0, ["a", "a"], listeners={}, listening=listening)
    rank_1 = peers.Peers(1, ["a", "a"], listeners={0: [("127.0.0.1", listening.getsockname()[1])]},
                         beating=beating)
    deadline = time.monotonic() + 5
    while 0 not in rank_1.answered_once and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 1 in rank_0.heard and 0 in rank_1.answered_once
    rank_1.announce_reported()  # its watchdog's line is out
    started = time.monotonic()
    assert rank_0.on_peer_failure() is None
    assert time.monotonic() - started < 1


def test_a_rank_is_lost_for_a_time_only_where_the_heartbeat_was_heard(need_horovod):
    """Peers.lost_for, which cuts a long phase short (liveness/watchdog.py): the speaking
    listener judges by the ranks it heard; another rank only once it heard the listeners and
    no longer does; never under the heartbeat's resolution (SILENT_SECONDS)."""
    from hvdtrain.liveness import peers

    hosts = ["a"] * 4 + ["b"] * 4
    now = time.monotonic()
    rank_0 = peers.Peers(0, hosts, listeners={})
    rank_0.heard = {rank: now for rank in range(1, 8)}
    assert not rank_0.lost_for(20)
    rank_0.heard[6] = now - 12
    assert rank_0.lost_for(5) and not rank_0.lost_for(20)  # 5 s: judged at SILENT_SECONDS, 8 s
    assert peers.judged_limit(5) == peers.SILENT_SECONDS == 8 and peers.judged_limit(20) == 20
    rank_6 = peers.Peers(6, hosts, listeners={})
    rank_6.answered = {0: now - 30, 4: now - 30}
    assert not rank_6.lost_for(20)  # never heard either (a firewall): nobody is known lost
    rank_6.answered_once = {0, 4}
    assert rank_6.lost_for(20)
    rank_6.answered[4] = now
    assert not rank_6.lost_for(20)  # the deputy is heard: it judges, and speaks


def test_nodes_are_told_apart_by_more_than_their_host_names(need_horovod):
    """Cloned VMs or containers that report one host name are still two nodes: the second is
    rank 0's deputy, and a lost one is named by the address its heartbeat came from."""
    from hvdtrain.liveness import peers

    hosts, nodes = ["a", "a", "a", "a"], ["boot1/net1", "boot1/net1", "boot2/net1", "boot2/net1"]
    assert peers.shared_names(hosts, nodes) == {"a": 2} and peers.shared_names(hosts, hosts) == {}
    rank_0 = peers.Peers(0, hosts, listeners={}, nodes=nodes)
    assert rank_0.deputy == 2
    rank_0.senders = {1: ("127.0.0.1", 40000), 2: ("10.0.0.2", 40001), 3: ("10.0.0.2", 40002)}
    assert rank_0.ranks_by_node([2, 3]) == "ranks 2-3 (all 2 on the node at 10.0.0.2, one of 2 named a)"
    assert rank_0.ranks_by_node([1]) == "rank 1 (1 of 2 on rank 0's own node, one of 2 named a)"
    boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
    assert peers.this_node().startswith(f"{boot_id}/")  # then this process's network namespace
