"""How the tests judge a finished launch: it succeeded, or it failed with one error line.

An error line is what the scripts print instead of a traceback: "SCRIPT.py: error: ..."
(bad input, hvdtrain.errors.fail: the same line on every rank, printed once; "SCRIPT.py
MODE: error: ..." from a subcommand's parser, benchmark.py's; or a process launched alone
that failed, liveness.failures.report) or "rank N: error: ..." (a launched rank's own
failure or a lost peer's, liveness.failures and the watchdog), with a launcher's rank tag
before it or without. ERROR_LINE is the one definition every test reads them by; the
launchers' and shell scripts' own lines ("horovodrun: error:", "[setup] error:") are not.
"""
import re

from .launch import RANK_TRACEBACK

# A traceback printed by a process: a line starting "Traceback", with a launcher's rank tag or without.
ANY_TRACEBACK = re.compile(r"^(?:\[[\d,]+\]<std(?:out|err)>:)?\s*Traceback", re.M)
ERROR_LINE = re.compile(r"(?:\w+\.py(?: \w+)?|rank \d+): error:")


def succeeded(run):
    """Exit status 0 within the timeout."""
    assert run.returncode == 0 and not run.timed_out, run.describe()
    return run


def ok(run):
    """Exit status 0 within the timeout, and no rank printed a traceback."""
    succeeded(run)
    assert not RANK_TRACEBACK.search(run.output), run.describe()
    return run


def is_error_line(line):
    """Whether ``line`` is an error line (see the module's docstring), tagged or not."""
    return bool(ERROR_LINE.search(line))


def error_lines(output):
    """The error lines of ``output`` (a launch's, or a Slurm job's log), in order, tags left on."""
    return [line for line in output.splitlines() if is_error_line(line)]


def the_error_line(output, *naming, shown=None):
    """``output``'s single error line, holding each of ``naming``; returned.

    For an output whose exit status is judged elsewhere (a Slurm job's log, a fault whose
    status depends on the launcher); a failed check shows ``shown`` (default: ``output``).
    """
    shown = output if shown is None else shown
    errors = error_lines(output)
    assert len(errors) == 1, shown
    for fragment in naming:
        assert fragment in errors[0], shown
    return errors[0]


def one_error_line(run, *naming, status=2):
    """The job's single error line, holding each of ``naming``; returned.

    The job ended within its timeout with ``status`` (None: any failure): its own exit
    status, or where a launcher exits 1 for a failed rank (horovodrun), the status its
    one-line report gives ("Exit code: 2"). No process printed a traceback.
    """
    assert not run.timed_out and run.returncode not in (0, None), run.describe()
    if status is not None:
        assert run.returncode == status or re.search(rf"Exit code: {status}\b", run.output), run.describe()
    assert not ANY_TRACEBACK.search(run.output), run.describe()
    return the_error_line(run.output, *naming, shown=run.describe())


def only_an_error_line(run, *naming, status=2):
    """A process launched alone that exited ``status`` within its timeout and printed
    nothing but its error line, holding each of ``naming``; the line, returned."""
    assert not run.timed_out and run.returncode == status, run.describe()
    printed = run.output.strip()
    assert len(printed.splitlines()) == 1, run.describe()
    return the_error_line(printed, *naming, shown=run.describe())
