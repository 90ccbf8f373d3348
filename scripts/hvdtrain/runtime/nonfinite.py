"""A loss that turns NaN or Inf: every rank decides the same, before any update.

One rank's non-finite loss makes its gradients non-finite, and Horovod's
average carries them to every rank: applied, they would ruin every rank's
weights. So after the gradient allreduce and before the optimizer steps, the
ranks combine one flag each (one 4-byte allreduce, on every step and every
rank, skipped or not, so the ranks always call the same collectives; only on a
non-finite step an allgather of the flags names the ranks), and all of them
then do the same:

- ``--nonfinite-loss skip`` (default): no update and the gradients are zeroed,
  on every rank. The step still counts as a step (its batch is used, the LR
  schedule moves on), as GradScaler's skipped overflow steps do; the skipped
  steps are counted (``skipped_steps`` in the train state and results.json).
  After ``--max-nonfinite-steps`` skipped steps in a row the run has diverged
  and stops as below.
- ``--nonfinite-loss stop``: the first such step stops the run.

A stop is one line naming the step and the ranks that saw the non-finite loss,
exit status ``NONFINITE_EXIT`` on every rank, and no checkpoint: the last one
written still holds finite weights.

The GradScaler of fp16 AMP is left alone on a skipped step: it scales the loss
after the forward pass, so a lower scale cannot cure a non-finite loss. An
overflow in the scaled gradients with a finite loss stays GradScaler's own
business (it skips that step and lowers its scale, the same on every rank,
since it sees the averaged gradients).
"""

import torch

from hvdtrain import testhooks
from hvdtrain.errors import NONFINITE_EXIT, UsageError
from hvdtrain.liveness import peers
from hvdtrain.runtime import collectives

class NonFiniteGuard:
    """Watches a step's losses on this rank; ``skip_step()`` is the ranks' joint verdict."""

    def __init__(self, policy, max_in_a_row, rank, state, say=print):
        self.policy = policy
        self.max_in_a_row = max_in_a_row
        self.rank = rank
        self.state = state  # a run.TrainState: the step in progress and the skipped count
        self.say = say
        self.in_a_row = 0  # not checkpointed: a resumed run starts a new streak
        self.finite = True

    @classmethod
    def from_settings(cls, settings, rank, state, say=print):
        return cls(settings.nonfinite_loss, settings.max_nonfinite_steps, rank, state, say)

    @property
    def step(self):
        return self.state.step + 1  # the step being computed, numbered as the log numbers it

    def watch(self, loss):
        """Note whether ``loss`` (one backward pass's) is finite; returns it, to backpropagate."""
        loss = testhooks.loss_computed(self.rank, self.step, loss)  # test-only (HVDTRAIN_INJECT_NONFINITE)
        # A tensor, not a bool: no device sync per backward pass.
        self.finite = torch.isfinite(loss.detach()).all() & self.finite
        return loss

    def skip_step(self, can_skip=True):
        """Collective: True when every rank must skip this step; raises when the run must stop.

        ``can_skip=False``: the update is already applied (Adasum steps during
        backward), so a non-finite loss can only stop the run.
        """
        finite, self.finite = bool(self.finite), True
        if testhooks.skips_vote(self.rank, self.step):  # test-only: a rank that leaves the vote out
            return False
        # Not an allgather on every step: N flags to every rank, every step, at N ranks.
        # Horovod: the NaN/Inf vote, one allreduce (Max) of a flag per rank, every step
        if not collectives.any_rank_true(not finite, name="nonfinite.vote"):
            self.in_a_row = 0
            return False
        ranks = collectives.ranks_where(not finite, name="nonfinite.ranks")  # Horovod: which ranks, an allgather
        self.in_a_row += 1
        where = f"non-finite loss (NaN or Inf) at step {self.step} on {peers.rank_list(ranks)}"
        if not can_skip:
            raise RunStopped(f"{where}: --use-adasum applies the update during the backward pass, so the "
                             "step cannot be skipped; stopped")
        if self.policy == "stop":
            raise RunStopped(f"{where}; stopped (--nonfinite-loss stop): lower the LR or check the data, "
                             "then relaunch to resume from the last checkpoint")
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            raise RunStopped(f"{where}: {self.in_a_row} steps in a row (--max-nonfinite-steps "
                             f"{self.max_in_a_row}), training has diverged; stopped: lower the LR or check "
                             "the data, then relaunch to resume from the last checkpoint")
        self.state.skipped_steps += 1
        self.say(f"{where}: step skipped on every rank ({self.state.skipped_steps} skipped in all)")
        return True


class RunStopped(UsageError):
    """Every rank stops with this one line and exit status NONFINITE_EXIT (see errors.py)."""

    exit_status = NONFINITE_EXIT

    def __init__(self, message):
        super().__init__(message, on_every_rank=True)
