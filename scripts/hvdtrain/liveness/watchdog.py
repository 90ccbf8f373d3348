"""The progress watchdog: a rank that stops making progress ends itself with one line.

Every rank runs one (``dist.setup`` starts it): the training loop reports each
finished step, long legitimate phases say so, and a daemon thread ends the
process when nothing happens for longer than the limit. On the rank that speaks
for the job the same thread judges the heartbeat's statuses once a second
(judge.py) and ends the job at once when a hang is certain (a rank exited, lost,
or the ranks deadlocked in collectives that cannot match); the limit is for what
is not certain.

The living are not ended for being slow: a rank busy in its own code (outside
any collective) is ended only when other ranks have waited for it longer than
the limit, and ranks that are all busy (nobody waits) get the long phases' limit.
A rank that waits in a collective counts its time from the start of that wait,
not from its last step: a long step everywhere is no hang of the first to finish.
"""
import collections
import contextlib
import os
import sys
import threading
import time

from hvdtrain.errors import WATCHDOG_EXIT, UsageError
from hvdtrain import durations, testhooks
from hvdtrain.liveness import failures, judge, recorder as flight, teardown
from hvdtrain.liveness.peers import SILENT_SECONDS, judged_limit, rank_list, this_host
from hvdtrain.liveness.recorder import main_thread_place as _main_thread_place

# A rank that freezes (alive but silent) would otherwise hang the job forever:
# Horovod's stall check only warns unless a shutdown time is set, and with the
# Gloo controller it does not shut down even then (measured: a job with a frozen
# rank still hung after 180 s). So every rank also runs a progress watchdog.
# Its limit adapts to the job: STEP_FACTOR times the slowest of the recent steps,
# never below a floor. Steps of a few seconds give the floor: a hang is caught
# within about a minute, while a job with 30 s steps still gets 300 s.
DEFAULT_FLOOR_SECONDS = 60
FLOOR_ENV = "HVDTRAIN_WATCHDOG_FLOOR_SECONDS"
STEP_FACTOR = 10
RECENT_STEPS = 100
# A rank that waits in a collective fires this much later than its limit, so that
# the rank that caused the wait (stuck in its own code) names itself first.
WAITING_GRACE_SECONDS = 5
# Once another rank has said the job's line, this rank exits this much later if its launcher has not
# ended it: the launcher's own report comes first where it is quick.
QUIET_EXIT_SECONDS = 1.0
# A fixed limit instead (0 turns the watchdog off).
WATCHDOG_ENV = "HVDTRAIN_WATCHDOG_SECONDS"
# Legitimate long phases (4 GB checkpoint writes on a shared file system, a first
# torch.compile step, evaluation) get their own, longer limit; so does everything
# before the first step of a launch (imports, data, the first step itself).
DEFAULT_PHASE_SECONDS = 1800
PHASE_ENV = "HVDTRAIN_PHASE_SECONDS"


