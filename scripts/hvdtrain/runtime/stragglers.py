"""Straggler detection: which rank is slow, in which part of its step, on which host.

Synchronous data parallelism runs at the speed of its slowest rank. Each rank
times the parts of its own steps (``SectionTimer``): waiting for ``data``,
``compute`` (forward and backward), ``comm`` (waiting for the gradient
allreduce: the transfer plus waiting for slower peers) and the ``optimizer``
step. Every --straggler-interval steps one allgather of a few numbers per rank
brings every rank's sums to every rank; each rank computes the same scores from
the same numbers, so an action (checkpoint and exit) happens on every rank at
the same step without another collective.

Scores, as in NVIDIA's Resiliency Extension (0-1, 1 is best):
- relative: the fastest rank's time per step in a section over this rank's
  (0.5: this rank takes twice as long as the fastest);
- individual: this rank's best interval so far over this interval (0.5: it
  became twice as slow as it was).
A difference under 5 % of a step is noise, not a straggler: every score adds
that much to both times, so a section of microseconds cannot score 0.1.
"""
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from hvdtrain.durations import SECTIONS, SectionTimer
from hvdtrain.errors import STRAGGLER_EXIT, UsageError
from hvdtrain.liveness import peers
from hvdtrain.runtime import collectives
from hvdtrain.runtime.metrics import WARMUP_STEPS
from hvdtrain.launch.hosts import EXCLUDED_HOSTS_VAR  # noqa: F401 (EXCLUDED_HOSTS_VAR: stragglers.EXCLUDED_HOSTS_VAR)

BUSY = ("data", "compute", "optimizer")  # the rank's own work; comm is mostly waiting for others
NOISE_FRACTION = 0.05  # of the median step time, added to both sides of every score
STRAGGLER_FILE_VAR = "HVDTRAIN_STRAGGLER_FILE"  # rank 0 writes the straggler's host there (slurm/common.sh)


def check_settings(settings, env):
    """--straggler-action exclude needs --elastic and the excluded-hosts file discovery reads."""
    if settings.straggler_action == "exclude" and not (settings.elastic and env.get(EXCLUDED_HOSTS_VAR)):
        raise UsageError(f"--straggler-action exclude needs --elastic and {EXCLUDED_HOSTS_VAR}=FILE in "
                         "horovodrun's environment (scripts/discover_hosts.py leaves the hosts in FILE out)",
                         on_every_rank=True)


@dataclass
class Straggler:
    rank: int
    host: str
    section: str  # the section scoring lowest
    score: float  # its relative score
    other: str  # the other of data/compute, and its score
    other_score: float
    intervals: int
    speed_fraction: float  # the job's speed now over its speed without this rank
    named_alike: int = 1  # nodes that report this host name (cloned machines, containers)
    address: str = ""  # this rank's node's address: what tells it apart when named_alike > 1

    def where(self):
        """Its host; where several nodes report that name, which of them (by address)."""
        if self.named_alike > 1:
            return f"{self.host} (the node at {self.address}, one of {self.named_alike} named {self.host})"
        return self.host

    def exclusion_refused(self):
        """Why --straggler-action exclude must not leave this host out, or None: discovery lists
        hosts by name, so excluding a name shared by several nodes would drop all of them."""
        if self.named_alike > 1:
            return (f"{self.named_alike} nodes report the host name {self.host} and discovery lists hosts by "
                    "name: leaving it out would drop all of them (give the nodes distinct names)")
        return None

    def line(self):
        return (f"rank {self.rank} on {self.where()} is the straggler: {self.section} {self.score:.2f} of the "
                f"fastest for {self.intervals} intervals ({self.other} {self.other_score:.2f}); the job runs "
                f"at ~{100 * self.speed_fraction:.0f} % of its speed without it")


class StragglerExit(UsageError):
    """--straggler-action checkpoint-exit: every rank exits STRAGGLER_EXIT after the checkpoint."""

    exit_status = STRAGGLER_EXIT

    def __init__(self, message):
        super().__init__(message, on_every_rank=True)


def scores(per_step, best_busy=None):
    """The interval's table from every rank's seconds per step: a list of dicts, one per rank.

    ``per_step``: [{section: seconds per step}] in rank order; ``best_busy``:
    each rank's best busy time per step before this interval (None: none yet).
    """
    busy = [sum(times[s] for s in BUSY) for times in per_step]
    steps = [b + times["comm"] for b, times in zip(busy, per_step)]
    noise = NOISE_FRACTION * statistics.median(steps)
    fastest = {s: min(times[s] for times in per_step) for s in SECTIONS}
    fastest_busy = min(busy)
    table = []
    for rank, times in enumerate(per_step):
        row = {"rank": rank, **{f"{s}_s": times[s] for s in SECTIONS}, "step_s": steps[rank]}
        row["relative"] = {s: (fastest[s] + noise) / (times[s] + noise) for s in ("data", "compute")}
        row["relative"]["busy"] = (fastest_busy + noise) / (busy[rank] + noise)
        best = busy[rank] if best_busy is None else min(best_busy[rank], busy[rank])
        row["individual"] = (best + noise) / (busy[rank] + noise)
        row["best_busy_s"] = best
        row["waiting"] = (times["comm"] - fastest["comm"]) / steps[rank] if steps[rank] else 0.0
        table.append(_rounded(row))
    return table


