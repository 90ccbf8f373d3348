"""Atomic checkpoints: written by rank 0, loaded by rank 0, broadcast to all.

A checkpoint is one ``torch.save`` file ``step-<global step>.pt`` in the output
directory, written to a temporary name, fsynced and renamed, so a job killed
mid-write never leaves a truncated newest checkpoint. The last ``keep`` are
kept, plus ``best.pt`` when the caller marks one as best.
"""
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from . import dist
from .cli import UsageError

_NAME = re.compile(r"^step-(\d+)\.pt$")


def atomic_save(obj, path):
    """``torch.save`` to ``path`` via a temp file + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_paths(directory):
    """Checkpoints in ``directory``, newest (highest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [path for _, path in sorted(found, reverse=True)]


def save(state, directory, step, keep, is_best=False):
    """Write ``state`` as checkpoint ``step``; prune to ``keep`` newest. Rank 0 only."""
    directory = Path(directory)
    path = directory / f"step-{step:09d}.pt"
    atomic_save(state, path)
    if is_best:
        atomic_save(state, directory / "best.pt")
    for old in checkpoint_paths(directory)[keep:]:
        old.unlink(missing_ok=True)
    return path


def training_state(model, optimizer, scheduler, scaler, **extra):
    """Everything an exact resume needs, plus ``extra`` (position, settings).

    Collective: every rank's RNG state is gathered, so call it on every rank;
    rank 0 then saves the result.
    """
    rng = dist.gather_rng_states()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "rng": rng, **extra}


def load_training_state(ctx, state, model, optimizer, scheduler, scaler):
    """Put a ``training_state`` back, this rank's RNG included."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    if len(state["rng"]) == ctx.size:
        dist.set_rng_state(state["rng"][ctx.rank])
    else:
        ctx.print0(f"note: checkpoint written by {len(state['rng'])} ranks, now {ctx.size}: "
                   "data order and dropout will differ from an uninterrupted run")


def clear_run_outputs(directory):
    """Remove an earlier run's checkpoints and metrics (--no-resume, rank 0).

    Otherwise its higher-numbered checkpoints would outrank the new run's and
    be kept while the new ones are pruned.
    """
    directory = Path(directory)
    for stale in [*checkpoint_paths(directory), directory / "best.pt",
                  directory / "metrics.jsonl", directory / "results.json"]:
        stale.unlink(missing_ok=True)
    shutil.rmtree(directory / "tensorboard", ignore_errors=True)


def load(path):
    """Load one checkpoint safely (tensors and plain Python only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_newest_valid(directory, print_fn=print):
    """The newest checkpoint that loads, skipping corrupt ones; None when there is none."""
    for path in checkpoint_paths(directory):
        try:
            return load(path)
        except Exception as error:  # a truncated or foreign file: try the next one
            print_fn(f"skipping unreadable checkpoint {path}: {error}")
    return None


def restore_on_all_ranks(ctx, directory, enabled=True):
    """Rank 0 loads the newest valid checkpoint; every rank gets the same copy.

    Returns None on every rank when resuming is off or no checkpoint exists.
    """
    state = None
    if enabled and ctx.is_main:
        state = load_newest_valid(directory, print_fn=ctx.print0)
    # Horovod: broadcast rank 0's checkpoint (or None) so every rank agrees.
    return dist.broadcast_object(state, root_rank=0, name="checkpoint")


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
    try:
        return load(path)
    except Exception as error:
        raise UsageError(f"cannot read checkpoint {path}: {error.__class__.__name__}") from None
