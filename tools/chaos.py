#!/usr/bin/env python
"""Training under a stream of failures: an elastic job, a seeded schedule of killed workers, its efficiency.

For each mean interval T, `train_cnn.py --elastic` runs under `horovodrun --elastic`
with N slots on this machine while a seeded schedule SIGKILLs a worker (a random
rank) at exponentially distributed intervals of mean T seconds, from its first step
on. Horovod's driver starts a new worker in the lost slot at once (the project's
patch: a host keeps its healthy workers), so the capacity returns after the new
worker's start. The same job without faults runs first. Every run trains the same
steps: digits, convnet (or `--model`), fp32, `--global-batch` (a step is the same optimisation at
every world size), so the report can hold the faulty runs to the fault-free one:

- efficiency: the fault-free run's seconds from its first step to its end over the
  faulty run's (both train the same samples);
- steps kept: the steps of the job over the steps run, counting those run again
  after a reset went back to its last commit (`--elastic-commit-every`);
- each fault: seconds from the kill to rank 0's "a worker was lost" line (detect; the
  relaunch path: the job's error line),
  to the new world's first line (reform) and to its first step; the lines the
  job printed from the kill to that step (progress and world lines aside);
- the longest pause: the longest stretch without a step (a loss no rank saw waits out
  Gloo's timeout, 30 s);
- samples: every epoch's `train_samples` against the data set (a sample lost or
  trained twice changes it);
- weights: the largest difference between the faulty and the fault-free run's
  final models (fp32 with --global-batch: within 1e-5, bit-equal at one size).

`--relaunch` measures the other recovery path the same way: a fixed-size job
(`horovodrun -np N`, `--checkpoint-every` instead of the elastic commits) that
each fault ends in one line, launched again at once by the tool and resuming from
its newest checkpoint, as a relaunch loop or Slurm's requeue would; its run
without faults is that fixed-size job's.

`--spares N` has every host keep N workers standing by (HOROVOD_ELASTIC_SPARES, the
project's Horovod patch): a lost worker's slot goes to one of them, and the next world
waits for no worker's start. A host that returns is let in once its new workers stand by
(always, the patch's standby workers); the report's `joins` gives each larger world's
pause. A worker still starting or standing by (named hvd-standby) is not yet in the job
and no fault hits it.

`--hosts H` spreads the slots over H simulated hosts (tests/support/hosts.py: network
namespaces on one bridge, each with its own address, host name and sshd; horovodrun
starts the other hosts' workers over ssh, as on a cluster; root); `--fault host`
then loses a random host's workers at once (a node lost: Horovod takes the host
out, the others go on, and the host is listed again after `--return-after` seconds,
horovodrun's blacklist cooldown, and joins at the job's next commit).

`--fault link` takes a random host's link down (not the launcher's host) for
`--return-after` seconds: its workers alive, their packets lost. A cut shorter than
HOROVOD_ELASTIC_UNREACHABLE_SECS is a pause (the collectives go on once TCP resends);
a longer one has horovodrun's driver leave the host's workers behind and the others go
on without it until it is listed again. `--fault slow` holds a random worker to
`--slow-share` of a core for `--return-after` seconds (a cgroup; root): a straggler
that every step waits for. Each fault's `pause_s` is the longest stretch without a
step from it to the next fault, whether the job reset or not.

`--trainer bert` runs `pretrain_bert.py --elastic` (tiny, fp32, `--steps`, the
embedded corpus prepared by the tool with length bins and static masking) instead;
every rank records the instances it trains (HVDTRAIN_RECORD_INSTANCES), and every
epoch but the last must hold each instance once, the last none twice.

HOROVOD_ELASTIC_HOST_FAILURE_LIMIT is raised for these runs: its default takes a host
out when 3 of its workers fail within 45 s, the policy for a node in a crash loop, and
exponential intervals bunch faults (on one host at T = 15 s, 4 faults in 5 have two more
within the next 45 s; at T = 60 s, 1 in 6: docs/launching.md).

    .venv/bin/python tools/chaos.py --ranks 8 --interval 60 30 15 --epochs 80 \\
        --json runs/chaos.json --plot runs/chaos.png
    .venv/bin/python tools/chaos.py --ranks 16 --hosts 4 --fault host --interval 60
"""
import argparse
import contextlib
import json
import random
import re
import os
import signal
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import torch

