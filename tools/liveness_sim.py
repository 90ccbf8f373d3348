#!/usr/bin/env python
"""The liveness code at 1,024 ranks on 128 nodes, simulated: the heartbeat, the flight recorder's
statuses and the watchdog's finding, in lightweight processes (no torch, no Horovod).

    python tools/liveness_sim.py --ranks 1024 --per-node 8 --output sim.json

Each simulated node is one process whose threads are its ranks: each rank keeps a real
flight recorder (hvdtrain/liveness/recorder.py) of simulated steps (its gradients' allreduces,
the NaN vote) and beats to rank 0 and its deputy with the real heartbeat (liveness/peers.py,
UDP on the loopback), carrying its status. Rank 0 runs alone in a process of its own, so its
CPU time is its own. Three phases, timed from rank 0's side:

1. steady state: rank 0's CPU (a fraction of one core) and the datagrams and bytes it
   receives per second;
2. a rank-divergent collective: every rank stops at one step in its collective, one rank in another
   one (``user.metric``); how long until rank 0's judge (Peers.judge, liveness/judge.py, over
   the statuses it heard) finds the deadlock certain and names that rank, and the finding's length;
3. a lost node: one node's process killed (SIGKILL); how long until rank 0's judge names exactly
   its ranks as not heard, the same bound as at 2 ranks (SILENT_SECONDS).

Prints the figures, and writes them as JSON with --output.
"""
import argparse
import json
import multiprocessing
import os
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from hvdtrain.liveness import judge, peers, recorder  # noqa: E402  (no torch, no Horovod)

STEP_SECONDS = 0.2
ODD_ONE_OUT = "user.metric"
DIVERGE_AFTER_STEPS = 3  # the divergence's step: this many after rank 0 asks for it, the same on every rank
BASE = int(time.time() / STEP_SECONDS)  # step 0 of every simulated rank (set before the processes fork)


def step_now():
    """The simulated job's step now: every rank steps in time with the clock, as collectives keep real
    ranks in step, so that each rank's k-th step makes the same collectives under the same numbers."""
    return int(time.time() / STEP_SECONDS) - BASE


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--steady-seconds", type=float, default=10.0, help="phase 1's length")
    parser.add_argument("--port", type=int, default=29_701, help="rank 0's UDP port; the deputy's is the next")
    parser.add_argument("--output", type=Path, help="the figures as JSON")
    return parser.parse_args()


class SimulatedRank:
    """A rank's training thread: steps of a few collectives, recorded; it stops when told."""

    def __init__(self, rank, ranks, per_node, port, diverge):
        self.rank, self.diverge = rank, diverge  # diverge: a shared step number, 0 until asked for
        self.waiting = False
        self.flight = recorder.FlightRecorder(rank, place=self.place)
        hosts = [f"node{r // per_node}" for r in range(ranks)]
        nodes = [f"sim/{r // per_node}" for r in range(ranks)]
        deputy = peers.deputy_of(nodes)
        listening = None
        if rank in (0, deputy):
            listening = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            listening.bind(("127.0.0.1", port + (rank == deputy)))
        listeners = {listener: [("127.0.0.1", port + (listener == deputy))]
                     for listener in (0, deputy) if listener is not None and listener != rank}
        beating = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        beating.bind(("127.0.0.1", 0))
        self.peers = peers.Peers(rank, hosts, listeners, beating, listening, step=lambda: self.flight.step,
                                 nodes=nodes, status=self.flight.status)
        threading.Thread(target=self.train, daemon=True).start()

    def place(self):
        return (self.waiting, "train_sim.py:42 in step" if self.waiting else "train_sim.py:40 in step", "compute")

    def train(self):
        step = step_now()
        while True:
            step += 1
            self.flight.seq = 2 * step  # two records a step (the gradients, the vote): numbered alike on every rank
            diverging = 0 < self.diverge.value <= step
            names = [ODD_ONE_OUT] if diverging and self.rank == self.odd_one_out else ["grad.fc.weight", "grad.fc.bias"]
            handles = [object() for _ in names]
            for handle, name in zip(handles, names):
                self.flight.submitted(handle, "allreduce", name, ("float32", (10,), 0), skip=1,
                                      burst=name.startswith(recorder.GRADIENT))
            if diverging:  # every rank waits forever, each in the collective it made
                self.waiting = True
                self.flight.wait_started()
                return
            time.sleep(max(0.0, (BASE + step + 1) * STEP_SECONDS - time.time()))  # to the next step's start
            for handle in handles:
                self.flight.completed(handle)
            vote = object()
            self.flight.submitted(vote, "allreduce", "nonfinite.vote", ("int32", (1,), 0), skip=1)
            self.flight.completed(vote)
            self.flight.step = step


