"""When the run's state is saved: the checkpoint manager, one call per step.

    checkpoints = CheckpointManager(checkpointer, settings, state, commits)
    ...                                    # in the trainer's loop, after every step:
    checkpoints.after_step(epoch_end=..., is_best=..., last=..., stopping=...)

It owns the cadence: a checkpoint every --checkpoint-every steps, at every
epoch's end (best.pt too when it is the best), at the schedule's end and when
this launch stops early (a stop request, --stop-after, the straggler action);
under --elastic an in-memory commit (``elastic.Commits``) every
--elastic-commit-every steps and at every epoch's end. The trainer says what
kind of step it was; the manager decides what is saved.
"""
from hvdtrain.runtime.checkpoint import around_save


class CheckpointManager:
    """Checkpoints and --elastic commits at their cadence; ``after_step`` is collective."""

    def __init__(self, checkpointer, settings, state, commits=None):
        self.checkpointer = checkpointer  # the components, and how a checkpoint is written
        self.settings = settings  # --checkpoint-every, and what a checkpoint records
        self.state = state  # its step
        self.commits = commits  # --elastic: the in-memory commits, else None

    def after_step(self, epoch_end=False, is_best=False, last=False, stopping=False):
        """Save what the cadence asks for after the step just trained (and, at an epoch's end, evaluated).

        ``epoch_end``: the step ended an epoch; ``last``: the schedule (the last epoch's end too);
        ``stopping``: this launch stops after it; ``is_best``: best.pt is this checkpoint too.

        Collective, the same on every rank, on the steps that save something: the components' save
        hooks, one allreduce for all (checkpoint.around_save: --elastic or --global-batch, the train
        sums; the CNN, the BatchNorm statistics; at a commit, whether any rank heard of a host
        change); --elastic, the commit's copy; the checkpoint (Checkpointer.write: the per-rank
        entries' alltoall, one allgather once rank 0 has written it or, --checkpoint-write async,
        copied it for its background write); as the launch ends, one allgather once that write is
        on disk (Checkpointer.wait_for_writes); --elastic, where a rank heard of a host change, the
        commit's host check, one tiny allreduce, which raises HostsUpdatedInterrupt when hosts were
        added or removed (hvd.elastic.run re-forms the world).
        """
        step, every = self.state.step, self.settings.checkpoint_every
        # No commit when this launch ends (its checkpoint is what a relaunch reads): the commit's
        # host check may reset the world, which would find the run finished and write no results.
        commit = self.commits is not None and not (stopping or last) and (epoch_end or self.commits.due(step))
        checkpoint = epoch_end or last or stopping or bool(every and step % every == 0)
        if not (commit or checkpoint):
            return
        parts = [*self.checkpointer.parts(), *([self.commits.host_updates] if commit else [])]
        with around_save(parts):  # the hooks' one allreduce, once for both
            # The commit first: once a checkpoint of this step is on disk, every rank holds its commit too.
            if commit:
                self.commits.commit_step(step)
            if checkpoint:
                self.checkpointer.write(step, self.settings, is_best)
        if stopping or last:  # the launch ends: its checkpoint on disk first (--checkpoint-write async)
            self.checkpointer.wait_for_writes()
        if commit:
            self.commits.check_host_updates()
