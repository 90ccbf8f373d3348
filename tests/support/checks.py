"""How the tests judge a finished launch: it succeeded, or it failed with one error line."""
import re

from .launch import RANK_TRACEBACK

# A traceback printed by a process: a line starting "Traceback", with a launcher's rank tag or without.
ANY_TRACEBACK = re.compile(r"^(?:\[[\d,]+\]<std(?:out|err)>:)?\s*Traceback", re.M)
ERROR_LINE = re.compile(r"\w+\.py: error:")


def succeeded(run):
    """Exit status 0 within the timeout."""
    assert run.returncode == 0 and not run.timed_out, run.describe()
    return run


def ok(run):
    """Exit status 0 within the timeout, and no rank printed a traceback."""
    succeeded(run)
    assert not RANK_TRACEBACK.search(run.output), run.describe()
    return run


def one_error_line(run, *naming, status=2):
    """The job's single "SCRIPT.py: error:" line, holding each of ``naming``; returned.

    The job ended within its timeout with ``status`` (None: any failure): its own exit
    status, or where a launcher exits 1 for a failed rank (horovodrun), the status its
    one-line report gives ("Exit code: 2"). No process printed a traceback.
    """
    assert not run.timed_out and run.returncode not in (0, None), run.describe()
    if status is not None:
        assert run.returncode == status or re.search(rf"Exit code: {status}\b", run.output), run.describe()
    assert not ANY_TRACEBACK.search(run.output), run.describe()
    errors = [line for line in run.output.splitlines() if ERROR_LINE.search(line)]
    assert len(errors) == 1, run.describe()
    for fragment in naming:
        assert fragment in errors[0], run.describe()
    return errors[0]
