"""--elastic: the trainers under ``hvd.elastic.run``, with the checkpoint's components as the state.

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script "python scripts/discover_hosts.py FILE" \\
        python scripts/train_cnn.py --elastic

The elastic state is not a second copy of the checkpoint logic: ``Commits``
holds the run's Checkpointer components (model, optimizer, scheduler, scaler,
train state and position; the per-rank ones too) as in-memory copies of their
``state_dict()``s. Every ``--elastic-commit-every`` steps and at each epoch's
end they are committed (copied); when a worker dies, the survivors load the
last commit; after every reset rank 0's state goes to every rank with tensor
broadcasts (``collectives.broadcast_state``; never one pickle of the model).

A worker that joins a running job starts the script from the top while the
others wait in the sync; it must not make a collective before that sync (it
would pair with the others' broadcasts and hang), so under --elastic the
setup checks run on each rank alone (``agree_before_start``) and restoring the
checkpoint from disk happens inside the elastic function, once per job.
"""
import contextlib
import copy
import os
import queue
from dataclasses import dataclass, field

import horovod.torch as hvd
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt

from hvdtrain.runtime import collectives
from hvdtrain.errors import UsageError
from hvdtrain.runtime.metrics import averages

ELASTIC_ENV = "HOROVOD_ELASTIC"  # set by horovodrun for --min-np/--max-np/--host-discovery-script jobs


def check_launcher(elastic):
    """--elastic outside an elastic horovodrun would wait for a driver that is not there."""
    if elastic and os.environ.get(ELASTIC_ENV) != "1":
        raise UsageError("--elastic needs an elastic launch: horovodrun --min-np N --max-np M "
                         "--host-discovery-script SCRIPT (see README, Elastic training)")


def agree_before_start(elastic, check, *args, **kwargs):
    """``collectives.agree_on_errors``, except under --elastic: each rank checks alone.

    A worker admitted later runs this while the others are in the elastic sync;
    a collective here would never be matched. Every rank reads the same input,
    so each still stops with the same one line.
    """
    if elastic:
        return check(*args, **kwargs)
    return collectives.agree_on_errors(check, *args, **kwargs)


