"""Which ranks are still alive: a heartbeat beside Horovod, so one line can name a lost node.

When a rank freezes, dies or is cut off from the network, every other rank
waits in its next collective and cannot tell why: Horovod's coordinator waits
in the same negotiation. So two ranks listen, rank 0 and its deputy (the first
rank on another node than rank 0's; rank 1 on one node), and every rank sends each of them a
datagram every BEAT_SECONDS from a daemon thread, carrying its flight-recorder
status; each listener answers with what the job does now. The listener that
speaks judges the statuses once a second (``judge``, liveness/judge.py) and ends
the job as soon as a hang is certain; when the progress watchdog
(liveness/watchdog.py) finds no progress, or a collective fails, one rank speaks
for the job (``speaker``) too:

- rank 0, naming the ranks it has not heard from for SILENT_SECONDS, with their
  hosts: one line for the whole job;
- where rank 0 is not heard (its node froze, died or was cut off), the deputy,
  naming them the same way (rank 0's among them); the launcher, on another
  node, ends the job when the deputy exits;
- a rank that hears neither speaks for itself, unless a listener said it has
  spoken (a frozen rank woken by the launcher reads that first).

Every other rank stays quiet while it hears the one that speaks: that rank's
exit ends the others through the launcher. A frozen process sends nothing
(SIGSTOP stops its threads too), a dead one neither, and a cut-off host's
datagrams do not arrive: from a listener the three look the same, and the line
says so. The cost: one datagram of a few dozen bytes per rank every 2 s to each
of two ranks (256 a second each at 512 ranks), and one allgather of host names
and node ids at start. UDP, so a lost datagram costs nothing and no connection state grows
with the job. On one host the deputy is rank 1: it speaks when rank 0's process
alone froze. Not under --elastic, whose world changes.

A node is told from another by its kernel's boot id and its network namespace
(``this_node``), not by its host name: cloned VMs and containers may all say
they are ``node-a``. Trusting the name, a rank on the second such node took rank
0 for a neighbour, beat to its own loopback and was never heard, and the job
had no deputy; so a lost node went unnamed. Names shared by several nodes are
said once at start, and a lost one is named by its address.
"""
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from hvdtrain.liveness import judge as judging, recorder as flight, teardown

BEAT_SECONDS = 2.0
# Not heard for this long (four beats): frozen, dead or cut off. A datagram lost now and then, or a
# beat late under load, is not four in a row.
SILENT_SECONDS = 8.0
# After a failed collective: not heard for this long (two beats and a margin), a rank is lost.
LOST_AFTER_SECONDS = 2 * BEAT_SECONDS + 0.5
LINGER_SECONDS = 15.0  # a quiet rank waits this long at most for the speaker's line
REPORTED = b"reported"  # a listener to every rank: the job's one line is out
DATAGRAM = 2048  # a beat: the rank, then its flight-recorder status (recorder.FlightRecorder.status), as JSON
SUMMARY_SECONDS = 1.0  # a listener recomputes the summary its answers carry at most this often
PORT_ENV = "HVDTRAIN_HEARTBEAT_PORT"  # rank 0's UDP port (default: any free one); the deputy's is the next


