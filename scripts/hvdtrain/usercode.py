"""Your own code behind a command-line seam: ``MODULE:CALLABLE`` or ``path/to/file.py:CALLABLE``.

    train_cnn.py --model my_models:build_net                  # my_models on PYTHONPATH
    train_cnn.py --dataset ./experiments/data.py:spectrograms  # a file: its folder goes on sys.path

A file's folder is put on ``sys.path`` and the file imported as a module of that
name, so what it defines pickles by name: DataLoader worker processes, which
unpickle the data set, import it the same way (they inherit the path). Anything
that goes wrong is one line naming the option and the cause (exit 2).
"""
import importlib
import sys
from pathlib import Path

from hvdtrain.errors import UsageError


def is_spec(text):
    """Whether an option's value names user code (it holds a colon) rather than a preset."""
    return ":" in str(text)


def load_callable(spec, option):
    """The callable ``spec`` names; ``option`` (e.g. "--model") names it in the one-line error."""
    where, _, name = str(spec).rpartition(":")
    if not where or not name:
        raise UsageError(f"{option} {spec}: expected MODULE:CALLABLE or path/to/file.py:CALLABLE")
    module_name = where
    if where.endswith(".py") or "/" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise UsageError(f"{option} {spec}: no such file {where}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module_name = path.stem
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - the user's module: whatever it raises, one line
        raise UsageError(f"{option} {spec}: cannot import {module_name} ({error.__class__.__name__}: "
                         f"{first_line(error)})") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise UsageError(f"{option} {spec}: {module_name} has no callable {name}")
    return found


def call(spec, option, function, *args, **kwargs):
    """``function(*args, **kwargs)``, its failure one line naming the option."""
    try:
        return function(*args, **kwargs)
    except UsageError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's code: whatever it raises, one line
        raise UsageError(f"{option} {spec}: {function.__name__}() raised {error.__class__.__name__}: "
                         f"{first_line(error)}") from None


def first_line(error):
    return (str(error).strip().splitlines() or [""])[0][:200]