from support.bert_data import NO_DROPOUT_CONFIG, trained_instances
from support.checks import succeeded
from support.commands import CNN, PREPARE, PRETRAIN
from support.elastic_jobs import elastic_command, write_hosts
from support.hosts import INTERFACE, Hosts, require_hosts
from support.launch import Timed, python
from support.ranks import CPU_CGROUP, cpu_share, rank_pids, standing_by, stopped

DIGITS_TRAIN = 1438  # the digits samples train_cnn.py trains on (its fixed validation split aside)
PROGRESS = re.compile(r"progress: step (\d+)/(\d+)")
# What first says a fault was seen: the elastic reset's line, or the fixed-size job's one error line.
DETECTED = re.compile(r"elastic: a worker was lost\b.*; back to the last commit|: error: "
                      r"|elastic: (the worker|\d+ workers) of \S+ .*(answered nothing|could not be reached) for")
WORLD = re.compile(r"(\d+) (?:workers? x batch|rank\(s\), global batch)")  # train_cnn.py's, pretrain_bert.py's
# Training's own lines, not a fault's: an epoch's summary (train_cnn.py), a logged step (pretrain_bert.py),
# where an elastic BERT epoch goes on, a checkpoint written, the run's last line.
EPOCH = re.compile(r"epoch \d+ step \d+ lr |step +\d+ \| mlm loss |elastic: epoch \d+ goes on from instance"
                   r"|checkpoint step-\d+\.pt written|; results in \S+results\.json|finished at step \d+")
