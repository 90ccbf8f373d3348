"""Checkpoints: the run's components saved and restored, at any model size and world size.

A checkpoint is composed of the run's components, each with ``state_dict()`` /
``load_state_dict()`` (the pattern of torchtitan's checkpoint manager):

- shared components (model, optimizer, scheduler, scaler, train state) are the
  same on every rank and written by rank 0;
- per-rank components (RNG states, partial metric sums) are gathered from every
  rank (a few KiB each) and each rank gets its own entry back;
- ``settings``: the resolved settings, compared on resume (see settings.py).

The file itself (its format, name, checksum, atomic write, pruning) is
checkpoint_files.py's; rank 0 writes it in the background by default
(checkpoint_writer.py). When to save is cadence.py's.

Restore never pickles tensors through a broadcast: ``hvd.broadcast_object``
sends the pickle's size as a 32-bit int and holds several copies, so a 4 GB
BERT-large checkpoint could not be restored. Rank 0 picks the file (skipping,
and renaming, unreadable ones) and every rank that sees it loads it itself,
memory-mapped (one copy per node in the page cache). Where some rank cannot see
it (node-local output directories) rank 0 sends its tensors as raw bytes, packed
up to 64 MiB a broadcast.
"""
import contextlib
import time
from pathlib import Path

from hvdtrain import durations, testhooks
from hvdtrain.errors import UsageError
from hvdtrain.runtime import collectives
from hvdtrain.runtime.checkpoint_files import (CORRUPT_SUFFIX, FORMAT, atomic_save, checkpoint_path, checkpoint_paths,
                                               is_current_format, load, prune, read, set_aside, write_checksum,
                                               link_or_copy)
from hvdtrain.runtime.checkpoint_writer import BackgroundWriter, available_memory, host_copy, tensor_bytes, write_failure


@contextlib.contextmanager
def around_save(parts):
    """The components' save hooks around the block that reads their state; collective (every rank,
    the same parts in the same order). A component uses them to show what must be saved:

    - ``before_save()``: on this rank alone (batchnorm.RankStatistics keeps this rank's own
      statistics aside);
    - ``to_sum()`` -> tensors, then ``summed(sums)``: what every part hands over is summed over the
      ranks in one allreduce and given back (float64, in its tensors' shapes): metrics.EpochSums
      folds the ranks' sums in (--elastic, --global-batch), batchnorm.RankStatistics puts the ranks'
      average statistics in the model, and at an --elastic commit elastic.HostUpdates asks whether
      any rank heard of a host change. One collective for all (a commit's cost on 2 cores is the
      barrier it makes, not its collectives' number: docs/scale.md);
    - ``after_save()``, once the block has read their state.
    """
    for part in parts:
        getattr(part, "before_save", lambda: None)()
    handing = [(part, part.to_sum()) for part in parts if hasattr(part, "to_sum")]
    # Horovod: one allreduce of every part's sums
    sums = collectives.sum_packed_over_ranks([t for _, tensors in handing for t in tensors], name="save.sums")
    for part, tensors in handing:
        part.summed(sums[:len(tensors)])
        sums = sums[len(tensors):]
    try:
        yield
    finally:
        for part in parts:
            getattr(part, "after_save", lambda: None)()


class Checkpointer:
    """Saves and restores the run's components; every method is collective."""

    def __init__(self, ctx, directory, shared, per_rank, keep, extra=None, write_mode="sync", upgrade=None):
        """``upgrade(saved)``: a checkpoint of an earlier version in today's layout (the trainer's)."""
        self.ctx = ctx
        self.upgrade = upgrade
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
            link_or_copy(path, self.directory / "best.pt")
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
            if self.upgrade is not None:
                state = self.upgrade(state)
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
                set_aside(path, problem)
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
        if collectives.all_ranks_true(visible, name="checkpoint.visible"):
            return collectives.agree_on_errors(_load_or_fail, path)
        # Node-local output directories: rank 0 sends the checkpoint, its tensors as raw bytes.
        self.ctx.print0(f"note: {path} is not visible on every rank; sending it from rank 0")
        return collectives.broadcast_state(load(path) if self.ctx.is_main else None)


def _load_or_fail(path):
    try:
        return load(path)
    except Exception as error:
        raise UsageError(f"cannot read checkpoint {path}: {error.__class__.__name__}") from None