class Peers:
    """This rank's side of the heartbeat: rank 0 and the deputy listen and answer, every rank beats."""

    def __init__(self, rank, hosts, listeners, beating=None, listening=None, step=lambda: None, nodes=None,
                 status=None):
        self.rank = rank
        self.hosts = hosts  # rank -> host name, the same list on every rank
        self.nodes = hosts if nodes is None else nodes  # rank -> node (this_node), the same on every rank
        self.named_alike = shared_names(self.hosts, self.nodes)  # host name -> nodes, where more than one
        self.deputy = deputy_of(self.nodes)
        self.listeners = listeners  # {0 or the deputy: [(ip, port)]}, those this rank beats to
        self.beating = beating  # this rank's socket for its beats and the answers
        self.listening = listening  # a listener's socket: beats in, answers and the announcement out
        self.step = step  # the latest finished step, sent along (for the record)
        self.status = status  # () -> this rank's flight-recorder status (a dict), sent along; None: the step
        self.statuses = {}  # a listener: rank -> the latest status it sent (raw JSON bytes)
        self.received = [0, 0]  # a listener: datagrams and bytes heard (tools/liveness_sim.py reads them)
        self.summary = ""  # what the listeners say the job does now (their answers carry it)
        # How long the longest-waiting rank had waited in a collective, as a listener last said, and when
        self.longest_wait = (0.0, None)
        self._summary_made = 0.0
        self.started = time.monotonic()
        self.heard = {}  # a listener: rank -> when it was last heard from
        self.senders = {}  # a listener: rank -> the address its heartbeats come from
        self.answered = {listener: self.started for listener in listeners}  # listener -> when it last answered
        self.answered_once = set()  # listeners that answered at least once (a firewall may drop every beat)
        self.reported = threading.Event()  # a listener has printed the job's line
        if listening is not None:
            threading.Thread(target=self._listen, name="hvdtrain-heartbeat-listen", daemon=True).start()
        if listeners:
            threading.Thread(target=self._beat, name="hvdtrain-heartbeat", daemon=True).start()

    @property
    def listens(self):
        return self.rank in (0, self.deputy)

    def hears(self, listener, seconds=SILENT_SECONDS):
        """Did rank ``listener`` (0 or the deputy) answer within ``seconds``? A rank hears itself."""
        return listener == self.rank or time.monotonic() - self.answered.get(listener, float("-inf")) <= seconds

    def hears_root(self, seconds=SILENT_SECONDS):
        return self.hears(0, seconds)

    def speaker(self, seconds=SILENT_SECONDS):
        """The rank that speaks for the job now, as this rank sees it: rank 0 while heard, else the
        deputy while heard (or this rank, being it), else this rank itself."""
        for listener in (0, self.deputy):
            if listener is not None and self.hears(listener, seconds):
                return listener
        return self.rank

    def lost_for(self, seconds):
        """Has this rank lost ranks for ``seconds`` (never under SILENT_SECONDS, the heartbeat's
        resolution: see ``judged_limit``)? The speaking listener: ranks it heard are silent that
        long. Any other rank: it heard rank 0 and the deputy once and now hears neither.
        Never where the heartbeat was never heard: nobody is known lost."""
        seconds = judged_limit(seconds)
        if self.speaker(seconds) != self.rank:
            return False  # a listener is heard: it judges, and speaks
        if self.listens:
            return bool(self.silent_ranks(seconds))
        return bool(self.answered_once)

    def silent_ranks(self, seconds=SILENT_SECONDS):
        """A listener: {rank: seconds since it was last heard} of those silent for over ``seconds``.

        Only ranks heard at least once: where a firewall drops the heartbeat,
        nobody is named rather than everybody.
        """
        now = time.monotonic()
        return {rank: now - heard for rank, heard in self.heard.items() if now - heard > seconds}

    def who_is_silent(self, seconds=SILENT_SECONDS):
        """A listener: "not heard from ranks 12-15 (all 4 on node-d) for 61 s: frozen, dead or cut off", or ""."""
        silent = self.silent_ranks(seconds)
        if not silent:
            return ""
        return (f"not heard from {self.ranks_by_node(silent)} for {min(silent.values()):.0f} s: "
                "frozen, dead or cut off from the network")

    def ranks_by_node(self, ranks):
        """"ranks 12-15 (all 4 on node-d), rank 17 (1 of 4 on node-e)": who, grouped by node."""
        by_node = {}
        for rank in sorted(ranks):
            by_node.setdefault(self.nodes[rank], []).append(rank)
        parts = []
        for node, members in by_node.items():
            on_node = self.nodes.count(node)
            share = f"all {on_node}" if len(members) == on_node else f"{len(members)} of {on_node}"
            parts.append(f"{rank_list(members)} ({share} on {self._node_name(node, members[0])})")
        return ", ".join(parts)

    def _node_name(self, node, rank):
        """The node's host name; where other nodes have that name too, which one it is."""
        host = self.hosts[rank]
        namesakes = self.named_alike.get(host)
        if not namesakes:
            return host
        address = self.senders.get(rank, ("",))[0]
        if node == self.nodes[self.rank]:
            where = f"rank {self.rank}'s own node"
        else:
            where = f"the node at {address}" if address else "a node"
        return f"{where}, one of {namesakes} named {host}"

    def judge(self):
        """The speaking listener: what is certain about the job now (judge.Verdict), or None."""
        statuses = self.heard_statuses()
        now = time.monotonic()
        received = {rank: self.heard.get(rank, now) for rank in statuses}
        received[self.rank] = now
        return judging.verdict(statuses, received, len(self.hosts), self.who_fell_silent,
                               lambda: self.who_exited(statuses), rank_list)

    def who_fell_silent(self):
        """who_is_silent once a rank has been silent for SILENT_SECONDS, naming with it every rank that fell
        silent within a beat of it: a node's ranks stop together, and their last beats are up to a beat apart."""
        return self.who_is_silent(SILENT_SECONDS - BEAT_SECONDS) if self.silent_ranks() else ""

    def fell_silent(self):
        """The ranks who_fell_silent names."""
        return list(self.silent_ranks(SILENT_SECONDS - BEAT_SECONDS)) if self.silent_ranks() else []

    def wake(self, ranks):
        """SIGCONT the processes of ``ranks`` on this node (frozen ones, judged lost): woken, each reads
        that the job's line is out and leaves quietly, instead of holding its launcher's teardown (which
        sends a stopped process SIGTERM, pending until SIGKILL 5 s later under horovodrun)."""
        for rank in ranks:
            if self.nodes[rank] != self.nodes[self.rank] or rank not in self.statuses:
                continue
            try:
                namespace, _, pid = str(json.loads(self.statuses[rank]).get("process", "")).partition("/")
                if namespace == flight.PID_NAMESPACE != "?" and pid.isdigit():
                    os.kill(int(pid), signal.SIGCONT)
            except (ValueError, OSError):
                pass

    def who_exited(self, statuses):
        """A listener: "rank 3 (1 of 4 on node-a) has exited" for the ranks on its own node whose
        process is gone (looked up by the pid each status carries, in this pid namespace), or ""."""
        here, namespace = self.nodes[self.rank], flight.PID_NAMESPACE
        gone = []
        for rank in range(len(self.nodes)):
            if rank == self.rank or self.nodes[rank] != here or rank not in self.statuses:
                continue
            status = statuses.get(rank)
            if status is None:
                try:
                    status = json.loads(self.statuses[rank])
                except ValueError:
                    continue
            process_namespace, _, pid = str(status.get("process", "")).partition("/")
            if process_namespace == namespace != "?" and pid.isdigit() and not _runs(int(pid)):
                gone.append(rank)
        if not gone:
            return ""
        return f"{self.ranks_by_node(gone)} {'has' if len(gone) == 1 else 'have'} exited (the process is gone)"

    def others_waited(self):
        """Seconds the longest-waiting rank has waited in a collective (0 when none waits), as this
        rank's statuses (a listener) or its listeners' latest answer say; None where no listener has
        answered: there is no heartbeat to ask."""
        if self.listens and self.status is not None:
            return max((status.get("blocked", 0.0) for rank, status in self.heard_statuses().items()
                        if rank != self.rank), default=0.0)
        waited, said = self.longest_wait
        if said is None:
            return None
        return waited + (time.monotonic() - said if waited else 0.0)

    def on_peer_failure(self):
        """A collective failed (a peer died or left): what this rank says about it (failures.report).

        The speaker (rank 0, or the deputy once rank 0 is silent for
        LOST_AFTER_SECONDS) waits a few beats for the lost ranks to fall silent
        and names them ("" when none did). Another rank stays quiet (None) while
        it hears the speaker, and keeps beating until the line is out or
        LINGER_SECONDS pass, so that the speaker does not take it for lost too.
        A rank that hears no listener speaks for itself (""), unless one said it
        has spoken.
        """
        deadline = time.monotonic() + LINGER_SECONDS
        while not self.reported.is_set():
            if self.speaker(LOST_AFTER_SECONDS) == self.rank:
                return self._name_the_lost() if self.listens else ""
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return None  # the speaker has spoken, or is heard and will

    def on_mismatch(self):
        """Horovod found a mismatch (one collective, different tensors on the ranks): every rank raises.

        Each beats at once, its status carrying its side (recorder.FlightRecorder.failed); the
        speaker waits up to two beats for every rank's side and returns them for its line,
        "rank 0: user.metric float32[3] at m.py:10; rank 1: user.metric float32[4] at m.py:10";
        the others stay quiet (None) until it has spoken.
        """
        self.beat_now()
        if self.speaker(LOST_AFTER_SECONDS) != self.rank:
            self.reported.wait(LINGER_SECONDS)
            return None
        statuses = self.heard_statuses()
        deadline = time.monotonic() + 2 * BEAT_SECONDS
        while time.monotonic() < deadline and not all("failed" in status for status in statuses.values()):
            time.sleep(0.1)
            statuses = self.heard_statuses()
        return flight.sides(statuses, rank_list)

    def beat_now(self):
        """One beat now, outside the heartbeat's rhythm (a status the listeners must have at once)."""
        if self.beating is not None:
            self._to_listeners(self._message())

    def _to_listeners(self, message):
        """``message`` to every listener this rank beats to (a lost datagram costs nothing)."""
        for addresses in self.listeners.values():
            for address in addresses:
                try:
                    self.beating.sendto(message, address)
                except OSError:
                    pass

    def _name_the_lost(self):
        deadline = time.monotonic() + LOST_AFTER_SECONDS + BEAT_SECONDS
        while not self.silent_ranks(LOST_AFTER_SECONDS) and time.monotonic() < deadline:
            # A process on this node that is gone: no need to wait for it to fall silent. Asked
            # again each time: a killed process's sockets close (failing this rank's collective)
            # before the process is gone, and once that took the launcher's whole grace (5 s).
            if self.reported.is_set():
                return None
            exited = self.who_exited(self.heard_statuses())
            if exited:
                return exited
            if self.reported.wait(0.2):
                return None  # the rank that ended the job said why itself
        if self.silent_ranks(LOST_AFTER_SECONDS):
            # the others lost with the first (a node's ranks) fall silent too
            if self.reported.wait(BEAT_SECONDS):
                return None
        silent = self.silent_ranks(LOST_AFTER_SECONDS)
        if silent:  # a lost node, as after the watchdog's line: its launcher may never end the job
            teardown.end_a_stuck_launcher()
        return f"lost {self.ranks_by_node(silent)}" if silent else ""

    def announce_reported(self):
        """This rank has printed the job's line: tell every rank, so that none adds its own.

        A listener tells every rank it hears (a frozen rank reads this when it wakes: the launcher
        continues it to end it). Any other rank (its watchdog found it stuck outside a collective)
        tells the listeners, which pass it on: its exit fails the others' collectives next, and
        rank 0 would otherwise name it lost in a second line when the launcher is slow to end it.
        """
        self.reported.set()
        if self.listening is not None:
            for address in self.senders.values():
                try:
                    self.listening.sendto(REPORTED, address)
                except OSError:
                    pass
        elif self.beating is not None:
            self._to_listeners(REPORTED)

    def heard_statuses(self, seconds=SILENT_SECONDS):
        """A listener: {rank: status} of the ranks heard within ``seconds``, this rank's own included."""
        now = time.monotonic()
        found = {}
        for rank, raw in list(self.statuses.items()):
            if now - self.heard.get(rank, float("-inf")) <= seconds:
                try:
                    found[rank] = json.loads(raw)
                except ValueError:
                    pass
        if self.status is not None:
            found[self.rank] = self.status()
        return found

    def _answer(self):
        """A listener's answer to a beat: "RANK|WAITED|SUMMARY": its rank, how long the longest-waiting
        rank has waited in a collective, and what the job does now (``summary``)."""
        now = time.monotonic()
        if now - self._summary_made > SUMMARY_SECONDS and self.status is not None:
            self._summary_made = now
            statuses = self.heard_statuses()
            self.summary = job_summary(statuses)
            self.longest_wait = (max((status.get("blocked", 0.0) for status in statuses.values()), default=0.0), now)
        return f"{self.rank}|{self.longest_wait[0]:.1f}|{self.summary}".encode()[:DATAGRAM]

    def _listen(self):
        while True:
            try:
                data, sender = self.listening.recvfrom(DATAGRAM)
                if data == REPORTED:  # a rank printed the job's line itself
                    if not self.reported.is_set():
                        self.announce_reported()
                    continue
                head, _, status = data.partition(b" ")
                rank = int(head)
            except (OSError, ValueError):
                continue
            self.received[0], self.received[1] = self.received[0] + 1, self.received[1] + len(data)
            if 0 <= rank < len(self.hosts) and rank != self.rank:
                self.heard[rank], self.senders[rank] = time.monotonic(), sender
                if status.startswith(b"{"):
                    self.statuses[rank] = status
                try:
                    self.listening.sendto(self._answer(), sender)
                except OSError:  # its network is gone: it stays unheard
                    pass

    def _beat(self):
        beating = self.beating
        beating.settimeout(BEAT_SECONDS)
        while True:
            message = self._message()
            for addresses in self.listeners.values():
                for address in addresses:
                    try:
                        beating.sendto(message, address)
                    except OSError:  # unreachable: the listener will not hear this rank, which is the point
                        pass
            deadline = time.monotonic() + BEAT_SECONDS
            while time.monotonic() < deadline:
                try:
                    answer, _ = beating.recvfrom(DATAGRAM)
                except socket.timeout:
                    break
                except OSError:  # a refused send, reported here: wait for the next beat
                    time.sleep(max(0.0, deadline - time.monotonic()))
                    continue
                if answer == REPORTED:
                    self.reported.set()
                    continue
                head, _, rest = answer.partition(b"|")
                waited, _, summary = rest.partition(b"|")
                if head.isdigit() and int(head) in self.answered:
                    now = time.monotonic()
                    self.answered[int(head)] = now
                    self.answered_once.add(int(head))
                    try:
                        self.longest_wait = (float(waited), now)
                    except ValueError:
                        pass
                    self.summary = summary.decode(errors="replace")

    def _message(self):
        """A beat: "RANK {status JSON}", or "RANK STEP" without a recorder."""
        if self.status is None:
            return f"{self.rank} {self.step()}".encode()
        try:
            text = json.dumps(self.status(), separators=(",", ":"))
        except Exception:  # noqa: BLE001 - a beat must go out, status or not
            text = "{}"
        return f"{self.rank} {text}".encode()[:DATAGRAM]


