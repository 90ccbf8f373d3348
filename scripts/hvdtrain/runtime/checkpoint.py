"""Checkpoints: one mechanism to save and restore a run, at any model size.

A checkpoint is one ``torch.save`` file ``step-<global step>.pt`` composed of the
run's components, each with ``state_dict()`` / ``load_state_dict()`` (the
pattern of torchtitan's checkpoint manager):

- shared components (model, optimizer, scheduler, scaler, train state) are the
  same on every rank and written by rank 0;
- per-rank components (RNG states, partial metric sums) are gathered from every
  rank (a few KiB each) and each rank gets its own entry back;
- ``settings``: the resolved settings, compared on resume (see settings.py).

Files are written to a temporary name, fsynced and renamed, so a job killed
mid-write never leaves a truncated newest checkpoint. By default
(``--checkpoint-write auto``) rank 0 writes in the background: the step that
checkpoints pays the gather and a copy of the state in host memory, and a
writer thread serialises, writes, fsyncs and checksums while training goes on
(``BackgroundWriter``: one write in flight, the next checkpoint and every
stop wait for it, its failure is one line on every rank). Each has a sidecar
``step-<step>.pt.sha256`` (``sha256sum -c`` reads it), hashed as the bytes are
written and checked by rank 0 before a resume: a flipped bit (a bad disk, a
bad copy) is treated like an unreadable file instead of resuming silently from
wrong weights. The sidecar is renamed into place before its checkpoint, so a
crash never leaves a checkpoint without one; a checkpoint without one (copied
without it) is loaded with a note.

Restore never pickles tensors through a broadcast: ``hvd.broadcast_object``
sends the pickle's size as a 32-bit int and holds several copies, so a 4 GB
BERT-large checkpoint could not be restored. Rank 0 picks the file (skipping,
and renaming, unreadable ones) and every rank that sees it loads it itself,
memory-mapped (one copy per node in the page cache). Where some rank cannot see
it (node-local output directories) rank 0 sends it tensor by tensor.
"""
import contextlib
import copy
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from hvdtrain import durations, testhooks
from hvdtrain.runtime import collectives
from hvdtrain.errors import UsageError

FORMAT = 2  # the layout below; earlier checkpoints cannot be resumed
_NAME = re.compile(r"^step-(\d+)\.pt$")
CORRUPT_SUFFIX = ".corrupt"
CHECKSUM_SUFFIX = ".sha256"
# Tensors sent at once by the tensor-by-tensor fallback (Horovod fuses them).


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


def _link_or_copy(source, target):
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
    shutil.rmtree(directory / "tensorboard", ignore_errors=True)


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


class BackgroundWriter:
    """Rank 0's checkpoint file written by a thread while training goes on; one write in flight.

    The thread is not a daemon: an interpreter that exits normally (the end of training, an
    uncaught error) waits for the write in flight. A process killed mid-write leaves a temporary
    file and the previous checkpoint the newest valid one (atomic_save).
    """

    def __init__(self):
        self.thread = None
        self.failure = None  # why the last write failed, a line

    def start(self, write, what):
        """Run ``write()`` in the background; ``what`` names it in a failure's line."""
        def run():
            try:
                write()
            except Exception as error:  # noqa: BLE001 - reported in one line by wait()
                self.failure = write_failure(what, error)
        self.thread = threading.Thread(target=run, name="checkpoint-writer")
        self.thread.start()

    @property
    def busy(self):
        """Whether a write is in flight now."""
        return self.thread is not None and self.thread.is_alive()

    def wait(self):
        """Block until the write in flight has ended; a UsageError (one line, exit 2) if it failed:
        --output-dir could not take it (a full disk, an I/O error, a lost mount)."""
        if self.thread is not None:
            with durations.timed("waiting for a background checkpoint write"):
                self.thread.join()
            self.thread = None
        failure, self.failure = self.failure, None
        if failure:
            raise UsageError(failure)

    def finish(self):
        """The write in flight on disk, here and now (no collective: an --elastic reset, whose world
        is being re-formed); a failure is said as a warning, and the next checkpoint is written anew."""
        try:
            self.wait()
        except UsageError as failure:
            print(f"warning: {failure}", flush=True)


def write_failure(what, error):
    return (f"writing the checkpoint {what} failed ({error.__class__.__name__}: {error}); the previous "
            "checkpoint is the newest valid one")


