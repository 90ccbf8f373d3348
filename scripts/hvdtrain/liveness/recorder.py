"""The flight recorder: every rank's recent collectives, so a hang names the collective it diverged at.

The most common hang in an edited script is not a dead rank but a rank-divergent
collective: code that runs a collective on some ranks and not on others (a metric
averaged on rank 0 alone, an early ``continue`` on one rank, another tensor name).
Every rank waits forever, each in another collective. So each rank keeps its last
``CAPACITY`` collectives (Horovod's and the package's, the gradients' too: every
submission through horovod.torch, hooked once by ``runtime.collectives.record_into``):
a per-rank sequence number, the op, the name, the tensors' shapes and dtypes, when it
was submitted and done, and the script line that made it (the innermost frame outside
the libraries: the user's line, or the trainer's).

A summary of it (``status``) rides on every heartbeat datagram (liveness/peers.py), so
rank 0 knows where every rank is without Horovod, which is the thing that is stuck; the
watchdog's one line then says which ranks wait in which collective and which rank is
where instead (``divergence``). Each rank also writes its records as JSON
(``dump``) when the job ends by the watchdog, a failure or a signal;
scripts/flight_dumps.py merges them and prints the same finding.

No torch, no Horovod here: the 1,024-rank simulation (tools/liveness_sim.py) runs it.
"""
import collections
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

DUMP_DIR = "flight-recorder"  # in the run's --output-dir: each rank's dump, rank-NNNNN.json
CAPACITY = 256  # records per rank: a step's gradient tensors and the votes around them, several steps back
LIBRARIES = tuple(os.sep + part + os.sep for part in ("hvdtrain", "horovod", "torch", "transformers"))
# Frames of these files are no script line: contextlib, threading, the recorder's own hooks.
_SKIPPED_FILES = ("contextlib.py", "threading.py", "functools.py")


def script_line(skip=2):
    """"train_cnn.py:214": the innermost frame outside the libraries (the package, Horovod, torch),
    the line that made the collective; where there is none, the innermost frame."""
    frame = sys._getframe(1)
    for _ in range(skip - 1):  # the caller's callers, as far as the stack goes
        frame = frame.f_back or frame
    first = None
    while frame is not None:
        name = frame.f_code.co_filename
        if first is None:
            first = frame
        if not any(part in name for part in LIBRARIES) and not name.endswith(_SKIPPED_FILES) \
                and not name.startswith("<"):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return f"{os.path.basename(first.f_code.co_filename)}:{first.f_lineno}" if first else "?"


class Record:
    """One collective: its sequence number, op, name, tensors, script line, when submitted and done
    (None while in flight). ``tensors``: (dtype, shape, how many more), written out only when read.

    A burst (DistributedOptimizer's gradients: one submission per parameter, from one backward
    pass) is one record: ``count`` tensors, ``last`` the latest one's name, done once all are.
    """

    __slots__ = ("seq", "op", "first", "last", "count", "pending", "tensors", "where", "submitted", "done")

    def __init__(self, seq, op, name, tensors, where):
        self.seq, self.op, self.first, self.last, self.tensors, self.where = seq, op, name, name, tensors, where
        self.count = self.pending = 1
        self.submitted, self.done = time.time(), None

    @property
    def name(self):
        """The collective's name; a burst's: "59 gradients (grad.conv1.weight ... grad.fc.bias)"."""
        if self.count == 1:
            return self.first
        return f"{self.count} gradients ({self.first} ... {self.last})"

    @property
    def detail(self):
        """"float32[64, 3, 3, 3]", and how many more tensors where there are several."""
        dtype, shape, more = self.tensors
        more += self.count - 1
        text = f"{str(dtype).replace('torch.', '')}{list(shape)}"
        return f"{text} and {more} more" if more else text

    def as_dict(self):
        return {"seq": self.seq, "op": self.op, "name": self.name, "detail": self.detail, "where": self.where,
                "submitted": round(self.submitted, 3), "done": None if self.done is None else round(self.done, 3)}