# With --horovod-log-level INFO: what horovodrun's driver and Horovod's workers log (not the job's lines).
HOROVOD_LOG = re.compile(r"^(INFO|DEBUG|WARNING):\S+:|<std(out|err)>:\[\d{4}-\d\d-\d\d [\d:. ]+: [TDIWE] ")
DRIVER_SAW = re.compile(r"record state: \S+ = FAILURE")  # the driver saw a worker exit
ASSIGNED = re.compile(r"INFO:root:reset workers: \d+")  # the driver assigned a world
INITIALIZED = re.compile(r"\]: Horovod initialized")  # a world's Gloo contexts formed
FAULTS = ["worker", "host", "frozen", "link", "slow"]
ENV = {"HVDTRAIN_PROGRESS_SECONDS": "0.001",  # a progress line every step: the timeline
       "HOROVOD_ELASTIC_HOST_FAILURE_LIMIT": "1000000"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="slots on this machine (a divisor of --global-batch)")
    parser.add_argument("--interval", type=float, nargs="+", default=[60.0, 30.0, 15.0],
                        help="mean seconds between faults, one faulty run each")
    parser.add_argument("--trainer", choices=["cnn", "bert"], default="cnn",
                        help="the job: train_cnn.py (digits, convnet) or pretrain_bert.py (tiny BERT, the "
                             "embedded corpus prepared by the tool, length bins)")
    parser.add_argument("--model", default="convnet",
                        help="--trainer cnn: train_cnn.py's --model (convnet: no BatchNorm; resnet20: the issue's "
                             "ResNet-20, a rank's BatchNorm statistics its own between checkpoints)")
    parser.add_argument("--epochs", type=int, default=40, help="the job's length in digits epochs (45 steps each)")
    parser.add_argument("--steps", type=int, default=300, help="--trainer bert: the job's length in steps")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step at every world size")
    parser.add_argument("--commit-every", type=int, default=10, help="--elastic-commit-every of the job")
    parser.add_argument("--faults", type=int, default=0, help="at most this many faults a run (0: no limit)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="draw the next interval only once the job trains again after a fault's reset "
                             "(default: faults fall when they fall, during a reset too)")
    parser.add_argument("--then-after", type=float, default=None, metavar="SECONDS",
                        help="each drawn fault kills a second worker SECONDS later, while the world re-forms "
                             "(counted as a fault of its own)")
    parser.add_argument("--relaunch", action="store_true",
                        help="the relaunch path instead of the elastic one: a fixed-size job that ends at a fault "
                             "and is launched again at once, resuming from its last checkpoint (--checkpoint-every "
                             "--commit-every), as a relaunch loop or Slurm's requeue does")
    parser.add_argument("--hosts", type=int, default=0,
                        help="simulated hosts the slots spread over (network namespaces with sshd; root); "
                             "0: this machine")
    parser.add_argument("--fault", choices=FAULTS, default="worker",
                        help="what a fault does: SIGKILL a random worker, or every worker of a random host "
                             "(--hosts), or SIGSTOP a random worker (frozen: Horovod's driver ends it once it "
                             "answers nothing for HOROVOD_ELASTIC_UNRESPONSIVE_SECS), or take a random host's "
                             "link down for --return-after seconds (link: its workers alive, their packets lost; "
                             "not the launcher's host), or hold a random worker to --slow-share of a core for "
                             "--return-after seconds (slow: a straggler)")
    parser.add_argument("--return-after", type=int, default=5, metavar="SECONDS",
                        help="--fault host or link: seconds until a lost host is listed again (the blacklist "
                             "cooldown; link: its link is up again then); --fault slow: seconds a worker is held")
    parser.add_argument("--slow-share", type=float, default=0.02, metavar="CORES",
                        help="--fault slow: the CPU a slowed worker gets, in cores (a cgroup's quota; root)")
    parser.add_argument("--spares", type=int, default=0, metavar="N",
                        help="workers each host keeps standing by to take a lost worker's slot "
                             "(HOROVOD_ELASTIC_SPARES; the elastic path)")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed (which rank, when)")
    parser.add_argument("--gloo-timeout", type=int, default=None, metavar="SECONDS",
                        help="the job's HOROVOD_GLOO_TIMEOUT_SECONDS (Horovod's default: 30): set it far above a "
                             "reset's length and a reset that waited it out stands apart from a slow new worker")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds before a run is killed")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plot", type=Path, help="draw efficiency against T and each run's timeline here (PNG)")
    parser.add_argument("--log", type=Path, metavar="DIR",
                        help="write each run's whole output here, every line with its seconds since the launch, "
                             "and each fault's victims (which worker, when): what a surprising figure is read from")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep every run's output directory (its checkpoints and metrics) here, an empty or "
                             "new directory; by default they are removed at the end")
    parser.add_argument("--horovod-log-level", choices=["DEBUG", "INFO", "WARNING"], default=None,
                        help="horovodrun's --log-level for the runs: its driver's and the workers' Horovod logs "
                             "in the output (with --log), and INFO splits each fault's recovery into phases")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.global_batch % args.ranks:
        parser.error(f"--ranks {args.ranks}: needs 2 or more ranks dividing --global-batch {args.global_batch}")
    if min(args.interval) <= 0:
        parser.error("--interval: mean seconds between faults must be positive")
    if args.hosts < 0 or (args.hosts and args.ranks % args.hosts):
        parser.error(f"--hosts {args.hosts}: must divide --ranks {args.ranks}")
    if args.fault in ("host", "link") and args.hosts < 2:
        parser.error(f"--fault {args.fault}: needs --hosts 2 or more (a job on one host ends with it)")
    if args.fault == "slow" and not 0 < args.slow_share:
        parser.error(f"--slow-share {args.slow_share:g}: must be a positive share of a core")
    if args.fault == "slow" and not os.access(CPU_CGROUP, os.W_OK):
        parser.error(f"--fault slow: needs a writable cgroup v1 CPU controller at {CPU_CGROUP} (root)")
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep}: not empty (the runs' directories would mix with what is there)")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    if args.fault == "frozen" and args.relaunch:
        parser.error("--fault frozen: the elastic path only (a fixed-size job's watchdog ends a frozen rank's job)")
    return args


def job(args, out, data=None):
    saving = (["--checkpoint-every", args.commit_every] if args.relaunch
              else ["--elastic", "--elastic-commit-every", args.commit_every])
    if args.trainer == "bert":
        return [PRETRAIN, "--data", data, "--config", data.parent / "bert-config.json", "--precision", "fp32",
                "--threads", "1", "--steps", args.steps, "--global-batch", args.global_batch,
                "--batch-size", args.global_batch // args.ranks, "--log-every", "50", *saving, "--output-dir", out]
    return [CNN, "--dataset", "digits", "--model", args.model, "--precision", "fp32",
            "--threads", "1", "--epochs", args.epochs, "--global-batch", args.global_batch,
            "--batch-size", args.global_batch // args.ranks, "--lr", "0.01", *saving, "--output-dir", out]


def worker_pids(out, ranks):
    """Every process of the job's workers: by the rank each was started as (a survivor keeps
    its first; a worker started ahead of a joining host's world, standing by for its slot, -1)."""
    return sorted({pid for rank in range(-1, ranks) for pid in rank_pids(str(out), rank)})


class Workers:
    """The workers a fault may hit: those started into a world, and those started ahead (rank
    -1) once the driver has given them their slot: seen standing by, then no longer. A worker
    still importing or standing by is not yet in the job."""

    def __init__(self, out, ranks, done):
        self.out, self.ranks, self.done = str(out), ranks, done
        self.seen_standing_by = set()
        threading.Thread(target=self.watch, daemon=True).start()

    def watch(self):
        while not self.done.wait(0.2):
            self.seen_standing_by.update(pid for pid in rank_pids(self.out, -1) if standing_by(pid))

    def pids(self):
        started = {pid for rank in range(self.ranks) for pid in rank_pids(self.out, rank)}
        joined = {pid for pid in rank_pids(self.out, -1) if pid in self.seen_standing_by and not standing_by(pid)}
        return sorted(pid for pid in started | joined if not stopped(pid))  # a frozen one is hit already


class Place:
    """Where the job runs: this machine, or --hosts simulated hosts (the launcher on the first)."""

    def __init__(self, args):
        self.env = {**ENV, "HOROVOD_ELASTIC_SPARES": str(args.spares),
                    **({"HOROVOD_GLOO_TIMEOUT_SECONDS": str(args.gloo_timeout)} if args.gloo_timeout else {})}
        self.slots = args.ranks // max(1, args.hosts)
        self.hosts = None
        if args.hosts:
            require_hosts()
            self.hosts = Hosts([f"node{i}" for i in range(1, args.hosts + 1)], "10.79.0").start()
        self.names = self.hosts.names if self.hosts else ["localhost"]
        self.interface = INTERFACE if self.hosts else "lo"

    def write_hostfile(self, path):
        write_hosts(path, *(f"{name} slots={self.slots}" for name in self.names))

    def launch(self, command, timeout, env=(), **timeline):
        if self.hosts:
            return Timed(self.hosts.on_first(command), {**self.env, **dict(env), **self.hosts.env()}, timeout,
                         **timeline)
        return Timed(command, {**self.env, **dict(env)}, timeout, **timeline)

    def host_of(self, pid):
        """The host ``pid`` runs on (its network namespace), None where it is gone."""
        if not self.hosts:
            return "localhost"
        try:
            network = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        return next((name for name, namespace in self.hosts.namespaces.items()
                     if os.stat(f"/run/netns/{namespace}").st_ino == network), None)

    def stop(self):
        if self.hosts:
            self.hosts.stop()


class Schedule:
    """From the job's first step on: a random worker SIGKILLed after each exponential interval of mean T."""

    def __init__(self, run, out, args, interval, rng, place):
        self.run, self.out, self.args, self.interval, self.rng = run, out, args, interval, rng
        self.place = place
        self.kills = []  # seconds since the launch
        self.victims = []  # (seconds since the launch, [(pid, rank it was started as)])
        self.done = threading.Event()
        self.cut, self.held = set(), set()  # hosts whose link is down, workers held (--fault link, slow)
        self.undos, self.pending, self.undoing = [], set(), threading.Lock()
        self.workers = Workers(out, args.ranks, self.done)
        self.thread = threading.Thread(target=self.inject, daemon=True)
        self.thread.start()

    def last_step(self):
        """(step, of steps) of the job's newest progress line, or None before its first step."""
        for _, line in reversed(list(self.run.lines)):
            found = PROGRESS.search(line)
            if found:
                return int(found.group(1)), int(found.group(2))
        return None

    def inject(self):
        while self.last_step() is None:
            if self.done.wait(0.1):
                return
        while not self.args.faults or len(self.kills) < self.args.faults:
            if self.done.wait(self.rng.expovariate(1.0 / self.interval)):
                return
            step, steps = self.last_step()
            if step >= steps:
                return  # trained: a fault now would hit the job's end, not its training
            if not self.kill_one():
                continue
            if self.args.then_after is not None and (not self.args.faults or len(self.kills) < self.args.faults):
                if self.done.wait(self.args.then_after):
                    return
                self.kill_one()
            if self.args.one_at_a_time:
                self.wait_for_training_after(self.kills[-1])

    def kill_one(self):
        """One fault (--fault): SIGKILL a random worker, or every worker of a random host; SIGSTOP a
        worker; a host's link down, or a worker held to --slow-share, for --return-after seconds. The
        relaunch path: once the next launch has workers. False where none was found."""
        pids = self.workers.pids()
        while not pids and self.args.relaunch and not self.done.wait(0.1):
            pids = self.workers.pids()
        pids = [pid for pid in pids if pid not in self.held]
        if not pids:
            return False
        if self.args.fault == "link":
            return self.cut_link(pids)
        if self.args.fault == "host":
            on = {}
            for pid in pids:
                on.setdefault(self.place.host_of(pid), []).append(pid)
            victims = on[self.rng.choice(sorted(host for host in on if host))]
        else:
            victims = [self.rng.choice(pids)]
        hit = []
        for pid in victims:
            started_as = started_rank(pid)
            try:
                if self.args.fault == "slow":
                    self.hold(pid)
                else:
                    os.kill(pid, signal.SIGSTOP if self.args.fault == "frozen" else signal.SIGKILL)
                hit.append((pid, started_as))
            except (ProcessLookupError, OSError):
                pass
        if hit:
            self.record(hit)
        return bool(hit)

    def record(self, hit):
        self.kills.append(time.monotonic() - self.run.started)
        self.victims.append((round(self.kills[-1], 2), hit))

    def cut_link(self, pids):
        """A random host's link down (not the launcher's: the job ends with it), up again after
        --return-after seconds; its workers stay alive, their packets lost."""
        on = {}
        for pid in pids:
            on.setdefault(self.place.host_of(pid), []).append(pid)
        hosts = sorted(host for host in on if host and host != self.place.names[0] and host not in self.cut)
        if not hosts:
            return False
        host = self.rng.choice(hosts)
        self.place.hosts.link(host, "down")
        self.cut.add(host)
        self.record([(pid, started_rank(pid)) for pid in on[host]])
        self.later(lambda: (self.place.hosts.link(host, "up"), self.cut.discard(host)))
        return True

    def hold(self, pid):
        """``pid`` into a cgroup of --slow-share of a core, for --return-after seconds."""
        with contextlib.ExitStack() as held:
            held.enter_context(cpu_share(self.args.slow_share)).add(pid)  # OSError where it ended meanwhile
            release = held.pop_all()
        self.held.add(pid)
        self.later(lambda: (release.close(), self.held.discard(pid)))

    def later(self, undo):
        """``undo`` after --return-after seconds, or when the run ends, whichever is first."""
        timer = threading.Timer(self.args.return_after, self.undo, [undo])
        self.pending.add(undo)
        self.undos.append((timer, undo))
        timer.start()

    def undo(self, action):
        with self.undoing:
            if action in self.pending:
                self.pending.discard(action)
                action()

    def wait_for_training_after(self, kill_at):
        """Until the new world's first step after the kill at ``kill_at`` (or the run's end)."""
        while not self.done.wait(0.1):
            reformed, _ = first_after(list(self.run.lines), kill_at, WORLD)
            if reformed is not None and first_after(list(self.run.lines), reformed, PROGRESS)[0] is not None:
                return

    def stop(self):
        self.done.set()
        self.thread.join()
        for timer, undo in self.undos:  # links up, workers released, for the next run
            timer.cancel()
            self.undo(undo)
        return self.kills


def started_rank(pid):
    """The rank a worker was started as (HOROVOD_RANK in its environment; -1: started ahead), or None."""
    try:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(entry.split(b"=", 1)[1]) for entry in environ if entry.startswith(b"HOROVOD_RANK=")), None)


def fault_name(args):
    return {"frozen": "SIGSTOP", "link": "link down, the workers of", "slow": f"held to {args.slow_share:g} "
            f"of a core for {args.return_after} s:"}.get(args.fault, "SIGKILL")


def write_log(args, name, run, schedule):
    """--log: the run's whole output, each line with its seconds since the launch, and its faults."""
    if not args.log:
        return
    args.log.mkdir(parents=True, exist_ok=True)
    faults = [f"{at:9.2f} chaos.py: {fault_name(args)} "
              + ", ".join(f"pid {pid} (started as rank {rank})" for pid, rank in hit)
              for at, hit in (schedule.victims if schedule else [])]
    lines = sorted([(at, f"{at:9.2f} {line}") for at, line in run.lines]
                   + [(float(text.split()[0]), text) for text in faults], key=lambda pair: pair[0])
    (args.log / f"{name}.log").write_text("".join(text + "\n" for _, text in lines))


def launch(args, place, out, hostfile, interval=None, seed=0):
    """The job under the schedule of mean ``interval`` (None: no faults): (its run, the kills' times)."""
    if args.relaunch:
        run, kills = relaunch_loop(args, place, out, interval, seed)
    else:
        # The cooldown: how long a host whose every worker failed stays out (--fault host).
        command = elastic_command(hostfile, args.ranks, job(args, out, args.data), interface=place.interface,
                                  extra=["--blacklist-cooldown-range", args.return_after, args.return_after,
                                         *(["--log-level", args.horovod_log_level] if args.horovod_log_level else [])])
        run = place.launch(command, args.timeout, recording(args, out))
        schedule = Schedule(run, out, args, interval, random.Random(seed), place) if interval is not None else None
        run.wait()
        kills = schedule.stop() if schedule else []
        write_log(args, out.name, run, schedule)
    for pid in worker_pids(out, args.ranks):  # a worker another host's launcher left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return run, kills


def recording(args, out):
    """--trainer bert: every rank records the instances of each step it trains (HVDTRAIN_RECORD_INSTANCES,
    a test hook): the samples check's. train_cnn.py counts each epoch's samples in its metrics."""
    return {"HVDTRAIN_RECORD_INSTANCES": str(instances_record(out))} if args.trainer == "bert" else {}


def instances_record(out):
    return out.parent / f"{out.name}.instances"


def prepare_bert(scratch):
    """The embedded corpus (CPython's documentation), 64 tokens, length bins of 16, static masking: the
    data of test_elastic.py's BERT test, the whole corpus; the suite's two-layer BERT without dropout
    (a rank's dropout masks are its own: a worker that replaces a lost one draws others, and the
    weights could not be held to the run without faults)."""
    data = scratch / "bert-data"
    succeeded(python([PREPARE, "--output-dir", data, "--max-seq-length", "64", "--vocab-size", "1000",
                      "--dupe-factor", "1", "--masking", "static", "--bin-size", "16"], timeout=600))
    (scratch / "bert-config.json").write_text(json.dumps(NO_DROPOUT_CONFIG))
    return data


def relaunch_loop(args, place, out, interval, seed):
    """The relaunch path: a fixed-size job, ended in one line by each fault, launched again at once
    (resuming from its newest checkpoint) until it completes; one timeline for all its launches."""
    command = ["horovodrun", "-np", args.ranks, "-H", ",".join(f"{name}:{place.slots}" for name in place.names),
               "--gloo", "--network-interface", place.interface, sys.executable, *job(args, out, args.data)]
    timeline = types.SimpleNamespace(started=time.monotonic(), lines=[])
    schedule = Schedule(timeline, out, args, interval, random.Random(seed), place) if interval is not None else None
    while True:
        left = args.timeout - (time.monotonic() - timeline.started)
        run = place.launch(command, max(1, left), recording(args, out), started=timeline.started,
                           lines=timeline.lines).wait()
        if run.process.returncode == 0 or left <= 1 or schedule is None:
            break
    kills = schedule.stop() if schedule else []
    write_log(args, out.name, timeline, schedule)
    return run, kills


def first_after(lines, at, pattern):
    return next(((t, m) for t, line in lines if t >= at for m in [pattern.search(line)] if m), (None, None))


def fault_record(lines, kill_at, next_kill_at, ranks):
    detected, _ = first_after(lines, kill_at, DETECTED)
    reformed, _ = first_after(lines, kill_at, WORLD)
    # The world of every slot again: at once where a lost worker's slot is refilled; a lost
    # host's after its cooldown, at the next commit.
    whole = next((t for t, line in lines if t >= kill_at
                  for m in [WORLD.search(line)] if m and int(m.group(1)) == ranks), None)
    stepped, _ = first_after(lines, reformed, PROGRESS) if reformed is not None else (None, None)
    recovered = min(next_kill_at, stepped if stepped is not None else next_kill_at)
    printed = [line for t, line in lines if kill_at <= t < recovered
               and not PROGRESS.search(line) and not WORLD.search(line)
               and not EPOCH.search(line) and not HOROVOD_LOG.search(line)]

    def since(t):
        return None if t is None or t >= next_kill_at else round(t - kill_at, 2)

    return {"at_s": round(kill_at, 2), "detect_s": since(detected), "reform_s": since(reformed),
            "first_step_s": since(stepped), "whole_again_s": since(whole),
            "pause_s": pause(lines, kill_at, next_kill_at), "lines": len(printed), "said": printed[:5],
            "phases": phases(lines, kill_at, reformed, stepped, since)}


def pause(lines, at, until):
    """The longest stretch without a step that began before ``until`` and ended after ``at``: what a
    fault cost the job where it reset (to the new world's first step) or not (a link back in time,
    a slow worker: the steps it held up)."""
    times = [t for t, line in lines if PROGRESS.search(line)]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > at and a < until]
    return round(max(gaps, default=0.0), 2)


