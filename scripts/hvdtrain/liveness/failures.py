"""The one line a failed rank prints, and who prints it when a peer is lost.

A rank's own exception becomes one line naming it and where it was raised (the
traceback only with HVDTRAIN_TRACEBACK=1); a collective that failed because a
peer died, froze or left becomes one line for the whole job: rank 0's (or its
deputy's), naming the lost ranks and their node, as the heartbeat (peers.py)
saw them. Then the rank exits 1 (errors.FAILED_EXIT).
"""
import os
import sys
import threading
import time
import traceback

from hvdtrain.errors import FAILED_EXIT, TRACEBACK_ENV, launched, launcher_rank
from hvdtrain.liveness import recorder as flight, teardown

# Exiting runs Horovod's shutdown; when a peer is gone it can wait for that peer.
EXIT_GRACE_SECONDS = 10
# After a failed collective the peer is gone: only the quick exit handlers are worth waiting for
# (the launcher ends a rank that is slower, horovodrun after 5 s).
PEER_EXIT_GRACE_SECONDS = 1.0

_last_step = None  # the latest finished step, for the one-line reports
REPORTING = threading.Event()  # this rank is saying why it fails: the watchdog adds no line of its own


def note_step(step):
    """The latest finished step, named by a one-line report ("after step N")."""
    global _last_step
    _last_step = step


def is_peer_failure(error):
    """True for the errors a rank gets when another rank died or left mid-collective."""
    name = type(error).__name__
    return (name == "HorovodInternalError" or "gloo" in str(error).lower()) and not is_mismatch(error)


def is_mismatch(error):
    """Horovod found that the ranks made one collective (one name) with different tensors or ops:
    "Mismatched ALLREDUCE tensor shapes", "Mismatched MPI operations", "Mismatched data types"."""
    return "Mismatched" in str(error)


# Who else is alive (peers.py, set once the heartbeat runs): on a peer
# failure it says whether this rank speaks for the job, and names the lost ranks.
_witness = None


def set_peer_witness(witness):
    """``witness.on_peer_failure()`` -> None (stay quiet: rank 0 speaks for the job) or a
    detail for this rank's line ("" when it knows no more); ``witness.announce_reported()``."""
    global _witness
    _witness = witness


def failure_line(error, who, detail=""):
    """One line: who ("rank 1", or the script when launched alone), and what ended it."""
    # Horovod's messages run on for several sentences: the first says what happened.
    first_line = (str(error).strip().splitlines() or [""])[0].split(". ")[0][:200]
    after = f" after step {_last_step}" if _last_step is not None else ""
    if is_peer_failure(error):
        return (f"{who}: error: a collective failed{after}: another rank died, froze or left the job"
                f"{'; ' + detail if detail else ''} ({type(error).__name__}: {first_line})")
    if is_mismatch(error):
        return (f"{who}: error: the ranks made one collective with different tensors{after} (Horovod: "
                f"{str(error).strip().splitlines()[0][:300]}){': ' + detail if detail else ''}")
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    place = f" at {os.path.relpath(where.filename)}:{where.lineno} in {where.name}" if where else ""
    return (f"{who}: error: {type(error).__name__}{after}: {first_line}{place} "
            f"({TRACEBACK_ENV}=1 prints the traceback)")


def report(error):
    """Print ``error`` as one line (the traceback only on request), then exit 1."""
    REPORTING.set()
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(error)
    who = f"rank {launcher_rank()}" if launched() else os.path.basename(sys.argv[0])
    # A lost node fails the collective on every survivor at once: one line (rank 0's) for the job;
    # so does a mismatch Horovod found, every rank's side of it in that line.
    witness = _witness if is_peer_failure(error) or is_mismatch(error) else None
    flight.dump(f"{type(error).__name__} after step {_last_step}")
    if witness is None:
        detail = "" if not is_mismatch(error) else flight.sides({flight.RECORDER.rank: flight.RECORDER.status()}) if flight.RECORDER else ""
    else:
        detail = witness.on_mismatch() if is_mismatch(error) else witness.on_peer_failure()
    if detail is not None:
        print(failure_line(error, who, detail), file=sys.stderr, flush=True)
        if _witness:  # the job's line is out: no rank adds one when this rank's exit fails its collective
            _witness.announce_reported()
    # A normal exit (atexit: the run lock, Horovod's shutdown), unless the shutdown
    # waits on a peer that is gone.
    teardown.end_own_children()  # its DataLoader workers would hold the job's output open for 5 s
    grace = PEER_EXIT_GRACE_SECONDS if is_peer_failure(error) else EXIT_GRACE_SECONDS
    threading.Thread(target=_exit_after_grace, args=(grace,), daemon=True).start()
    sys.exit(FAILED_EXIT)


def _exit_after_grace(grace):
    time.sleep(grace)
    os._exit(FAILED_EXIT)
