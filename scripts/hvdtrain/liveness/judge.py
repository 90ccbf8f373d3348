"""A hang decided from certainty: what the heartbeat's statuses prove, without waiting for a limit.

The rank that speaks for the job (rank 0, or its deputy when rank 0 is not heard:
peers.py) reads every rank's flight-recorder status from the heartbeat once a
second (JUDGE_SECONDS) and ends the job as soon as one of three things is
certain while a rank waits in a collective (its training thread inside Horovod's
``synchronize`` for BLOCKED_SECONDS, recorder.FlightRecorder.wait_started):

- **exited**: a rank's process on the listener's own node is gone (its pid, in
  the same pid namespace, no longer runs): it will never join;
- **lost**: a rank has not been heard for SILENT_SECONDS (four beats): frozen,
  dead on another node or cut off; whoever waits for it waits forever;
- **deadlocked**: every rank waits in a collective, all were waiting at one
  moment, at one position of their sequences, and no collective is in flight on
  every rank (another name, another op, or one rank's next one): a collective
  completes only once every rank has submitted it, and a rank whose training
  thread waits submits nothing more, so none can ever complete. (A rank whose
  oldest collective in flight another rank has completed will complete it.)

Anything less certain (a rank alive and busy in its own code while the others
wait for it) is the progress watchdog's, after its limit (watchdog.py): the
living are never ended for being slow. No torch, no Horovod here: the 1,024-rank
simulation (tools/liveness_sim.py) runs the same judge.
"""
from dataclasses import dataclass

from hvdtrain.liveness import recorder as flight

JUDGE_SECONDS = 1.0  # how often the speaking listener judges
# A rank waiting this long in synchronize counts as waiting: a step's normal waits are shorter,
# and a rank's beat reports it within one beat (BEAT_SECONDS) of it.
BLOCKED_SECONDS = 2.0
UNKNOWN = "..."  # a status whose collectives did not all fit (recorder.collective_keys): nothing is certain


@dataclass
class Verdict:
    kind: str  # "exited", "lost" or "deadlocked"
    finding: str  # what the line says after "rank R: error: "
    waited: float  # how long the longest-waiting rank has waited (for the line)


def waiting_ranks(statuses):
    """{rank: seconds} of the ranks whose training thread has waited in a collective BLOCKED_SECONDS."""
    return {rank: status["blocked"] for rank, status in statuses.items()
            if status.get("blocked", 0) >= BLOCKED_SECONDS and status.get("first") is not None}


def verdict(statuses, received, size, lost_text, exited_text, rank_list):
    """What is certain about the job now, or None.

    ``statuses``: {rank: status} of the ranks heard lately (this rank's own included);
    ``received``: {rank: monotonic time its status arrived}; ``size``: the ranks in the job;
    ``lost_text()``: "not heard from rank 3 (1 of 4 on node-b) for 9 s: ..." or "";
    ``exited_text()``: "rank 3 (1 of 4 on node-a) has exited (pid 4242 is gone)" or "".
    """
    waiting = waiting_ranks(statuses)
    if not waiting:
        return None
    longest = max(waiting.values())
    who = f"{rank_list(sorted(waiting))} waiting in {_their_collective(statuses, waiting)}"
    exited = exited_text()
    if exited:
        return Verdict("exited", f"{exited}, with {who}", longest)
    lost = lost_text()
    if lost:
        return Verdict("lost", f"{lost}, with {who}", longest)
    if len(statuses) < size or len(waiting) < size or not _waited_together(statuses, received):
        return None
    keys = [statuses[rank].get("keys") or [] for rank in sorted(statuses)]
    if any(not these or UNKNOWN in these for these in keys):
        return None
    if set.intersection(*map(set, keys)):
        return None  # a collective every rank made: it can still complete
    if len({statuses[rank]["first"] for rank in statuses}) > 1:
        # A rank past another's oldest collective in flight completed it, so every rank submitted it: it
        # can still complete (a collective completes rank by rank; under load one rank took 5 s more).
        return None
    finding = flight.divergence(statuses, rank_list)
    return Verdict("deadlocked", f"{finding} ({what_differs(statuses)})", longest) if finding else None


def _their_collective(statuses, waiting):
    first = statuses[min(waiting, key=lambda rank: -waiting[rank])]
    return f"{first['op']} {first['name']} (#{first['first']}, {first['where']})"


def _waited_together(statuses, received):
    """Were all the ranks waiting at one moment? Each status says how long its rank had waited when
    it was sent (about when it arrived): the latest start of a wait before the earliest status."""
    started = [received[rank] - statuses[rank]["blocked"] for rank in statuses]
    return max(started) <= min(received[rank] for rank in statuses)


def what_differs(statuses):
    """How the ranks' first collectives in flight differ, as torchfrtrace sorts mismatches: the op,
    the name, the position in each rank's sequence, the tensors' shapes and dtypes."""
    firsts = {rank: status for rank, status in statuses.items() if status.get("first") is not None}
    differs = []
    for field, words in (("op", "op"), ("name", "name"), ("first", "sequence number"), ("detail", "tensors")):
        if len({str(status.get(field)) for status in firsts.values()}) > 1:
            differs.append(words)
    return "they differ in " + ", ".join(differs) if differs else "the same first collective, none in common"