def phases(lines, kill_at, reformed, stepped, since):
    """Where a fault's recovery went, from the Horovod logs (--horovod-log-level INFO; else None):
    seconds since the kill until the driver saw the worker exit, until it assigned the world that
    formed (the survivors left the old one and registered: teardown), until that world's Gloo
    contexts formed (rendezvous, a new worker's start included), until the trainers synced the
    state (the world's first line) and until its first step."""
    if reformed is None or not any(ASSIGNED.search(line) for _, line in lines):
        return None
    window = [(t, line) for t, line in lines if kill_at <= t <= reformed]
    initialized = next((t for t, line in reversed(window) if INITIALIZED.search(line)), None)
    assigned = next((t for t, line in reversed(window) if ASSIGNED.search(line)
                     and (initialized is None or t <= initialized)), None)
    driver_saw, _ = first_after(window, kill_at, DRIVER_SAW)
    return {"driver_saw_s": since(driver_saw), "assigned_s": since(assigned), "initialized_s": since(initialized),
            "synced_s": since(reformed), "first_step_s": since(stepped)}


def join_records(lines):
    """Each world larger than the one before (a refilled slot, a host back): when it formed,
    its size, and the pause it cost the workers already training (the last step before it
    to the first after it)."""
    joins, size, last_step = [], None, None
    for i, (t, line) in enumerate(lines):
        if PROGRESS.search(line):
            last_step = t
            continue
        world = WORLD.search(line)
        if not world:
            continue
        new = int(world.group(1))
        if size is not None and new > size and last_step is not None:
            after, _ = first_after(lines[i:], t, PROGRESS)
            joins.append({"at_s": round(t, 2), "size": new,
                          "pause_s": None if after is None else round(after - last_step, 2)})
        size = new
    return joins


