"""The world's arithmetic: a step's samples over the ranks, and the LR they train at.

Computed once per world (a launch, and again after every --elastic reset), here
and nowhere else, from the settings and the world's size:

    batching = cnn.batching(settings, ctx)     # or Batching.of(settings, size)
    batching.global_batch                      # samples per optimizer step, over every rank
    batching.rank_batch                        # each rank's (the mean where they differ by one)
    batching.lr                                # the peak LR of the schedule at this size

Without --global-batch the global batch grows with the ranks (--batch-size x
--accumulation-steps on each) and the CNN's LR grows with it (Goyal et al.);
with --global-batch N it is N at every size, split among the ranks, and the LR
does not change.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Batching:
    size: int  # ranks in this world
    global_batch: int  # samples per optimizer step over all of them
    lr: float  # the schedule's peak LR at this size

    @classmethod
    def of(cls, settings, size, lr_scale=lambda global_batch: 1.0):
        """At ``size`` ranks: --global-batch, or --batch-size x --accumulation-steps x ranks; the LR
        is --lr times ``lr_scale(global_batch)`` (the CNN's linear scaling, or 1)."""
        global_batch = settings.global_batch or size * settings.step_batch
        return cls(size, global_batch, settings.lr * lr_scale(global_batch))

    @property
    def rank_batch(self):
        """Each rank's samples per step (ranks under --global-batch or --balance may differ from it)."""
        return self.global_batch // self.size
