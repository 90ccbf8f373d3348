"""Which ranks are still alive: a heartbeat to rank 0 beside Horovod, so one line can name a lost node.

When a rank freezes, dies or is cut off from the network, every other rank
waits in its next collective and cannot tell why: Horovod's coordinator waits
in the same negotiation. So each rank also sends rank 0 a datagram every
BEAT_SECONDS from a daemon thread, and rank 0 answers each one. When the
progress watchdog (runtime/watchdog.py) finds no progress:

- rank 0 names the ranks it has not heard from for SILENT_SECONDS, with their
  hosts: one line for the whole job;
- every other rank stays quiet while it still hears rank 0: rank 0 speaks for
  the job, and its exit ends the others through the launcher;
- a rank that no longer hears rank 0 speaks for itself, unless rank 0 said it
  has spoken (a frozen rank woken by the launcher reads that first).

A frozen process sends nothing (SIGSTOP stops its threads too), a dead one
neither, and a cut-off host's datagrams do not arrive: from rank 0 the three
look the same, and the line says so. The cost: one datagram of a few dozen
bytes per rank every 2 s to rank 0 (256 a second at 512 ranks), and one
allgather of host names at start. UDP, so a lost datagram costs nothing and no
connection state grows with the job. Not under --elastic, whose world changes.
"""
import os
import socket
import threading
import time

import horovod.torch as hvd

from hvdtrain.launch.hosts import this_host

BEAT_SECONDS = 2.0
SILENT_SECONDS = 10.0  # not heard for this long: frozen, dead or cut off
# After a failed collective: not heard for this long (two beats and a margin), a rank is lost.
LOST_AFTER_SECONDS = 2 * BEAT_SECONDS + 0.5
LINGER_SECONDS = 15.0  # a quiet rank waits this long at most for rank 0's line
REPORTED = b"reported"  # rank 0 to every rank: the job's one line is out
PORT_ENV = "HVDTRAIN_HEARTBEAT_PORT"  # rank 0's UDP port (default: any free one)


