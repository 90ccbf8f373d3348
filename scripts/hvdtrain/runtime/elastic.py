"""--elastic: the trainers under ``hvd.elastic.run``, with the checkpoint's components as its state.

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script "python scripts/discover_hosts.py FILE" \\
        python scripts/train_cnn.py --elastic

In the scripts, as in Horovod's elastic examples:

    commits = elastic.Commits(checkpointer, ctx, settings.elastic_commit_every, enabled=settings.elastic)
    train_in_world = hvd.elastic.run(train) if settings.elastic else train
    train_in_world(commits, ...)          # hvd.elastic.run calls train() again after every reset

The elastic state is not a second copy of the checkpoint logic: ``Commits``
holds the run's Checkpointer components (model, optimizer, scheduler, scaler,
train state; the per-rank ones too) as in-memory copies of their
``state_dict()``s. Every ``--elastic-commit-every`` steps and at each epoch's
end they are committed (copied; cadence.CheckpointManager decides when); when a
worker dies, the survivors load the last commit; after every reset the state of
rank 0 (or of the first rank that has trained, where rank 0 is a new worker) goes
to every rank with tensor broadcasts (``collectives.broadcast_state``; never one
pickle of the model). Each call of ``train()`` then reads this world's
rank and size itself (``Run.begin``).

A worker that joins a running job starts the script from the top while the
others wait in the sync; it must not make a collective before that sync (it
would pair with the others' broadcasts and hang), so under --elastic the
setup checks run on each rank alone (``collectives.ALONE``) and restoring the
checkpoint from disk happens inside ``train()``, once per job (``started``).
"""
import contextlib
import os
import queue
import re
import sys
import time

import torch
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult

from hvdtrain.errors import UsageError
from hvdtrain.runtime import collectives, dist
from hvdtrain.runtime.checkpoint_writer import copy_state

HOLDS_THE_RUN, SAID_THE_LOSS = 1, 2  # what a rank tells the others in sync
# How long the driver's word on a worker it ended (one that answered nothing) names the next
# loss: it comes just before that worker's collectives fail.
ENDED_NOTE_SECONDS = 30.0
ELASTIC_ENV = "HOROVOD_ELASTIC"  # set by horovodrun for --min-np/--max-np/--host-discovery-script jobs


def check_launcher(elastic):
    """--elastic outside an elastic horovodrun would wait for a driver that is not there."""
    if elastic and os.environ.get(ELASTIC_ENV) != "1":
        raise UsageError("--elastic needs an elastic launch: horovodrun --min-np N --max-np M "
                         "--host-discovery-script SCRIPT (see README, Elastic training)")


def _how():
    """" (Connection closed by peer [10.0.0.7]:4242)": how this rank's collective failed, read from the
    HorovodInternalError hvd.elastic.run is handling while it calls ``restore``; "" elsewhere."""
    error = sys.exc_info()[1]
    if error is None:
        return ""
    # Horovod's and Gloo's messages run on (the first sentence says it), and Gloo's begin with
    # its source file and line.
    first = re.sub(r"^(\[[^\]]*\] )+", "", (str(error).strip().splitlines() or [""])[0]).split(". ")[0]
    return f" ({first[:160]})" if first else ""


class HostUpdates:
    """A commit's question to every rank, asked in its save's one allreduce (checkpoint.around_save):
    has any heard of a host change newer than the last it acted on? Any rank that has makes
    ``check_host_updates`` compare the updates themselves. A rank that has heard only of changes
    the world already acted on (a worker that joined in the last reset) answers yes too: one more
    tiny allreduce, which finds nothing to do."""

    def __init__(self, commits):
        self.commits = commits
        self.heard = None  # (previous, newest, update) read at this commit, until take()
        self.anyone = True  # whether any rank heard of a newer one; True until asked

    def to_sum(self):
        self.heard = self.commits._read_host_messages()
        previous, newest, _ = self.heard
        return [torch.tensor([float(newest > previous)], dtype=torch.float64)]

    def summed(self, sums):
        self.anyone = bool(sums[0].item())

    def take(self):
        """What this rank heard, where any rank heard of a newer change; None where none did.
        Where the commit asked nothing (no save around it), what this rank hears now."""
        heard, anyone = self.heard or self.commits._read_host_messages(), self.anyone
        self.heard, self.anyone = None, True
        return heard if anyone else None