def steps_run_again(lines):
    """For each reset or relaunch: the steps between the last one finished and the commit or
    checkpoint it went back to (the progress line's step going back)."""
    last, again = 0, 0
    for _, line in lines:
        found = PROGRESS.search(line)
        if found:
            step = int(found.group(1))
            again += max(0, last - (step - 1))
            last = step
    return again


def metric_rows(out):
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def samples_off(out, args):
    """Samples lost or trained twice: train_cnn.py's every epoch against the data set; pretrain_bert.py's
    instances recorded, every epoch but the last once each, the last (cut by --steps) none twice."""
    if args.trainer == "bert":
        trained = trained_instances(instances_record(out))
        last = max(trained, default=0)
        # An epoch's instances: those of the run without faults' first epoch (a length bin with
        # fewer instances than a step's ranks is left out at that size: sampling.global_steps).
        args.epoch_instances = args.epoch_instances or set(trained.get(0, []))
        return sum(len(ids) - len(set(ids)) + (0 if epoch == last else len(args.epoch_instances ^ set(ids)))
                   for epoch, ids in trained.items())
    epochs = args.epochs
    rows = metric_rows(out)
    by_epoch = {row["epoch"]: row["train_samples"] for row in rows}
    return sum(abs(by_epoch.get(epoch, 0) - DIGITS_TRAIN) for epoch in range(1, epochs + 1))