def node(ranks_here, ranks, per_node, port, diverge, odd_one_out, ready):
    simulated = []
    for rank in ranks_here:
        member = SimulatedRank(rank, ranks, per_node, port, diverge)
        member.odd_one_out = odd_one_out
        simulated.append(member)
    ready.release()
    while True:
        time.sleep(3600)


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def root(args, diverge, odd_one_out, lost_node, ready, go, results):
    """Rank 0's process: its rank, the measurements."""
    me = SimulatedRank(0, args.ranks, args.per_node, args.port, diverge)
    me.odd_one_out = odd_one_out
    ready.release()
    go.wait()
    # Phase 1: steady state, after every rank has been heard.
    deadline = time.monotonic() + 60
    while len(me.peers.heard) < args.ranks - 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    heard_all = len(me.peers.heard) == args.ranks - 1
    cpu, (datagrams, size), started = cpu_seconds(), list(me.peers.received), time.monotonic()
    while time.monotonic() - started < args.steady_seconds:  # the speaking listener judges once a second
        assert me.peers.judge() is None
        time.sleep(judge.JUDGE_SECONDS)
    seconds = time.monotonic() - started
    steady = {"heard_every_rank": heard_all, "rank0_cpu_fraction": (cpu_seconds() - cpu) / seconds,
              "datagrams_per_second": (me.peers.received[0] - datagrams) / seconds,
              "bytes_per_second": (me.peers.received[1] - size) / seconds}
    # Phase 2: a rank-divergent collective.
    diverge.value = step_now() + DIVERGE_AFTER_STEPS
    started = time.monotonic() + (BASE + diverge.value) * STEP_SECONDS - time.time()  # when every rank stops
    finding = None
    while time.monotonic() - started < 30:
        verdict = me.peers.judge()
        finding = verdict.finding if verdict is not None and verdict.kind == "deadlocked" else None
        if finding and f"rank {odd_one_out} waits in allreduce {ODD_ONE_OUT}" in finding and finding.count(";") == 1:
            break  # every rank's status is one sent after it stopped: the big group and the odd one out
        time.sleep(0.1)
    divergence = {"seconds_to_name_it": time.monotonic() - started, "finding": finding,
                  "finding_characters": len(finding or "")}
    results.put({"steady": steady, "divergence": divergence})
    # Phase 3: a lost node (the parent kills it once told).
    results.put("kill now")
    killed = time.monotonic()
    lost = set(range(lost_node * args.per_node, (lost_node + 1) * args.per_node))
    line = ""
    while time.monotonic() - killed < 60:
        verdict = me.peers.judge()
        if verdict is not None and verdict.kind == "lost" and set(me.peers.silent_ranks()) == lost:
            line = verdict.finding
            break
        time.sleep(0.1)
    results.put({"lost_node": {"seconds_to_name_it": time.monotonic() - killed, "line": line,
                               "line_characters": len(line), "silent_seconds": peers.SILENT_SECONDS}})


def main():
    args = parse_args()
    if args.ranks % args.per_node or args.ranks < 2 * args.per_node:
        raise SystemExit("liveness_sim.py: error: --ranks must be a multiple of --per-node, two nodes at least")
    context = multiprocessing.get_context("fork")
    diverge, go, results = context.Value("l", 0), context.Event(), context.Queue()
    nodes = args.ranks // args.per_node
    odd_one_out, lost_node = args.ranks // 2 + 5, nodes - 2  # a rank mid-job, a node not rank 0's or the deputy's
    ready = context.Semaphore(0)
    processes = [context.Process(target=root, args=(args, diverge, odd_one_out, lost_node, ready, go, results),
                                 daemon=True)]
    for index in range(nodes):
        ranks_here = [r for r in range(index * args.per_node, (index + 1) * args.per_node) if r != 0]
        processes.append(context.Process(target=node, daemon=True,
                                         args=(ranks_here, args.ranks, args.per_node, args.port, diverge,
                                               odd_one_out, ready)))
    started = time.monotonic()
    for process in processes:
        process.start()
    for _ in processes:
        ready.acquire()
    go.set()
    first = results.get(timeout=300)
    assert results.get(timeout=120) == "kill now"
    os.kill(processes[1 + lost_node].pid, signal.SIGKILL)
    figures = {"ranks": args.ranks, "nodes": nodes, "per_node": args.per_node, "started_in_s": None,
               **first, **results.get(timeout=120)}
    figures["started_in_s"] = round(time.monotonic() - started, 1)
    for process in processes:
        if process.is_alive():
            process.kill()
    print(f"{args.ranks} ranks on {nodes} nodes: rank 0 heard every rank: {figures['steady']['heard_every_rank']}; "
          f"rank 0 used {100 * figures['steady']['rank0_cpu_fraction']:.1f} % of a core, received "
          f"{figures['steady']['datagrams_per_second']:.0f} datagrams/s ({figures['steady']['bytes_per_second'] / 1024:.0f} KiB/s)")
    print(f"a rank-divergent collective named in {figures['divergence']['seconds_to_name_it']:.1f} s "
          f"({figures['divergence']['finding_characters']} characters): {figures['divergence']['finding']}")
    print(f"a lost node ({args.per_node} ranks) named in {figures['lost_node']['seconds_to_name_it']:.1f} s "
          f"(the heartbeat's bound: {peers.SILENT_SECONDS:.0f} s silent): {figures['lost_node']['line']}")
    if args.output:
        args.output.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