class Peers:
    """This rank's side of the heartbeat: rank 0 listens and answers, every other rank beats."""

    def __init__(self, rank, hosts, root_addresses, sock, step=lambda: None):
        self.rank = rank
        self.hosts = hosts  # rank -> host name, the same list on every rank
        self.root_addresses = root_addresses  # where rank 0 listens: [(ip, port)]
        self.sock = sock
        self.step = step  # the latest finished step, sent along (for the record)
        self.started = time.monotonic()
        self.heard = {}  # rank 0: rank -> when it was last heard from
        self.senders = {}  # rank 0: rank -> the address its heartbeats come from
        self.answered = self.started  # other ranks: when rank 0 last answered
        self.reported = threading.Event()  # other ranks: rank 0 has printed the job's line
        target = self._listen if rank == 0 else self._beat
        threading.Thread(target=target, name="hvdtrain-heartbeat", daemon=True).start()

    def silent_ranks(self, seconds=SILENT_SECONDS):
        """Rank 0: {rank: seconds since it was last heard} of those silent for over ``seconds``.

        Only ranks heard at least once: where a firewall drops the heartbeat,
        nobody is named rather than everybody.
        """
        now = time.monotonic()
        return {rank: now - heard for rank, heard in self.heard.items() if now - heard > seconds}

    def who_is_silent(self):
        """Rank 0: "not heard from ranks 12-15 (all 4 on node-d) for 61 s: frozen, dead or cut off", or ""."""
        silent = self.silent_ranks()
        if not silent:
            return ""
        return (f"not heard from {self.describe(silent)} for {min(silent.values()):.0f} s: "
                "frozen, dead or cut off from the network")

    def hears_root(self, seconds=SILENT_SECONDS):
        """Another rank: did rank 0 answer within ``seconds``?"""
        return time.monotonic() - self.answered <= seconds

    def describe(self, ranks):
        """"ranks 12-15 (all 4 on node-d), rank 17 (1 of 4 on node-e)": who, grouped by host."""
        by_host = {}
        for rank in ranks:
            by_host.setdefault(self.hosts[rank], []).append(rank)
        parts = []
        for host, members in by_host.items():
            on_host = sum(1 for name in self.hosts if name == host)
            share = f"all {on_host}" if len(members) == on_host else f"{len(members)} of {on_host}"
            parts.append(f"{rank_list(members)} ({share} on {host})")
        return ", ".join(parts)

    def on_peer_failure(self):
        """A collective failed (a peer died or left): what this rank says about it (errors.report).

        Rank 0 waits a few beats for the lost ranks to fall silent and names them
        ("" when none did); another rank that still hears rank 0 stays quiet (None)
        and keeps beating until rank 0 has spoken or LINGER_SECONDS pass, so that
        rank 0 does not take it for lost too. A rank that no longer hears rank 0
        speaks for itself (""), unless rank 0 said it has spoken.
        """
        if self.rank == 0:
            deadline = time.monotonic() + LOST_AFTER_SECONDS + BEAT_SECONDS
            while not self.silent_ranks(LOST_AFTER_SECONDS) and time.monotonic() < deadline:
                time.sleep(0.2)
            if self.silent_ranks(LOST_AFTER_SECONDS):
                time.sleep(BEAT_SECONDS)  # the others lost with the first (a node's ranks) fall silent too
            silent = self.silent_ranks(LOST_AFTER_SECONDS)
            return f"lost {self.describe(silent)}" if silent else ""
        if self.reported.is_set():
            return None  # rank 0 has spoken already (e.g. its watchdog, before it exited)
        if not self.hears_root(LOST_AFTER_SECONDS):
            return ""
        self.reported.wait(LINGER_SECONDS)
        return None

    def announce_reported(self):
        """Rank 0, having printed the job's line: tell every rank, so that none adds its own.

        A frozen rank reads this when it wakes (the launcher continues it to end it).
        """
        for address in self.senders.values():
            try:
                self.sock.sendto(REPORTED, address)
            except OSError:
                pass

    def _listen(self):
        while True:
            try:
                data, sender = self.sock.recvfrom(256)
                rank = int(data.split(b" ", 1)[0])
            except (OSError, ValueError):
                continue
            if 0 < rank < len(self.hosts):
                self.heard[rank], self.senders[rank] = time.monotonic(), sender
                try:
                    self.sock.sendto(b"0", sender)
                except OSError:  # its network is gone: it stays unheard
                    pass

    def _beat(self):
        self.sock.settimeout(BEAT_SECONDS)
        while True:
            message = f"{self.rank} {self.step()}".encode()
            for address in self.root_addresses:
                try:
                    self.sock.sendto(message, address)
                except OSError:  # unreachable: rank 0 will not hear this rank, which is the point
                    pass
            deadline = time.monotonic() + BEAT_SECONDS
            while time.monotonic() < deadline:
                try:
                    answer, _ = self.sock.recvfrom(16)
                    self.answered = time.monotonic()
                    if answer == REPORTED:
                        self.reported.set()
                except socket.timeout:
                    break
                except OSError:  # a refused send, reported here: wait for the next beat
                    time.sleep(max(0.0, deadline - time.monotonic()))


def start(rank, step=lambda: None):
    """Every rank's heartbeat; a collective (rank 0's addresses out, the host names in)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", int(os.environ.get(PORT_ENV, "0")) if rank == 0 else 0))
    host = this_host()
    # Horovod: every rank learns every rank's host, and where rank 0 listens (a few bytes each).
    hosts = hvd.allgather_object(host, name="hvdtrain.peers.hosts")
    root = hvd.broadcast_object((_addresses(), sock.getsockname()[1]) if rank == 0 else None,
                                root_rank=0, name="hvdtrain.peers.root")
    addresses, port = root
    if host == hosts[0]:
        addresses = ["127.0.0.1"]  # rank 0's own node: the loopback always reaches it
    return Peers(rank, hosts, [(address, port) for address in addresses], sock, step)


def _addresses():
    """This node's IPv4 addresses other nodes may reach it at (not the loopback)."""
    import psutil  # Horovod's own dependency
    found = [entry.address for entries in psutil.net_if_addrs().values() for entry in entries
             if entry.family == socket.AF_INET and not entry.address.startswith("127.")]
    return found or ["127.0.0.1"]


def rank_list(ranks):
    """[3, 4, 5, 9] -> "ranks 3-5, 9"; [7] -> "rank 7"."""
    ranks = sorted(ranks)
    runs, start = [], 0
    for index in range(1, len(ranks) + 1):
        if index == len(ranks) or ranks[index] != ranks[index - 1] + 1:
            first, last = ranks[start], ranks[index - 1]
            runs.append(f"{first}" if first == last else f"{first}-{last}")
            start = index
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(runs)