def judged_limit(seconds):
    """The shortest time after which the heartbeat can call a rank lost: ``seconds``, or
    SILENT_SECONDS where that is shorter (a beat every 2 s, datagrams may be lost)."""
    return max(seconds, SILENT_SECONDS)


def deputy_of(nodes):
    """The first rank on another node than rank 0's, else rank 1 (None alone): it speaks when rank 0 cannot."""
    other = next((rank for rank, node in enumerate(nodes) if node != nodes[0]), None)
    return other if other is not None else 1 if len(nodes) > 1 else None


def _runs(pid):
    """Is process ``pid`` (of this pid namespace) still running? A zombie has exited."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def this_host():
    """This process's host as its launcher knows it: horovodrun's name for it (also what
    elastic discovery lists), else the machine's host name. One name for one host in
    every line the job prints (a lost rank's, a straggler's)."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def this_node():
    """What tells this node from the others where host names may not: the kernel's boot id (one
    per machine, a cloned VM's included) and the network namespace (one per container)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:  # not Linux: the host name is all there is
        return socket.gethostname()


def shared_names(hosts, nodes):
    """{host name: how many nodes report it} for the names more than one node reports."""
    nodes_named = {}
    for host, node in zip(hosts, nodes):
        nodes_named.setdefault(host, set()).add(node)
    return {host: len(named) for host, named in nodes_named.items() if len(named) > 1}


def job_summary(statuses):
    """The collective most ranks wait in now, from their statuses: "ranks 0, 2-1023 wait in allreduce
    65 gradients (#1235, train_cnn.py:210)"; "" when no rank waits in one."""
    groups = {}
    for rank, status in statuses.items():
        if status.get("first") is not None:
            groups.setdefault(flight.describe(status), []).append(rank)
    if not groups:
        return ""
    verb, ranks = max(groups.items(), key=lambda item: len(item[1]))
    if len(ranks) > 1:
        verb = verb.replace("waits in", "wait in", 1).replace("is in", "are in", 1)
    return f"{rank_list(ranks)} {verb}"[:DATAGRAM - 16]


def start(rank, hosts, nodes, step, broadcast, status=None):
    """Every rank's heartbeat; collective (the listeners' addresses out).

    ``hosts``, ``nodes``: every rank's, in rank order (dist.setup gathers them), the same on
    every rank, so all agree on the deputy. ``broadcast(obj, root_rank, name)``: the
    runtime's (collectives.broadcast_object); this module makes no collective of its own.
    ``status()``: this rank's flight-recorder status, which every beat carries.
    """
    node = nodes[rank]
    if rank == 0:
        for host, count in shared_names(hosts, nodes).items():
            print(f"warning: {count} nodes report the host name {host} (cloned machines or containers?): "
                  "the job's lines name a lost one by its address", file=sys.stderr, flush=True)
    deputy = deputy_of(nodes)
    port = int(os.environ.get(PORT_ENV, "0"))
    listening = None
    if rank in (0, deputy):
        listening = _udp_socket(port + (rank == deputy) if port else 0)
    listeners = {}
    for listener in (0, deputy):
        if listener is None:
            continue
        offer = (node_addresses(), listening.getsockname()[1]) if rank == listener else None
        # Horovod: where this listener is reached, from the listener to every rank.
        addresses, listener_port = broadcast(offer, root_rank=listener, name=f"hvdtrain.peers.listener.{listener}")
        if node == nodes[listener]:
            addresses = ["127.0.0.1"]  # the listener's own node: the loopback always reaches it
        if listener != rank:
            listeners[listener] = [(address, listener_port) for address in addresses]
    return Peers(rank, hosts, listeners, _udp_socket(0), listening, step, nodes, status)


def _udp_socket(port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    return sock


def node_addresses():
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
