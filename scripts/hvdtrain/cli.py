"""Command-line helpers: argument parsing with one-line errors, typed arguments, run_main.

Every rank parses the same arguments, so a bad flag makes every rank exit 2 on
its own; only the first rank prints, so a 64-rank job shows one line, not 64.
"""
import argparse
import ast
import shlex
import sys

from hvdtrain.errors import UsageError, fail
from hvdtrain.liveness.failures import report
from hvdtrain.usercode import is_spec

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help of every script: each option's default shown once, texts kept as written.

    argparse's ArgumentDefaultsHelpFormatter appends "(default: X)" even where
    the help already explains the default ("(default: the shards') (default:
    None)") or where it means nothing (a store_true flag's False, the True of
    --cased that stores False). Descriptions and epilogs keep their line breaks:
    the shard format is a layout, not a paragraph.
    """

    def _get_help_string(self, action):
        text = action.help or ""
        return text + " (default: %(default)s)" if _default_worth_showing(action, text) else text


def _default_worth_showing(action, text):
    if action.default in (None, False, argparse.SUPPRESS):
        return False  # unset, or an off flag: the help says what happens then
    if "default" in text or "unset" in text:
        return False  # the help names the default itself (BooleanOptionalAction adds one)
    return action.nargs != 0  # a flag's stored constant is no default a user picks


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults shown once in --help and single-line errors."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        fail(message, self.prog)


def key_value(text):
    """KEY=VALUE for a user's callable: (KEY, VALUE), VALUE read as a Python literal (4, 0.5, True,
    'text', [1, 2]) where it is one, else kept as the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, KEY a Python name, not {text!r}")
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass
    return key, value


def keyword_arguments(parser, option, pairs, spec):
    """``pairs`` (``key_value``'s, of ``option``) as a dict for ``spec``'s callable; parser.error (one
    line, exit 2) for a key given twice or a ``spec`` that is a preset, not your own callable."""
    keys = [key for key, _ in pairs]
    if pairs and not is_spec(spec):
        parser.error(f"{option} is for your own callable (MODULE:CALLABLE), not the preset {spec}")
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        parser.error(f"{option} {twice[0]} given twice")
    return dict(pairs)


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def fraction(text):
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def whole_line_output():
    """Make stdout and stderr write each line in one write.

    With PYTHONUNBUFFERED=1 (set by the test suite, common in job scripts) print()
    writes its text, its separators and its newline as separate writes, and
    Open MPI tags every write, so lines end with a stray "[1,0]<stdout>:" tag.
    Line buffering joins them; a line still leaves as soon as it is complete.
    """
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # not when a caller replaced the stream
            stream.reconfigure(line_buffering=True, write_through=False)


def resume_command(argv=None):
    """This script's own part of the command line, as it resumes: what to relaunch.

    Without --no-resume (which would delete the checkpoint) and without
    --stop-after/--max-steps (which would stop again one step later). The
    launcher's part (horovodrun -np 2 ...) is not visible to a rank.
    """
    argv = list(sys.argv if argv is None else argv)
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--stop-after", "--max-steps"):
            skip = True  # and its value
        elif arg != "--no-resume" and not arg.startswith(("--stop-after=", "--max-steps=")):
            kept.append(arg)
    return shlex.join(kept)


def run_main(main):
    """Run ``main()``; a UsageError anywhere becomes one line and exit status 2,
    any other exception one line naming the rank and the cause, exit status 1."""
    whole_line_output()
    try:
        main()
    except UsageError as error:
        fail(str(error), every_rank_fails=error.on_every_rank, status=error.exit_status)
    except Exception as error:  # a rank's own failure or a peer's: one line, no traceback wall
        report(error)