def _rounded(value):
    """Microseconds and 4-digit scores are all a reader needs (stragglers.jsonl stays small)."""
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return round(value, 6) if isinstance(value, float) else value


def speed_without(table, rank):
    """The job's speed now over its speed without ``rank``: the step follows the slowest busy rank."""
    busy = [row["step_s"] - row["comm_s"] for row in table]
    transfer = min(row["comm_s"] for row in table)  # the slowest rank waits for no one
    others = [b for r, b in enumerate(busy) if r != rank]
    if not others:
        return 1.0
    return (max(others) + transfer) / (max(busy) + transfer)


class StragglerWatch:
    """Reads this rank's step timings and, every ``interval`` steps, scores every rank. Collective."""

    def __init__(self, settings, rank, size, timer=None, gather_placement=None):
        """``timer``: the SectionTimer the trainer times its steps with; ``gather_placement()``: every
        rank's host, node and address in rank order (dist.Context.placement: collective once per world)."""
        self.interval = settings.straggler_interval
        self.threshold = settings.straggler_threshold
        self.patience = settings.straggler_patience
        self.action = settings.straggler_action
        self.timer = timer or SectionTimer()
        self.gather_placement = gather_placement
        self.new_world(rank, size)

    def new_world(self, rank, size):
        """A new world (a start, an --elastic reset): hosts, bests and streaks start over."""
        self.rank, self.size = rank, size
        self.placement = None  # every rank's host, node and address: read once per world
        self.best_busy = None
        self.below = [0] * size  # intervals in a row below the threshold
        self.named = set()  # ranks already named, until they recover
        self.latest = None  # the latest interval's table
        self.launch_steps = 0
        self.timer.reset()

    def check(self, step):
        """After every step; every ``interval`` steps a collective. Returns a Straggler to act on, or None."""
        self.timer.steps += 1
        self.launch_steps += 1
        if self.launch_steps == WARMUP_STEPS:
            self.timer.reset()  # intervals time steady steps only
        if not self.interval or self.size < 2 or step % self.interval or self.timer.steps < 2:
            return None
        per_step = self._gather()
        self.timer.reset()
        table = scores(per_step, self.best_busy)
        self.best_busy = [row["best_busy_s"] for row in table]
        self.locate(table)
        self.latest = {"step": step, "ranks": table}
        return self._verdict(table)

    def locate(self, table):
        """Each row's host, from the placement; where several nodes report one name, its address too."""
        hosts = [place["host"] for place in self.placement]
        shared = peers.shared_names(hosts, [place.get("node", place["host"]) for place in self.placement])
        for row in table:
            place = self.placement[row["rank"]]
            row["host"] = place["host"]
            if place["host"] in shared:
                row["named_alike"], row["address"] = shared[place["host"]], place["address"]

    def _gather(self):
        if self.placement is None:
            self.placement = self.gather_placement()  # Horovod: where every rank runs, once per world
        mine = torch.tensor([[self.timer.seconds[s] / self.timer.steps for s in SECTIONS]], dtype=torch.float64)
        # Horovod: every rank's seconds per step in each section, on every rank
        gathered = collectives.allgather(mine, name="hvdtrain.stragglers.times")
        return [dict(zip(SECTIONS, row)) for row in gathered.tolist()]

    def _verdict(self, table):
        """Streaks below the threshold; the worst rank whose streak reached the patience, once."""
        for row in table:
            low = row["relative"]["busy"] < self.threshold
            self.below[row["rank"]] = self.below[row["rank"]] + 1 if low else 0
            if not low:
                self.named.discard(row["rank"])
        due = [row for row in table if self.below[row["rank"]] >= self.patience and row["rank"] not in self.named]
        if not due:
            return None
        row = min(due, key=lambda r: r["relative"]["busy"])
        self.named.add(row["rank"])
        section, other = sorted(("data", "compute"), key=lambda s: row["relative"][s])
        return Straggler(row["rank"], row["host"], section, row["relative"][section], other,
                         row["relative"][other], self.below[row["rank"]], speed_without(table, row["rank"]),
                         row.get("named_alike", 1), row.get("address", ""))

    def latest_at(self, step):
        """True when the latest interval's table is of ``step`` (it was made after this step)."""
        return self.latest is not None and self.latest["step"] == step

    def summary(self):
        """For results.json: the latest interval's per-rank table (None before the first)."""
        return self.latest


def write_host(path, host):
    Path(path).write_text(host + "\n")


def exclude_host(path, host):
    """Add ``host`` to the excluded-hosts file, atomically (discovery may read it at any moment)."""
    path = Path(path)
    listed = path.read_text().split() if path.exists() else []
    new = path.with_name(path.name + ".new")
    new.write_text("".join(f"{name}\n" for name in dict.fromkeys([*listed, host])))
    new.replace(path)