class FlightRecorder:
    """This rank's recent collectives and what its main thread does between them."""

    def __init__(self, rank, capacity=CAPACITY, place=None):
        """``place()``: (waiting in a collective?, "file:line", "compute" or "data loader") of the
        thread that trains: the main thread's (``main_thread_place``), or a simulated rank's."""
        self.rank = rank
        self.place = place or main_thread_place
        self.records = collections.deque(maxlen=capacity)
        self.seq = 0  # collectives this rank submitted in this world
        self.in_flight = {}  # handle -> Record
        self.failed = None  # the Record whose collective raised (a mismatch Horovod found)
        self.waits_since = None  # monotonic time the thread that trains began to wait for a collective
        self.step = None  # the latest finished step (the watchdog's)
        self.dump_dir = None  # where ``dump`` writes (the run's output directory, Run.begin)

    def new_world(self, rank):
        """After an --elastic reset: sequence numbers start over with the new world's ranks."""
        self.rank, self.seq = rank, 0
        self.in_flight.clear()

    def submitted(self, handle, op, name, tensors, skip=3, burst=False, count=1, last=None):
        """A collective submitted (``handle``: what its completion is known by; ``tensors``: (dtype, shape,
        how many more)). ``burst``: one of a burst of submissions (DistributedOptimizer's gradients, one
        per parameter during backward, or one per bucket of them): while the burst's record is in flight,
        this one joins it. ``count`` tensors, from ``name`` to ``last``, went in this one submission.

        No lock: a deque append and a dict store are atomic in CPython, and the heartbeat thread only
        copies them (``waiting_in``): about 3 us for a record, well under 1 us for a gradient that joins
        one (docs/performance.md).
        """
        if burst:
            latest = self.records[-1] if self.records else None
            if latest is not None and latest.done is None and latest.first.startswith(GRADIENT):
                latest.count, latest.pending, latest.last = latest.count + count, latest.pending + 1, last or name
                self.in_flight[handle] = latest
                return latest
        self.seq += 1
        record = Record(self.seq, op, name, tensors, script_line(skip))
        record.count, record.last = count, last or name
        self.records.append(record)
        self.in_flight[handle] = record
        return record

    def failed_at(self, handle):
        """The collective of ``handle`` raised: kept as ``failed`` for the one line."""
        self.failed = self.in_flight.pop(handle, None)

    def wait_started(self):
        """The thread that trains waits for a collective to complete (Horovod's ``synchronize``): it can
        submit no other until it returns, which is what lets the judge (judge.py) call a deadlock certain."""
        self.waits_since = time.monotonic()

    def wait_ended(self):
        self.waits_since = None

    def completed(self, handle):
        record = self.in_flight.pop(handle, None)
        if record is not None:
            record.pending -= 1
            if not record.pending:
                record.done = time.time()

    def waiting_in(self):
        """The collectives in flight, oldest first (a burst once)."""
        return sorted({id(record): record for record in list(self.in_flight.values())}.values(),
                      key=lambda record: record.seq)

    def status(self):
        """What the heartbeat carries: where this rank is, in a few hundred bytes (see ``describe``)."""
        waiting = self.waiting_in()
        waiting_main, place, doing = self.place()
        status = {"rank": self.rank, "process": f"{PID_NAMESPACE}/{os.getpid()}", "step": self.step,
                  "seq": self.seq, "place": place[-120:], "in": "collective" if waiting_main else doing}
        since = self.waits_since
        if since is not None:
            status["blocked"] = round(time.monotonic() - since, 1)
        if self.failed is not None:
            status["failed"] = {"name": self.failed.name, "where": self.failed.where, "detail": self.failed.detail}
        if waiting:
            first = waiting[0]
            status.update(op=first.op, name=group_name([record.name for record in waiting]), first=first.seq,
                          count=len(waiting), where=first.where, since=round(time.time() - first.submitted, 1),
                          detail=first.detail[:60], keys=collective_keys(waiting))
        return status

    def dump(self, reason):
        """This rank's records as JSON in ``dump_dir`` (flight-recorder/rank-NNNNN.json); the path, or None."""
        if self.dump_dir is None:
            return None
        records = [record.as_dict() for record in list(self.records)]
        payload = {"rank": self.rank, "step": self.step, "reason": reason, "written": round(time.time(), 3),
                   "status": self.status(), "records": records}
        path = Path(self.dump_dir) / f"rank-{self.rank:05d}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(payload))
            os.replace(tmp, path)
        except OSError:
            return None
        return path