def final_model(out):
    files = sorted(out.glob("step-*.pt"))
    if not files:
        return None, None
    return files[-1].name, torch.load(files[-1], map_location="cpu", weights_only=True)["model"]


def differences(a, b):
    """{tensor: largest difference} of two final models, the largest first; None where they are not of
    the same final step."""
    if a[0] is None or a[0] != b[0]:
        return None
    found = {key: (a[1][key].float() - b[1][key].float()).abs().max().item() for key in b[1]}
    return dict(sorted(found.items(), key=lambda item: -item[1]))


def largest_difference(found):
    return None if found is None else max(found.values(), default=0.0)


def longest_pause(lines):
    """The longest stretch without a step, from the first step on (a reset, a relaunch, a loss
    no rank saw): seconds."""
    times = [t for t, line in lines if PROGRESS.search(line)]
    return round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 2)


def training_seconds(run):
    first, _ = first_after(run.lines, 0, PROGRESS)
    return None if first is None else run.ended - first


def report_run(run, out, args, kills, baseline_seconds, baseline_model):
    seconds = training_seconds(run)
    steps = max((int(m.group(1)) for _, line in run.lines for m in [PROGRESS.search(line)] if m), default=0)
    again = steps_run_again(run.lines)
    bounds = kills + [float("inf")]
    apart = differences(final_model(out), baseline_model)
    return {"exit": run.process.returncode, "training_s": None if seconds is None else round(seconds, 1),
            # Only for a run that trained the whole job: one that ended early trained fewer samples.
            "efficiency": (round(baseline_seconds / seconds, 3)
                           if run.process.returncode == 0 and seconds and baseline_seconds else None),
            "faults": len(kills), "steps": steps, "steps_run_again": again,
            "world_sizes": [int(m.group(1)) for _, line in run.lines for m in [WORLD.search(line)] if m],
            "steps_kept": round(steps / (steps + again), 3) if steps else None,
            "longest_pause_s": longest_pause(run.lines),
            "samples_lost_or_twice": samples_off(out, args),
            "weights_max_difference": largest_difference(apart),
            # The tensors furthest apart (a parameter, or a buffer such as BatchNorm's running statistics).
            "weights_most_apart": None if apart is None else {key: value for key, value in list(apart.items())[:3]},
            "final_val_top1": next((row.get("val_top1") for row in reversed(metric_rows(out))), None),
            "final_mlm_loss": next((row.get("mlm_loss") for row in reversed(metric_rows(out))), None),
            "fault_records": [fault_record(run.lines, at, bounds[i + 1], args.ranks) for i, at in enumerate(kills)],
            "joins": join_records(list(run.lines)),
            "timeline": [(round(t, 2), int(m.group(1))) for t, line in run.lines for m in [PROGRESS.search(line)] if m]}