class Watchdog:
    """Ends this process when the training loop stops making progress.

    The loop calls ``step(n)`` after each training step and may call ``beat()``
    for other progress. If nothing comes for longer than the limit (this rank
    waits forever in a collective that a frozen or dead rank never joins, or is
    stuck itself), a daemon thread prints one line saying which and exits the
    process; the launcher (horovodrun, mpirun, srun) then ends the other ranks.

    The limit is ``fixed`` when given, else max(``floor``, STEP_FACTOR x the
    slowest recent step). Long legitimate phases (a checkpoint write, loading
    shards, an evaluation, an export) run inside ``with watchdog.phase("what"):``
    on every rank: there the limit is ``phase_timeout``, and so it is before the
    first step of this launch (which may compile). A rank that waits there in a
    collective for ranks the heartbeat no longer hears (a node frozen, dead or
    cut off during an evaluation) is no legitimate phase: it gets the step limit.
    """

    def __init__(self, rank, fixed=None, floor=DEFAULT_FLOOR_SECONDS, phase_timeout=DEFAULT_PHASE_SECONDS,
                 watch=True):
        self.rank = rank
        self.fixed = fixed
        self.floor = floor
        self.phase_timeout = max(fixed or 0, phase_timeout)
        self.recent = collections.deque(maxlen=RECENT_STEPS)  # seconds of the latest steps
        self.step_number = None  # the latest finished step; None before the first
        self.last_beat = time.monotonic()
        self.current_phase = None
        self.peers = None  # liveness/peers.py: who else is alive, to name them (dist.setup)
        self.size = None  # ranks in the job (dist.setup); None: unknown
        self.speaking = False  # this rank is saying the job's line (``_end``)
        if watch and fixed != 0:  # watch=False: only the limits (tests)
            threading.Thread(target=self._watch, name="hvdtrain-watchdog", daemon=True).start()

    def beat(self):
        self.last_beat = time.monotonic()

    def step(self, number=None):
        """A training step finished: progress, and a sample of how long steps take. A one-line
        failure report from now on says "after step N"; a test may plant a fault here."""
        now = time.monotonic()
        if self.step_number is not None and self.current_phase is None:
            self.recent.append(now - self.last_beat)  # not the first step: it may compile
        self.step_number = number if number is not None else (self.step_number or 0) + 1
        self.last_beat = now
        flight.note_step(self.step_number)
        failures.note_step(self.step_number)
        testhooks.after_step(self.rank, self.step_number)  # test-only fault injection (HVDTRAIN_FAULT)

    @contextlib.contextmanager
    def phase(self, name):
        """A long step of work that beats once at its start and once at its end."""
        outer = self.current_phase
        self.current_phase = name
        self.beat()
        try:
            with durations.timed(name):
                testhooks.phase_entered(self.rank, self.step_number, name)  # test-only (HVDTRAIN_FAULT)
                yield
        finally:
            self.current_phase = outer
            self.beat()

    def limit(self):
        """(seconds, what set them) for the current moment."""
        if self.current_phase:
            return self.phase_timeout, f"{PHASE_ENV}={self.phase_timeout:g}"
        if self.step_number is None and not self.fixed:
            return self.phase_timeout, f"before the first step, {PHASE_ENV}={self.phase_timeout:g}"
        return self.step_limit()

    def step_limit(self):
        """(seconds, what set them) between two training steps."""
        if self.fixed:
            return self.fixed, f"{WATCHDOG_ENV}={self.fixed:g}"
        slowest = max(self.recent, default=0.0)
        if STEP_FACTOR * slowest > self.floor:
            return STEP_FACTOR * slowest, f"{STEP_FACTOR} x the slowest recent step, {slowest:.1f} s"
        return self.floor, f"{FLOOR_ENV}={self.floor:g}"

    def _watch(self):
        frozen = 0.0  # seconds this whole process was stopped (SIGSTOP), as seen on waking
        while True:
            nap = min(5.0, max(0.2, self.limit()[0] / 10))
            if self.peers is not None and self.peers.listens:
                nap = min(nap, judge.JUDGE_SECONDS)
            before = time.monotonic()
            if self.peers is not None and self.peers.reported.wait(nap):
                self._leave_quietly()  # the job's line is out (another rank spoke)
                time.sleep(nap)  # back here only where this rank says its own line: its exit follows
                continue
            if self.peers is None:
                time.sleep(nap)
            overslept = time.monotonic() - before - nap
            if overslept > max(2.0, nap):  # no thread ran: the process itself was frozen
                frozen = overslept
            if not frozen:
                self._judge()
            silent = time.monotonic() - self.last_beat
            limit, why = self.limit()
            lost = not frozen and silent > self.step_limit()[0] and self._peers_lost()
            if lost:  # inside a long phase, waiting for ranks that will not come: the step limit
                limit, why = self._lost_limit()
            waiting = _main_thread_place()[0]
            if waiting and not lost:
                silent = min(silent, self._waited(silent))  # since it began to wait, not since its last step
            if silent <= limit or failures.REPORTING.is_set():  # a failure's line is being said: that one
                frozen = 0.0  # progress since: stopped and continued (Ctrl-Z, fg) is no hang
            elif frozen or lost or (silent > limit + WAITING_GRACE_SECONDS if waiting else self._holds(silent, limit)):
                if not frozen and self._another_rank_speaks(lost):
                    # One line for the job: rank 0's (or its deputy's, when rank 0's node is the
                    # one lost), naming who is missing; its exit ends this rank through the
                    # launcher. Should the speaker fall silent too, this rank speaks.
                    while self.peers.speaker() != self.rank and not self.peers.reported.is_set():
                        time.sleep(1.0)
                if self.peers is not None and (self.rank != 0 or frozen) and self.peers.reported.wait(2.0):
                    self._dump("the watchdog (another rank spoke)")
                    os._exit(WATCHDOG_EXIT)  # the speaker has named this rank already
                self._end(self._cause(silent, frozen, lost), f"limit {limit:.0f} s: {why}")

    def _judge(self):
        """The rank that speaks for the job: end it now if the heartbeat's statuses make a hang certain."""
        peers = self.peers
        if peers is None or not peers.listens or peers.speaker() != self.rank or peers.reported.is_set() \
                or failures.REPORTING.is_set():
            return
        verdict = peers.judge()
        if verdict is None:
            return
        silent = time.monotonic() - self.last_beat
        lost = peers.fell_silent() if verdict.kind == "lost" else []
        self._end(f"no training progress for {silent:.0f} s {self._when()}: {verdict.finding}",
                  f"certain, not a limit: {_CERTAIN[verdict.kind]}", then=lambda: peers.wake(lost))

    def _leave_quietly(self):
        """Another rank has printed the job's line and ends it: this rank follows within
        QUIET_EXIT_SECONDS, with no line of its own, whether or not its launcher ends it first (srun
        sends SIGTERM, which a rank waiting in a collective cannot act on, and kills only after
        its KillWait). Not while this rank says its own line (a failure it reports, or the watchdog's)."""
        time.sleep(QUIET_EXIT_SECONDS)
        if self.speaking or failures.REPORTING.is_set():
            return
        self._dump("another rank spoke")
        teardown.end_own_children()
        os._exit(WATCHDOG_EXIT)

    def _end(self, cause, why, then=None):
        """This rank's one line for the job, its flight record, and its exit; the launcher ends the rest.
        ``then()``: once the others know the line is out (the judge wakes the frozen ranks it named)."""
        self.speaking = True
        self._dump("the watchdog")
        print(f"rank {self.rank}: error: {cause}; aborting ({why})", file=sys.stderr, flush=True)
        if self.peers is not None:  # the others add no line of their own
            self.peers.announce_reported()
        if then is not None:
            then()
        # Whatever the heartbeat heard (a lost node may be one it never heard): the
        # launcher of this rank's node must end, and may wait forever for a cut-off node.
        teardown.end_a_stuck_launcher()
        teardown.end_own_children()
        os._exit(WATCHDOG_EXIT)

    def _waited(self, silent):
        """Seconds this rank's training thread has waited for a collective to complete (the recorder's),
        else ``silent``."""
        since = flight.RECORDER.waits_since if flight.RECORDER is not None else None
        return silent if since is None else time.monotonic() - since

    def _holds(self, silent, limit):
        """Does this rank, busy outside any collective for ``silent`` s, hold the job? Yes where others
        have waited for it longer than ``limit``, or in a phase or under a fixed limit (its own time
        is what is limited), or past the phases' limit; not where nobody waits (a long step everywhere).
        Without a heartbeat to ask (none answered), yes as soon as a rank with peers passes the limit."""
        if self.fixed or self.current_phase or self.step_number is None or silent > self.phase_timeout:
            return True
        waited = self.peers.others_waited() if self.peers is not None else None
        if waited is None:
            return self.size != 1
        return waited > limit

    def _peers_lost(self):
        """Inside a long phase or before the first step: this rank waits in a collective
        while the heartbeat says ranks are lost for longer than the step limit."""
        if self.peers is None or not (self.current_phase or self.step_number is None):
            return False
        return _main_thread_place()[0] and self.peers.lost_for(self.step_limit()[0])

    def _lost_limit(self):
        """The step limit, as the heartbeat can judge it (it hears nobody lost sooner)."""
        seconds, why = self.step_limit()
        judged = judged_limit(seconds)
        return (seconds, why) if judged == seconds else (judged, f"{why}, raised to the heartbeat's {judged:g} s")

    def _another_rank_speaks(self, lost=False):
        """True on a rank that waits in a collective while the rank that speaks for the job
        (rank 0, or its deputy) is alive and heard."""
        if self.peers is None or (self.current_phase and not lost):
            return False
        return _main_thread_place()[0] and self.peers.speaker() != self.rank

    def _cause(self, silent, frozen, lost=False):
        if frozen:
            return (f"this process was frozen (stopped) for {frozen:.0f} s "
                    f"{self._when()}, e.g. by SIGSTOP or a stalled node")
        if lost:
            missing = self._missing()
            doing = self.current_phase or "starting"
            return (f"{doing} for {silent:.0f} s {self._when()}: waiting in a collective for ranks that "
                    f"will not join" + (f"; {missing}" if missing else ""))
        if self.current_phase:
            return f"{self.current_phase} took more than {silent:.0f} s"
        waiting, place, doing = _main_thread_place()
        if waiting:
            missing = self._missing()
            diverged = None if missing else self._divergence()
            if diverged:
                return f"no training progress for {silent:.0f} s {self._when()}: {diverged}"
            return (f"no training progress for {silent:.0f} s {self._when()}: waiting in a collective for "
                    f"another rank that is frozen, deadlocked or dead" + (f"; {missing}" if missing else ""))
        others = self.peers.summary if self.peers is not None else ""
        waited = self.peers.others_waited() if self.peers is not None else None
        stuck = "in its data loader" if doing == "data loader" else "outside any collective"
        return (f"no training progress for {silent:.0f} s {self._when()}: this rank's main thread is stuck "
                f"{stuck}, at {place}" + (f", while {others}" if others else "")
                + (f" for {waited:.0f} s: rank {self.rank} on {this_host()} holds the job" if waited else ""))

    def _divergence(self):
        """A listener that heard every rank: which ranks wait in which collective and which rank is
        elsewhere (flight recorder statuses, recorder.divergence), or None where they agree."""
        if self.peers is None or not self.peers.listens:
            return None
        statuses = self.peers.heard_statuses()
        if len(statuses) < len(self.peers.hosts):
            return None
        return flight.divergence(statuses, rank_list)

    def _dump(self, reason):
        """This rank's recent collectives, written beside the run's output (recorder.dump)."""
        flight.dump(f"{reason} after step {self.step_number}")

    def _missing(self):
        """A listener's "not heard from ranks ... (all 4 on node-d) ...", else ""."""
        return self.peers.who_is_silent() if self.peers is not None and self.peers.listens else ""

    def _when(self):
        return "before the first step" if self.step_number is None else f"after step {self.step_number}"


_CERTAIN = {  # why a judged line needs no limit (judge.Verdict.kind)
    "exited": "a rank that exited never joins",
    "lost": f"a rank not heard for {SILENT_SECONDS:g} s (four beats) is frozen, dead or cut off",
    "deadlocked": "no collective is in flight on every rank, and a waiting rank makes no other",
}


def from_env(rank):
    """This rank's watchdog with the limits the environment sets (one line on a bad value)."""
    return Watchdog(rank, fixed=_seconds_from_env(WATCHDOG_ENV, None),
                    floor=_seconds_from_env(FLOOR_ENV, DEFAULT_FLOOR_SECONDS), phase_timeout=phase_seconds())


def phase_seconds():
    """The limit of a long phase (and of everything before a launch's first step)."""
    return _seconds_from_env(PHASE_ENV, DEFAULT_PHASE_SECONDS)


def _seconds_from_env(name, default):
    """A number of seconds from the environment; a bad value stops with one line naming it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise UsageError(f"{name}={text!r}: expected a number of seconds (0 or more)")
    return value