class Commits(State):
    """The run's checkpoint components as Horovod's elastic state.

    ``save``: copies of every component's state_dict (a commit; cadence.CheckpointManager
    decides when, inside the components' save hooks); ``restore``: load them back (a worker
    was lost mid-step); ``sync``: rank 0's shared components to every rank, then
    ``adopt_new_world``. Built from explicit parts: the ``checkpointer`` (its components),
    the run's context (``ctx``: its print0 and watchdog), ``start`` (restore the checkpoint on
    disk, once per job, by the first world) and ``adopt_new_world(started)`` (the rank and
    size after every reset).
    """

    def __init__(self, checkpointer, ctx, commit_every, start, adopt_new_world):
        self.checkpointer = checkpointer
        self.ctx = ctx
        self.commit_every = commit_every
        self.start = start
        self.adopt_new_world = adopt_new_world
        self.started = False  # start() (the checkpoint on disk) is done, once per job
        self.saved = None
        self._reset_phase = contextlib.ExitStack()
        super().__init__(bcast_object=self._broadcast_small, get_rank=hvd.rank)
        self.save()

    @staticmethod
    def _broadcast_small(obj):
        # Horovod: host-update timestamps, a few bytes (the State's own check).
        return hvd.broadcast_object(obj, root_rank=0, name="elastic.hosts")

    def _parts(self):
        return {**self.checkpointer.shared, **self.checkpointer.per_rank}

    def save(self):
        self.saved = {name: copy.deepcopy(part.state_dict()) for name, part in self._parts().items()}

    def restore(self):
        # Copies again: load_state_dict may keep the given tensors, which training then updates in place.
        self.ctx.print0("elastic: a worker was lost; back to the last commit "
                        f"(step {self.saved['train_state']['step']})")
        for name, part in self._parts().items():
            part.load_state_dict(copy.deepcopy(self.saved[name]))
            if hasattr(part, "zero_grad"):
                # The failed step's partial gradients must not add to the next step's.
                # (Horovod's optimizer forgot its pending allreduces in load_state_dict.)
                part.zero_grad()
        self._enter_reset_phase()

    def check_host_updates(self):
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt:
            self._enter_reset_phase()
            raise  # hvd.elastic.run re-forms the world

    def sync(self):
        """Rank 0's shared components (and whether the run started) on every rank."""
        with self.ctx.watchdog.phase("synchronising the elastic state"):
            shared = self.checkpointer.shared
            mine = {"started": self.started, **{name: part.state_dict() for name, part in shared.items()}}
            received = collectives.broadcast_state(mine if hvd.rank() == 0 else None, root_rank=0)
            if hvd.rank() != 0:
                for name, part in shared.items():
                    part.load_state_dict(received[name])
            self.started = received["started"]
        self._reset_phase.close()
        self.adopt_new_world(self.started)
        self.save()

    def reset(self):
        """After every reset, once the new world has formed (Horovod's ``on_reset``).

        When hosts were only removed, Horovod skips ``sync``: the survivors hold
        the same commit, but their rank and size changed, so the run follows the
        new world here too (without this, a job shrunk by discovery went on
        believing in the old size and trained only part of each epoch).
        """
        self._reset_phase.close()
        self.adopt_new_world(self.started)

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

    def elastic_run(self, train):
        """``train()`` under hvd.elastic.run; the checkpoint on disk is restored once, by the first world.

        HorovodInternalError and HostsUpdatedInterrupt reach hvd.elastic.run,
        which restores or keeps the last commit, re-forms the world, syncs and
        calls ``train()`` again; ``train`` reads the rank, size and position anew.
        """
        @hvd.elastic.run
        def elastic_train(state):
            if not state.started:
                self.start()  # the first world: every rank is here together
                state.started = True
                state.save()
            return train()

        return elastic_train(self)


def set_schedule_at(scheduler, progress, peak_lr):
    """--elastic: set the LR for ``progress`` (in the scheduler's units) and this world's ``peak_lr``.

    The LambdaLR is built in samples, not steps: a step's length in samples
    changes with the world size, the schedule must not. The peak LR follows
    the size (Goyal et al.'s scaling) from the first step after a reset.
    """
    scheduler.base_lrs = [peak_lr] * len(scheduler.base_lrs)
    scheduler.last_epoch = progress
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = peak_lr * factor(progress)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


@dataclass
class ElasticPosition:
    """--elastic: where the epoch stands in samples (valid at any world size) and its metric totals.

    A checkpoint component. The ranks' metric sums are folded in at every
    commit, so a lost worker takes none of the committed steps' counts with
    it: the epoch's row covers every sample once (``train_samples``).
    """
    meter: object = field(default=None, repr=False, compare=False)  # the ranks' SumMeter (not saved)
    samples: int = 0  # of the epoch's order, trained and committed
    totals: dict = field(default_factory=dict)  # name -> [sum, count] over every rank

    def state_dict(self):
        return {"samples": self.samples, "totals": self.totals}

    def load_state_dict(self, state):
        self.samples, self.totals = state["samples"], {k: list(v) for k, v in state["totals"].items()}

    def before_save(self):
        """At every checkpoint and commit (checkpoint.around_save): the sums in; collective."""
        self.fold()

    def fold(self):
        """Add every rank's partial sums to the totals; collective."""
        for name, (total, count) in self.meter.reduce_totals("train").items():
            kept = self.totals.setdefault(name, [0.0, 0.0])
            kept[0], kept[1] = kept[0] + total, kept[1] + count
        self.meter.reset()

    def epoch_metrics(self, world_size):
        self.fold()
        return {**averages(self.totals), "train_samples": int(self.totals["train_top1"][1]),
                "world_size": world_size}

    def next_epoch(self):
        self.samples, self.totals = 0, {}