RECORDER = None  # this process's, once dist.setup made it (the watchdog, the heartbeat, failures read it)
SWITCH_ENV = "HVDTRAIN_FLIGHT_RECORDER"  # 0: no recorder (its cost measured against it: docs/performance.md)


def enabled(env):
    """Whether this process records its collectives (on unless HVDTRAIN_FLIGHT_RECORDER=0)."""
    return env.get(SWITCH_ENV, "1").strip() != "0"


def install(rank):
    """This process's recorder (one per process)."""
    global RECORDER
    RECORDER = FlightRecorder(rank)
    return RECORDER


# This process's recorder, where there is one: the calls the runtime and the liveness code make
# whether recording is on or off (HVDTRAIN_FLIGHT_RECORDER=0: each does nothing).
def dump(reason):
    """The recorder's dump (its path), or None without a recorder."""
    return RECORDER.dump(reason) if RECORDER is not None else None


def note_step(number):
    if RECORDER is not None:
        RECORDER.step = number


def note_world(rank):
    if RECORDER is not None:
        RECORDER.new_world(rank)


def dump_into(directory):
    """Dumps go to ``directory`` from now on."""
    if RECORDER is not None:
        RECORDER.dump_dir = directory


def main_thread_place():
    """(waiting in Horovod?, "file:line in function" of its innermost frame, what it does outside a
    collective: "data loader" or "compute") of the main thread."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    try:
        stack = traceback.extract_stack(frame) if frame else []
    finally:
        # Read from the main thread itself (a dump), ``frame`` is this call's own frame: kept in
        # its own local it would be a cycle holding every caller's locals (a DataLoader iterator,
        # whose workers multiprocessing's exit then waits for) until the collector runs.
        del frame
    if not stack:
        return False, "an unknown place", "compute"
    waiting = any(f"{os.sep}horovod{os.sep}" in entry.filename for entry in stack)
    loading = any(_DATA_LOADER in entry.filename for entry in stack)
    innermost = stack[-1]
    return (waiting, f"{os.path.relpath(innermost.filename)}:{innermost.lineno} in {innermost.name}",
            "data loader" if loading else "compute")


_DATA_LOADER = os.path.join("torch", "utils", "data")




def _pid_namespace():
    """This process's pid namespace: a listener looks a rank's process up by its pid only in its own
    (judge.py: a rank that exited), not in another container's sharing the node's network."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # not Linux
        return "?"


PID_NAMESPACE = _pid_namespace()
KEYS_CHARACTERS = 600  # the collectives in flight that a status lists, at most this long (a datagram is 2 KiB)


def collective_key(record):
    """What must be the same on every rank for a collective to complete: "allreduce user.metric". A
    burst of gradients is "allreduce gradients": which of them each rank has submitted varies mid-step."""
    return f"{record.op} {'gradients' if record.first.startswith(GRADIENT) else record.first}"


def collective_keys(records):
    """The keys of the collectives in flight, oldest first, ending in "..." where they do not all fit."""
    keys, size = [], 0
    for key in dict.fromkeys(collective_key(record) for record in records):
        size += len(key) + 4
        if size > KEYS_CHARACTERS:
            return keys + ["..."]
        keys.append(key[:200])
    return keys


