"""Where the CNN's epochs stand at this world size: one object, whatever the mode.

    plan = EpochPlan(settings, batching, rank, state, train_set, val_set, shares, cuda)   # once per world
    plan.start_epoch()                     # the epoch in progress, from its sample position
    for batch in plan.train_loader:
        plan.set_learning_rate(scheduler)  # the schedule at the samples trained
        ... one step ...
        plan.advance()                     # the position moves on by the step's samples
        if plan.epoch_done or plan.must_restart: ...

The position is ``state.epoch_samples``: the samples of the epoch's order trained so
far (a prefix of it, data/sampling.py), valid at any world size, saved with the train
state and committed under --elastic. The mode picks the sampler, here and only here:

- plain: ``ShardedSampler``, whole steps of --batch-size x ranks (a rank every size-th
  sample of each step); the LR schedule counts steps;
- --global-batch, --elastic: ``ElasticBatchSampler``, steps of the global batch, the
  epoch's last step taking what is left (each rank a slice); the schedule counts samples,
  which no world size changes;
- --balance: ``BalancedSampler``, each step split by the ranks' measured speed
  (training/balance.py); ``must_restart`` once the shares change: the next step is cut
  at the new shares.

Every sampler lists its steps' global sample bounds, so the position, the steps left
and the schedule's progress follow from the bounds alone. After a resize (a resume on
another number of ranks, an --elastic reset) the epoch goes on from its position at
the new size, and the schedule from the samples trained.
"""
from hvdtrain.data.sampling import BalancedSampler, ElasticBatchSampler, ShardedSampler, UnpaddedShardSampler
from hvdtrain.training import loaders, optim


class EpochPlan:
    def __init__(self, settings, batching, rank, state, train_set, val_set, shares=None, cuda=False):
        """``batching``: this world's (training/batching.py), ``rank`` this worker's in it; ``state``:
        the train state (its epoch, step and ``epoch_samples``); ``shares``: --balance's
        balance.Shares, else None."""
        self.settings, self.batching, self.state = settings, batching, state
        self.train_set, self.shares = train_set, shares
        self.sampler = self._sampler(batching.size, rank)
        self.train_loader = loaders.make_loader(train_set, self.sampler, self.sampler.loader_batch_size,
                                                settings.workers, cuda)
        self.val_loader = loaders.make_loader(val_set, UnpaddedShardSampler(len(val_set), rank, batching.size),
                                              2 * settings.batch_size, settings.workers, cuda)
        self.unit = schedule_unit(settings, batching)
        self.steps_per_epoch = self._steps_from(0)
        self.bounds, self.taken = [], 0
        self._shares_seen = None

    def _sampler(self, size, rank):
        settings, samples = self.settings, len(self.train_set)
        if self.shares is not None:
            return BalancedSampler(samples, rank, self.shares.shares, settings.seed)
        if settings.global_position:
            return ElasticBatchSampler(samples, rank, size, settings.step_batch, settings.seed,
                                       global_batch=settings.global_batch, min_share=settings.accumulation_steps)
        return ShardedSampler(samples, rank, size, settings.step_batch, settings.seed)

    def _steps_from(self, start):
        self.sampler.set_epoch(self.state.epoch, start)
        return len(self.sampler.steps)

    @property
    def schedule_length(self):
        """The schedule's units in an epoch (steps, or samples): what the LR schedule was built with."""
        return schedule_length(self.settings, self.batching, len(self.train_set))

    @property
    def total_steps(self):
        """The run's steps at the end of its schedule: those done, the epoch's left at this size, and
        the later epochs'."""
        left = self._steps_from(self.state.epoch_samples)
        return self.state.step + left + (self.settings.epochs - self.state.epoch - 1) * self.steps_per_epoch

    def start_epoch(self):
        """The epoch in progress from its sample position: its augmentation key, its steps left."""
        self.train_set.set_epoch(self.state.epoch)  # the augmentation key; loader workers copy it at iter()
        self.sampler.set_epoch(self.state.epoch, self.state.epoch_samples)
        self.bounds, self.taken = self.sampler.steps, 0
        self._shares_seen = self.shares and list(self.shares.shares)

    def set_learning_rate(self, scheduler):
        """Before each step: the LR of the schedule where the samples trained put it, at this size's peak."""
        progress = self.state.epoch * self.schedule_length + self.state.epoch_samples // self.unit
        optim.set_schedule_at(scheduler, progress, self.batching.lr)

    def advance(self):
        """The step just trained: the epoch's position moves past its samples."""
        self.state.epoch_samples = self.bounds[self.taken][1]
        self.taken += 1

    @property
    def epoch_done(self):
        """No step of the epoch is left: its last one was trained (or none was left at this size:
        the world grew just before the epoch's end)."""
        return self.taken == len(self.bounds)

    @property
    def must_restart(self):
        """--balance: the shares changed; the loader must start again from the position to cut the next
        step at them (its iterator has read indices ahead)."""
        return self._shares_seen is not None and self._shares_seen != self.shares.shares


def schedule_unit(settings, batching):
    """Samples per unit of the LR schedule: a step (a global batch), or one sample where a step's size
    may change within the run (--global-batch's last step of an epoch, --elastic's world sizes)."""
    return 1 if settings.global_position else batching.global_batch


def schedule_length(settings, batching, samples):
    """The LR schedule's units in an epoch of ``samples``: what cnn.build_schedule is built with."""
    return samples // schedule_unit(settings, batching)
