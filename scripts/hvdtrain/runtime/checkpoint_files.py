"""Checkpoint files: the format, names, checksums, atomic writes, pruning and reading.

A checkpoint is one ``torch.save`` file ``step-<global step>.pt`` (runtime/checkpoint.py
composes it from the run's components). Files are written to a temporary name,
fsynced and renamed, so a job killed mid-write never leaves a truncated newest
checkpoint. Each has a sidecar ``step-<step>.pt.sha256`` (``sha256sum -c`` reads it),
hashed as the bytes are written and checked before a resume: a flipped bit (a bad
disk, a bad copy) is treated like an unreadable file instead of resuming silently
from wrong weights. The sidecar is renamed into place before its checkpoint, so a
crash never leaves a checkpoint without one; a checkpoint without one (copied
without it) is loaded with a note. No collective here: plain files.
"""
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from hvdtrain.errors import UsageError
from hvdtrain.liveness.recorder import DUMP_DIR

FORMAT = 2  # the layout below; earlier checkpoints cannot be resumed
_NAME = re.compile(r"^step-(\d+)\.pt$")
CORRUPT_SUFFIX = ".corrupt"
CHECKSUM_SUFFIX = ".sha256"


def atomic_save(obj, path):
    """``torch.save`` to ``path`` via a temp file + fsync + rename, its checksum sidecar first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            hashing = _HashingWriter(handle)
            torch.save(obj, hashing)
            handle.flush()
            os.fsync(handle.fileno())
        write_checksum(path, hashing.hexdigest())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return hashing.hexdigest()


class _HashingWriter:
    """A write-only file that hashes what passes through (no second read of 4 GB)."""

    def __init__(self, handle):
        self.handle, self.hash = handle, hashlib.sha256()

    def write(self, data):
        self.hash.update(data)
        return self.handle.write(data)

    def flush(self):
        self.handle.flush()

    def hexdigest(self):
        return self.hash.hexdigest()


def checksum_path(path):
    return Path(f"{path}{CHECKSUM_SUFFIX}")


def write_checksum(path, digest):
    """``<path>.sha256`` in ``sha256sum`` format, written atomically."""
    sidecar = checksum_path(path)
    tmp = sidecar.with_name(f".{sidecar.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(f"{digest}  {Path(path).name}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, sidecar)


def checksum_problem(path):
    """Why ``path`` does not match its recorded checksum; None if it does or none is recorded."""
    sidecar = checksum_path(path)
    try:
        expected = sidecar.read_text().split()[0]
    except FileNotFoundError:
        print(f"note: {path} has no {sidecar.name} (copied without it?); loading it unverified", flush=True)
        return None
    except (OSError, IndexError):
        return f"its checksum file {sidecar.name} is unreadable"
    with open(path, "rb") as handle:
        actual = hashlib.file_digest(handle, "sha256").hexdigest()
    if actual != expected:
        return f"sha256 {actual[:12]}... differs from the {expected[:12]}... recorded when it was written"
    return None


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_or_copy(source, target):
    """``target`` becomes the same file as ``source``: a hard link, no second 4 GB write."""
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # a file system without hard links
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)


def checkpoint_paths(directory):
    """Checkpoints in ``directory``, newest (highest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [path for _, path in sorted(found, reverse=True)]


def checkpoint_path(directory, step):
    return Path(directory) / f"step-{step:09d}.pt"


def prune(directory, keep, just_written):
    """Keep ``just_written`` and the ``keep - 1`` newest others."""
    others = [path for path in checkpoint_paths(directory) if path != just_written]
    for old in others[max(0, keep - 1):]:
        old.unlink(missing_ok=True)
        checksum_path(old).unlink(missing_ok=True)


def load(path):
    """Load one checkpoint safely (tensors and plain Python only), memory-mapped."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def clear_run_outputs(directory):
    """Remove an earlier run's checkpoints and metrics (--no-resume, rank 0).

    Otherwise its higher-numbered checkpoints would outrank the new run's.
    """
    directory = Path(directory)
    for stale in [*directory.glob("step-*.pt*"), directory / "best.pt", checksum_path(directory / "best.pt"),
                  directory / "metrics.jsonl", directory / "stragglers.jsonl", directory / "results.json"]:
        stale.unlink(missing_ok=True)
    for folder in ("tensorboard", DUMP_DIR):  # the last run's events, its ranks' collectives
        shutil.rmtree(directory / folder, ignore_errors=True)


def load_init_checkpoint(path):
    """Load a checkpoint named by the user (e.g. --init-checkpoint), or a clear error."""
    path = Path(path)
    if path.is_dir():
        newest = checkpoint_paths(path)
        if not newest:
            raise UsageError(f"no checkpoint (step-*.pt) in {path}")
        path = newest[0]
    if not path.is_file():
        raise UsageError(f"checkpoint not found: {path}")
    problem = checksum_problem(path)
    if problem:
        raise UsageError(f"checkpoint {path} is damaged: {problem}")
    try:
        state = load(path)
    except Exception as error:
        raise UsageError(f"cannot read checkpoint {path}: {error.__class__.__name__}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a checkpoint of this version of the scripts")
    return state


def read(path):
    """(the saved state, None), or (None, what is wrong with the file: damaged or unreadable)."""
    try:
        damage = checksum_problem(path)
        return (None, f"damaged: {damage}") if damage else (load(path), None)
    except Exception as error:  # noqa: BLE001 - any failure to read is the file's problem
        return None, f"unreadable ({error.__class__.__name__})"


def is_current_format(state):
    """Written by this version of the scripts (an earlier one's cannot be resumed)."""
    return isinstance(state, dict) and state.get("format") == FORMAT


def set_aside(path, problem):
    """Rename a bad checkpoint (and its checksum) ``*.corrupt``: it can never outrank a good one."""
    renamed = path.with_name(path.name + CORRUPT_SUFFIX)
    os.replace(path, renamed)
    if checksum_path(path).exists():
        os.replace(checksum_path(path), Path(f"{renamed}{CHECKSUM_SUFFIX}"))
    print(f"warning: checkpoint {path} is {problem}; renamed to {renamed.name}, trying the previous one",
          flush=True)