GRADIENT = "grad."  # the recorder's prefix for DistributedOptimizer's gradients (Horovod names them by parameter)


def group_name(names):
    """A name for several collectives in flight at once: the first's and how many more."""
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


def describe(status):
    """One rank's status in words: "waits in allreduce user.metric (#1235, my_model.py:12)",
    "is in its data loader (at dataloader.py:630 in _next_data)", "is in compute (at ...)"."""
    if status.get("first") is not None:
        return f"waits in {status['op']} {status['name']} (#{status['first']}, {status['where']})"
    if status.get("in") == "data loader":
        return f"is in its data loader (at {status.get('place')})"
    return f"is in {status.get('in', 'compute')} outside any collective (at {status.get('place')})"


def divergence(statuses, rank_list):
    """The one line's finding from every rank's status ({rank: status}), or None where all agree.

    The ranks grouped by what they do: the same collective (op and name), or none; where
    the groups differ, "ranks 0, 2-1023 wait in allreduce 65 gradients (#1235, train_cnn.py:210);
    rank 1 waits in allreduce user.metric (#1235, my_model.py:12): the ranks made different
    collectives". ``rank_list`` writes rank numbers as ranges (peers.rank_list).
    """
    groups = collections.OrderedDict()
    for rank in sorted(statuses):
        status = statuses[rank]
        key = (status.get("op"), status.get("name")) if status.get("first") is not None else ("-", status.get("in"))
        groups.setdefault(key, []).append(rank)
    if len(groups) < 2:
        return None
    parts = []
    for ranks in sorted(groups.values(), key=len, reverse=True):  # the many first, the odd ones out after
        verb = describe(statuses[ranks[0]])
        if len(ranks) > 1:
            verb = verb.replace("waits in", "wait in", 1).replace("is in", "are in", 1)
        parts.append(f"{rank_list(ranks)} {verb}")
    waiting = [key for key in groups if key[0] != "-"]
    cause = ("the ranks made different collectives" if len(waiting) > 1 else
             f"{rank_list([r for key, ranks in groups.items() if key[0] == '-' for r in ranks])} never reached "
             "the collective")
    return "; ".join(parts) + f": {cause}"


def sides(statuses, rank_list=None):
    """A failed collective on each side: "rank 0: user.metric float32[3] at m.py:10; rank 1: user.metric
    float32[4] at m.py:10" (ranks with the same one grouped), from statuses with a "failed" record."""
    groups = {}
    for rank, status in sorted(statuses.items()):
        failed = status.get("failed")
        if failed:
            groups.setdefault(f"{failed['name']} {failed['detail']} at {failed['where']}", []).append(rank)
    names = rank_list or (lambda ranks: ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks)))
    return "; ".join(f"{names(ranks)}: {text}" for text, ranks in groups.items())


def read_dumps(directory):
    """{rank: dump} of every rank-*.json in ``directory``."""
    dumps = {}
    for path in sorted(Path(directory).glob("rank-*.json")):
        try:
            dump = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        dumps[dump["rank"]] = dump
    return dumps


def first_difference(dumps):
    """Where the ranks' records first differ: (seq, {rank: record or None}), or None where they agree.

    Records are matched by sequence number; a rank without a record of that number (it
    never made it, or its dump ends earlier) counts as a difference only while it made
    collectives after the others stopped agreeing.
    """
    by_rank = {rank: {record["seq"]: record for record in dump["records"]} for rank, dump in dumps.items()}
    seqs = sorted({seq for records in by_rank.values() for seq in records})
    oldest_kept = max(min(records) for records in by_rank.values() if records) if any(by_rank.values()) else 0
    for seq in seqs:
        if seq < oldest_kept:
            continue  # some rank's ring buffer no longer holds it
        at = {rank: records.get(seq) for rank, records in by_rank.items()}
        kinds = {(record["op"], record["name"]) if record else None for record in at.values()}
        if len(kinds) > 1:
            return seq, at
    return None