class Commits(State):
    """The run's checkpoint components as Horovod's elastic state (an ``hvd.elastic.State``).

    ``save``: copies of every component's state_dict (a commit); ``restore``: load them
    back (a worker was lost mid-step); ``sync``: rank 0's shared components, and whether the
    run has started, to every rank. ``enabled`` (--elastic): outside an elastic run it
    commits nothing and only records ``started``.
    """

    def __init__(self, checkpointer, ctx, commit_every, enabled=True):
        self.checkpointer = checkpointer
        self.ctx = ctx  # its watchdog and print0
        self.commit_every = commit_every
        self.enabled = enabled
        self.started = False  # the checkpoint on disk is restored (Run.begin), once per job
        self.lost_line = None  # what restore says of a lost worker, until the next world has formed
        self.lost_line_said = False  # by this rank (rank 0 of the world that lost it)
        self.saved = None
        self._ended_note = None  # (when, what) the driver said of a worker it is ending
        self._reset_phase = contextlib.ExitStack()
        self.host_updates = HostUpdates(self)  # a part of the commit's save (cadence.CheckpointManager)
        # (Horovod's State broadcasts with bcast_object only in its own host check, which
        # check_host_updates below replaces.)
        super().__init__(bcast_object=lambda obj: collectives.broadcast_object(obj, root_rank=0, name="elastic.state"),
                         get_rank=dist.world_rank)
        self.save()

    def _parts(self):
        return {**self.checkpointer.shared, **self.checkpointer.per_rank}

    def save(self):
        """A commit: copies of every component's state."""
        if self.enabled:
            self.saved = {name: copy_state(part.state_dict()) for name, part in self._parts().items()}

    def commit_step(self, step):
        """The commit of ``step``, just trained, inside checkpoint.around_save (whose hooks put the
        ranks' shared state in the components). Per-rank components with ``at_commit(step, rank)``
        first make their state one that a lost worker's replacement, or a survivor given another
        rank, can be given: the shared state (batchnorm.RankStatistics), or one derived from the
        step and the rank (rng.RngState). The host check follows (``check_host_updates``, outside
        the save; Horovod's own ``commit`` does both at once)."""
        if self.enabled:
            for part in self.checkpointer.per_rank.values():
                if hasattr(part, "at_commit"):
                    part.at_commit(step, dist.world_rank())
        self.save()

    def on_worker_ended(self, text):
        """Horovod's driver (the project's patch), to rank 0: it is ending a worker that answered
        nothing, named in ``text``; this rank's line of the reset says so, and the driver adds none."""
        self._ended_note = (time.monotonic(), text)
        return True

    def _why_lost(self):
        """The driver's word on a worker it is ending, where it came just now; else how the collective failed."""
        note, self._ended_note = self._ended_note, None
        if note is not None and time.monotonic() - note[0] < ENDED_NOTE_SECONDS:
            return f" ({note[1]})"
        return _how()

    def restore(self):
        # Rank 0 says it at once; where rank 0 was the worker lost, the rank the state comes from
        # says it once the next world has formed (sync).
        self.lost_line = (f"elastic: a worker was lost{self._why_lost()}; back to the last commit "
                          f"(step {self.saved['train_state']['step']})")
        self.ctx.print0(self.lost_line)
        self.lost_line_said = self.ctx.is_main
        # Copies again: load_state_dict may keep the given tensors, which training then updates in place.
        for name, part in self._parts().items():
            part.load_state_dict(copy_state(self.saved[name]))
            if hasattr(part, "zero_grad"):
                # The failed step's partial gradients must not add to the next step's.
                # (Horovod's optimizer forgot its pending allreduces in load_state_dict.)
                part.zero_grad()
        self._enter_reset_phase()

    def check_host_updates(self):
        """Horovod's check at a commit: where the driver said hosts were added or removed since the
        last one, every rank raises HostsUpdatedInterrupt here, at the same step (hvd.elastic.run
        re-forms the world). Collective: where no rank has heard of a change since the last it acted
        on (``host_updates``, in the commit's one allreduce: the common case), nothing more; else one
        tiny allreduce of the newest update any rank has had. Horovod's own sends rank 0's as a
        pickled object, two broadcasts: at 16 ranks on 2 cores each collective costs about 60 ms."""
        heard = self.host_updates.take()
        if heard is None:  # every rank: none newer than the last it acted on
            return
        previous, newest, update = heard
        # Horovod: the newest update over every rank, and whether hosts were removed or added in any;
        # the last one acted on too (a worker that joined in the last reset has had none)
        mine = torch.tensor([previous, newest, bool(update & HostUpdateResult.removed),
                             bool(update & HostUpdateResult.added)], dtype=torch.int64)  # the driver's seconds
        previous, newest, removed, added = collectives.max_over_ranks(mine, name="elastic.hosts").tolist()
        self._last_updated_timestamp = newest
        if newest > previous:
            self._enter_reset_phase()
            raise HostsUpdatedInterrupt(bool(removed) and not added)  # only removed: the survivors skip the sync

    def _read_host_messages(self):
        """(the last update acted on, the newest heard since, what changed) from the driver's messages."""
        newest = previous = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > newest:
                newest, update = timestamp, update | result
        return previous, newest, update

    def sync(self):
        """The shared components (and whether the run started) of the first rank that holds the run,
        rank 0 where it does, on every rank; collective."""
        with self.ctx.watchdog.phase("synchronising the elastic state"):
            shared = self.checkpointer.shared
            # Rank 0 of a world may be a worker that never trained: Horovod keeps rank 0 on a live
            # worker, but where the world re-formed twice (a fault during a reset) the worker started
            # for the first fault counts as live, and the run went back to its checkpoint on disk.
            # Horovod: which ranks hold the run, and whether the loss was said (one tiny allgather).
            states = collectives.every_ranks_int(HOLDS_THE_RUN * self.started + SAID_THE_LOSS * self.lost_line_said,
                                                 name="elastic.started")
            holders = [rank for rank, state in enumerate(states) if state & HOLDS_THE_RUN]
            source = holders[0] if holders else 0
            root = dist.world_rank() == source  # this world's rank: the context follows it later (Run.begin)
            if root and self.lost_line and not any(state & SAID_THE_LOSS for state in states):
                print(self.lost_line, flush=True)  # rank 0 of the old world was the worker lost
            self.lost_line, self.lost_line_said = None, False
            mine = {"started": self.started, **{name: part.state_dict() for name, part in shared.items()}}
            received = collectives.broadcast_state(mine if root else None, root_rank=source)
            if not root:
                for name, part in shared.items():
                    part.load_state_dict(received[name])
            self.started = received["started"]
        self._reset_phase.close()
        if self.started:
            # The commit every rank went back to, as this world's ranks hold it: derived for a new
            # worker, or for a survivor given another rank, as the run without the reset derived it.
            self.commit_step(self.checkpointer.shared["train_state"].step)
        else:
            self.save()

    def reset(self):
        """After every reset, once the new world has formed (Horovod's ``on_reset``): the reset's
        phase ends. When hosts were only removed Horovod skips ``sync``: the survivors hold the same
        commit, and train() follows the new rank and size itself (Run.begin)."""
        self._reset_phase.close()

    def on_reset(self):
        """Horovod's on_reset, keeping the host updates that arrived while the new world formed.

        Horovod empties the queue of host updates once the new world has formed,
        which drops an update the driver sent meanwhile: it sends each change once,
        so that change was never acted on. Seen with 16 ranks on four hosts: node4's
        blacklist cooldown ended while the 12 survivors re-formed (their collectives
        took 30 s to fail) and node4 never rejoined. The updates that were part of
        this reset are dropped when it begins (``_enter_reset_phase``) instead; one
        the new world already includes costs at most one more reset. (Horovod's
        State keeps the queue in ``_host_messages``; this class is that State.)
        """
        arrived_during_the_reset = self._host_messages
        super().on_reset()
        self._host_messages = arrived_during_the_reset

    def _enter_reset_phase(self):
        # A checkpoint written in the background is on disk before the world changes: its writer
        # (rank 0 until now) may not be rank 0 of the new world, which writes the next ones.
        self.checkpointer.writer.finish()
        # Updates received until now are part of this reset: the driver forms the new world from them.
        self._host_messages = queue.Queue()
        # Shutting Horovod down and waiting for the new world can take a while: not a stall.
        self._reset_phase.close()
        self._reset_phase.enter_context(self.ctx.watchdog.phase("an elastic reset"))

    def due(self, step):
        """Whether --elastic-commit-every asks for a commit after ``step``."""
        return step % self.commit_every == 0