def plot(path, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    faulty = [row for row in rows if row["interval_s"] is not None]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot([row["interval_s"] for row in faulty], [row["efficiency"] or 0 for row in faulty], "o-")  # 0: ended
    left.set_xlabel("mean seconds between faults (T)")
    left.set_ylabel("training efficiency")
    left.set_ylim(0, 1.05)
    left.invert_xaxis()
    for row in rows:
        times, steps = zip(*row["timeline"]) if row["timeline"] else ((), ())
        label = "no faults" if row["interval_s"] is None else f"T = {row['interval_s']:g} s"
        line, = right.plot(times, steps, label=label)
        for fault in row["fault_records"]:
            right.axvline(fault["at_s"], color=line.get_color(), alpha=0.3, linewidth=0.8)
    right.set_xlabel("seconds since the launch (faults marked)")
    right.set_ylabel("step")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def run_all(args, place, scratch, rows):
    """The run without faults, then one under each --interval; a row each in ``rows``."""
    hostfile = scratch / "hosts"
    place.write_hostfile(hostfile)
    args.data = prepare_bert(scratch) if args.trainer == "bert" else None
    args.epoch_instances = None  # --trainer bert: set by the run without faults
    base_out = scratch / "no-faults"
    base_run, _ = launch(args, place, base_out, hostfile)
    if base_run.process.returncode != 0:
        sys.exit(f"chaos.py: error: the run without faults failed:\n{base_run.output()[-3000:]}")
    baseline_seconds, baseline_model = training_seconds(base_run), final_model(base_out)
    rows.append({"interval_s": None, **report_run(base_run, base_out, args, [], baseline_seconds, baseline_model)})
    print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("timeline", "fault_records")}), flush=True)
    for number, interval in enumerate(args.interval):
        out = scratch / f"every-{interval:g}s"
        run, kills = launch(args, place, out, hostfile, interval, seed=args.seed * 1000 + number)
        rows.append({"interval_s": interval, **report_run(run, out, args, kills, baseline_seconds, baseline_model)})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "timeline"}), flush=True)
        if run.process.returncode != 0:
            print(f"chaos.py: the run at T = {interval:g} s ended with exit {run.process.returncode}:\n"
                  f"{run.output()[-2000:]}", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    rows = []
    place = Place(args)
    try:
        with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory()) as scratch:
            run_all(args, place, Path(scratch), rows)
    finally:
        place.stop()
    cnn = args.trainer == "cnn"
    report = {"trainer": args.trainer, "model": args.model if cnn else None, "ranks": args.ranks,
              "epochs": args.epochs if cnn else None,
              "steps": args.steps if args.trainer == "bert" else None, "global_batch": args.global_batch,
              "commit_every": args.commit_every, "seed": args.seed, "one_at_a_time": args.one_at_a_time,
              "path": "relaunch" if args.relaunch else "elastic",
              "then_after_s": args.then_after, "hosts": args.hosts, "fault": args.fault, "spares": args.spares,
              "return_after_s": args.return_after if args.fault == "host" else None,
              "gloo_timeout_s": args.gloo_timeout or 30,
              "runs": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(args.plot, rows)
    return report


if __name__ == "__main__":
    main()