def host_copy(value):
    """``value`` (a state to save) with every tensor copied to host memory (pinned where it was on
    a GPU): what training changes next cannot reach the copy a background write serialises."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value.detach().clone()
        pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        return pinned.copy_(value.detach())
    if isinstance(value, dict):
        return type(value)((key, host_copy(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(item) for item in value)
    return copy.deepcopy(value)


def tensor_bytes(value):
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def available_memory():
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def around_save(parts):
    """The components' ``before_save()`` hooks (collective: every rank, in the same order), then,
    once the block has read their state, their ``after_save()``. A component uses them to show
    what must be saved: elastic.ElasticPosition folds the ranks' sums in, batchnorm.RankStatistics
    puts the ranks' average statistics in the model while this rank's own are saved per rank."""
    for part in parts:
        getattr(part, "before_save", lambda: None)()
    try:
        yield
    finally:
        for part in parts:
            getattr(part, "after_save", lambda: None)()


class Checkpointer:
    """Saves and restores the run's components; every method is collective."""

    def __init__(self, ctx, directory, shared, per_rank, keep, extra=None, write_mode="sync"):
        self.ctx = ctx
        self.directory = Path(directory)
        self.shared = shared  # name -> component, identical on every rank
        self.per_rank = per_rank  # name -> component, one entry per rank
        self.keep = keep
        self.extra = extra or {}  # plain values saved beside the components
        self.write_mode = write_mode  # --checkpoint-write: sync, async, or auto (async where the copy fits)
        self.writer = BackgroundWriter()  # rank 0's
        self._said_sync = False

    def parts(self):
        """Every component, shared then per rank: the same order on every rank."""
        return [*self.shared.values(), *self.per_rank.values()]

    def save(self, step, settings, is_best=False):
        """The components' ``before_save`` hooks (around_save), then ``write``; collective."""
        with around_save(self.parts()):
            self.write(step, settings, is_best)

    def write(self, step, settings, is_best=False):
        """Checkpoint ``step``: rank 0 writes it now, or in the background once it holds a copy.

        Collective, in this order: the per-rank entries gathered to rank 0 (one alltoall);
        inside the "writing a checkpoint" phase, rank 0 waits for the write in flight (one at a
        time), then copies the state and starts the background write (--checkpoint-write async)
        or writes the file itself (sync); one allgather of rank 0's verdict (a failed write is
        one line on every rank). Inside ``around_save`` (see ``save``).
        """
        with durations.timed("gathering the ranks' checkpoint entries"):
            ranks = collectives.gather_object_to_root({name: part.state_dict() for name, part in self.per_rank.items()},
                                               name="checkpoint.ranks")  # every rank's entry, on rank 0
        with self.ctx.watchdog.phase("writing a checkpoint"):
            # The other ranks wait here, inside the phase, rather than in their
            # next collective, where the watchdog's short limit applies.
            collectives.agree_on_errors(self._write_on_rank_0, step, settings, is_best, ranks)

    def _write_on_rank_0(self, step, settings, is_best, ranks):
        if not self.ctx.is_main:
            return
        self.writer.wait()  # the previous write: one in flight, host memory bounded by one copy
        state = {"format": FORMAT, **{name: part.state_dict() for name, part in self.shared.items()},
                 "ranks": ranks, "settings": dict(settings), **self.extra}
        path = checkpoint_path(self.directory, step)
        if not self._in_background(state):
            try:
                return self._write_file(state, path, step, is_best)
            except OSError as error:  # one line on every rank, as from the background writer
                raise UsageError(write_failure(path.name, error)) from None
        with durations.timed("copying the checkpoint to host memory"):
            state = host_copy(state)
        self.writer.start(lambda: self._write_file(state, path, step, is_best, background=True), path.name)

    def _in_background(self, state):
        """--checkpoint-write: async, sync, or auto: async where a copy fits in half the available memory."""
        if self.write_mode != "auto":
            return self.write_mode == "async"
        needed, free = tensor_bytes(state), available_memory()
        if free is None or 2 * needed <= free:
            return True
        if not self._said_sync:
            self._said_sync = True
            print(f"note: --checkpoint-write auto: a copy of the state ({needed / 2**30:.1f} GiB) would not fit "
                  f"in half the available memory ({free / 2**30:.1f} GiB); writing checkpoints synchronously",
                  flush=True)
        return False

    def _write_file(self, state, path, step, is_best, background=False):
        """Serialise, fsync, checksum, rename (atomic_save); best.pt; prune. Rank 0, maybe a thread."""
        started = time.perf_counter()
        testhooks.checkpoint_writing(self.ctx.rank, step)  # test-only: a slow or full file system
        digest = atomic_save(state, path)
        if is_best:
            write_checksum(self.directory / "best.pt", digest)
            _link_or_copy(path, self.directory / "best.pt")
        prune(self.directory, self.keep, path)
        seconds = time.perf_counter() - started
        durations.add("writing a checkpoint file", seconds)
        if background:  # when it is on disk, for the log: training went on meanwhile
            print(f"checkpoint {path.name} written in the background in {seconds:.1f} s", flush=True)

    def wait_for_writes(self):
        """The write in flight on disk before this launch stops; collective (one allgather)."""
        with self.ctx.watchdog.phase("waiting for the checkpoint write in flight"):
            collectives.agree_on_errors(self.writer.wait)

    def restore(self, check=None):
        """Load the newest readable checkpoint into the components.

        ``check(state)`` may raise UsageError (a resume it refuses) before
        anything is loaded. Returns the state (tensors memory-mapped), or None
        when there is no checkpoint; then rank 0's weights go to every rank.
        """
        with self.ctx.watchdog.phase("restoring a checkpoint"):
            choice = collectives.agree_on_errors(self._choose)
            # Horovod: a few bytes (the file's name and size), never the checkpoint itself.
            path, size = collectives.broadcast_object(choice, root_rank=0, name="checkpoint.choice")
            if path is None:
                return None
            state = self._load_everywhere(Path(path), size)
            if check is not None:
                collectives.agree_on_errors(check, state)
            for name, part in self.shared.items():
                part.load_state_dict(state[name])
            self._restore_per_rank(state)
            return state

    def _restore_per_rank(self, state):
        """Each rank its own entry; after a resize (the checkpoint holds another number of ranks' entries)
        each component's ``load_resized(entries, rank, step)`` takes its part of every old rank's
        (rng.RngState: a generator derived from the step and the new rank; metrics.SumMeter: rank 0
        the sums of all). A component without one keeps what it has (batchnorm.RankStatistics: the
        checkpoint's average statistics, which the model holds)."""
        saved = state["ranks"]
        if len(saved) == self.ctx.size:
            mine = saved[self.ctx.rank]
            for name, part in self.per_rank.items():
                if name in mine:
                    part.load_state_dict(mine[name])
            return
        step = state["train_state"]["step"]
        for name, part in self.per_rank.items():
            if hasattr(part, "load_resized"):
                part.load_resized([entry[name] for entry in saved if name in entry], self.ctx.rank, step)

    def _choose(self):
        """(newest readable checkpoint, its size), or (None, None); chosen by rank 0.

        An unreadable file is renamed ``*.corrupt`` (so it can never outrank or
        prune a good one) and the previous checkpoint is tried.
        """
        if not self.ctx.is_main:
            return None
        candidates = checkpoint_paths(self.directory)
        for path in candidates:
            state, problem = read(path)
            if problem:
                _set_aside(path, problem)
                continue
            if not is_current_format(state):
                raise UsageError(f"cannot resume from {path}: written by an earlier version of the scripts "
                                 "(use --no-resume or another --output-dir)")
            return str(path), path.stat().st_size
        corrupt = sorted(self.directory.glob(f"step-*.pt{CORRUPT_SUFFIX}")) if self.directory.is_dir() else []
        if corrupt:
            raise UsageError(f"no readable checkpoint in {self.directory}: {', '.join(p.name for p in corrupt)} "
                             "could not be loaded; start over with --no-resume")
        return None, None

    def _load_everywhere(self, path, size):
        visible = path.is_file() and path.stat().st_size == size
        if collectives.all_ranks_true(visible):
            return collectives.agree_on_errors(_load_or_fail, path)
        # Node-local output directories: rank 0 sends the checkpoint, tensor by tensor.
        self.ctx.print0(f"note: {path} is not visible on every rank; sending it from rank 0")
        return collectives.broadcast_state(load(path) if self.ctx.is_main else None)


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


def _set_aside(path, problem):
    """Rename a bad checkpoint (and its checksum) ``*.corrupt``: it can never outrank a good one."""
    renamed = path.with_name(path.name + CORRUPT_SUFFIX)
    os.replace(path, renamed)
    if checksum_path(path).exists():
        os.replace(checksum_path(path), Path(f"{renamed}{CHECKSUM_SUFFIX}"))
    print(f"warning: checkpoint {path} is {problem}; renamed to {renamed.name}, trying the previous one",
          flush=True)


def _load_or_fail(path):
    try:
        return load(path)
    except Exception as error:
        raise UsageError(f"cannot read checkpoint {path}: {error.__class__.__name__}") from None
