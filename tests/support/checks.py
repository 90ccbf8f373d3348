"""How the tests judge a finished launch: it succeeded, or it failed with one error line."""
import re

from .launch import RANK_TRACEBACK


def succeeded(run):
    """Exit status 0 within the timeout."""
    assert run.returncode == 0 and not run.timed_out, run.describe()
    return run


def ok(run):
    """Exit status 0 within the timeout, and no rank printed a traceback."""
    succeeded(run)
    assert not RANK_TRACEBACK.search(run.output), run.describe()
    return run


def the_one_error_line(run, *fragments):
    """The job's single "SCRIPT.py: error:" line, holding every fragment; no rank traceback."""
    assert not RANK_TRACEBACK.search(run.output), run.describe()
    errors = [line for line in run.output.splitlines() if re.search(r"\w+\.py: error:", line)]
    assert len(errors) == 1, run.describe()
    for fragment in fragments:
        assert fragment in errors[0], run.describe()
    return errors[0]


def one_line_error(run, *fragments):
    """Exit status 2 on the ranks, one line, no rank traceback (horovodrun's own report aside)."""
    assert run.returncode != 0 and not run.timed_out, run.describe()
    assert re.search(r"Exit code: 2\b", run.output), run.describe()
    return the_one_error_line(run, *fragments)
