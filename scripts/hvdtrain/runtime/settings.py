"""A run's settings, frozen once after validation, and the resume contract.

Both trainers parse their arguments, resolve every default that depends on the
machine or the data (AMP on CUDA, loader workers, the used learning rate, the
world size, the data set's identity) and then freeze the result: nothing
mutates settings afterwards, and the frozen values are what a checkpoint holds.

On resume every saved setting is compared with the new one:
- the world size may change (a resize, ``resize_line``): the model and
  optimizer are replicated, the data position counts samples and the per-rank
  parts are redistributed (checkpoint.Checkpointer.restore);
- ADJUSTABLE settings may change: the new value is used and announced
  (e.g. a longer --epochs/--steps extends the schedule);
- OPERATIONAL settings change nothing that is computed (paths, threads, how
  often to checkpoint or log): used silently;
- every other setting must match: a difference is refused with one line that
  lists each (setting, checkpoint value, new value).
"""
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Union

from hvdtrain.errors import UsageError

# Used and announced when they differ from the checkpoint's.
ADJUSTABLE = {
    "epochs": "the schedule now spans the new length",
    "steps": "the schedule now spans the new length",
    "cpu": "the device changes; results may differ in the last bits",
    "compile": "torch.compile changes kernels, not the model",
    "channels_last": "memory layout only",
}
# Used silently: where things are and how often to report, never what is computed.
OPERATIONAL = {
    "output_dir", "export_dir", "resume", "data", "init_checkpoint", "threads", "workers",
    "verify_images", "checkpoint_every", "checkpoint_write", "keep_checkpoints", "log_every", "stop_check_every", "stop_after",
    "horovod_timeline", "horovod_autotune", "horovod_autotune_log", "horovod_profile", "config", "take_over_lock",
    "scaled_lr",  # in checkpoints until 2026-11: followed from lr, world_size and accumulation_steps
    "nonfinite_loss", "max_nonfinite_steps",  # what to do should a loss turn NaN, not what is computed
    "elastic_commit_every",
    "straggler_interval", "straggler_threshold", "straggler_patience", "straggler_action",  # how to report
}


@dataclass(frozen=True)
class Settings:
    """A run's resolved settings: a frozen dataclass, built once after validation.

    Each trainer declares its own fields (training/cnn.py ``CnnSettings``,
    training/bert.py ``BertSettings``, both on top of ``RunSettings``);
    ``build`` refuses a value without a field and a field without a value, so
    a renamed flag or a typo stops the script before it starts, not at its
    first use. A checkpoint stores ``dict(settings)`` (plain values).
    """

    @classmethod
    def build(cls, args, **resolved):
        """From the parsed arguments plus the values resolved after validation."""
        values = {**vars(args), **resolved}
        names = {item.name for item in fields(cls)}
        unknown, missing = sorted(set(values) - names), sorted(names - set(values))
        if unknown or missing:
            raise TypeError(f"{cls.__name__}: values without a field: {unknown}; fields without a value: {missing}")
        return cls(**{name: _plain(value) for name, value in values.items()})

    @classmethod
    def saved_as_now(cls, saved):
        """A checkpoint's settings (a dict) under today's names: a subclass maps a renamed or replaced setting."""
        return saved

    def keys(self):
        return [item.name for item in fields(self)]

    def __getitem__(self, name):
        return getattr(self, name)


@dataclass(frozen=True)
class RunSettings(Settings):
    """The settings every trainer has (runtime/run.py's flags, elastic, diagnostics)."""
    output_dir: str
    resume: bool
    checkpoint_every: int
    checkpoint_write: str  # auto, async or sync: how rank 0 writes the file (checkpoint.Checkpointer)
    take_over_lock: bool
    keep_checkpoints: int
    stop_after: Optional[int]
    stop_check_every: int
    seed: int
    nonfinite_loss: str
    max_nonfinite_steps: int
    accumulation_steps: int  # backward passes (micro-batches) per optimizer step
    fp16_allreduce: bool
    cpu: bool
    threads: Optional[int]
    horovod_timeline: Optional[str]
    horovod_autotune: bool
    horovod_autotune_log: Optional[str]
    horovod_profile: Optional[str]  # runtime/horovod_profile.py; its effect is in fp16_allreduce and Horovod's variables
    elastic: bool
    elastic_commit_every: int
    world_size: Union[int, str]  # "elastic" under --elastic: it changes while the run goes on
    batch_size: int  # per rank and backward pass
    global_batch: Optional[int]  # --global-batch: samples per step at every world size (None: ranks x step_batch)
    straggler_interval: int  # runtime/stragglers.py
    straggler_threshold: float
    straggler_patience: int
    straggler_action: str

    @property
    def step_batch(self):
        """Samples per rank and optimizer step."""
        return self.batch_size * self.accumulation_steps

    @property
    def global_position(self):
        """The epoch has one order, and its position counts samples at any world size
        (--elastic, --global-batch): each step takes the next global batch of it."""
        return self.elastic or bool(self.global_batch)

    def resize_consequence(self, old_size):
        """What else a resize without --global-batch changes, said in resize_line (the CNN: its LR)."""
        return ""

    def resize_refusal(self, train_state):
        """Why this checkpoint (its saved train state) cannot go on at another world size, or None."""
        return None


def _plain(value):
    """Paths as strings, tuples as lists: what a weights_only checkpoint can hold."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


RESIZABLE = "world_size"  # compared apart: a resize (resize_line), not a refusal


def resume_differences(saved, current):
    """(refused, adjusted): lists of (setting, checkpoint value, new value); the world size apart."""
    refused, adjusted = [], []
    if isinstance(current, Settings):
        saved = current.saved_as_now(saved)
    for name in sorted(set(saved) | set(current.keys())):  # current: Settings or any mapping
        if name in OPERATIONAL or name == RESIZABLE:
            continue
        old, new = saved.get(name, "<unset>"), current[name] if name in current.keys() else "<unset>"
        if old == new:
            continue
        (adjusted if name in ADJUSTABLE else refused).append((name, old, new))
    return refused, adjusted


def check_resume(saved, current, directory):
    """Raise UsageError listing every refused difference; return the adjusted ones."""
    refused, adjusted = resume_differences(saved, current)
    if refused:
        listed = ", ".join(f"{name} {old!r} -> {new!r}" for name, old, new in refused)
        raise UsageError(f"cannot resume from {directory}: settings differ from its checkpoint "
                         f"({listed}); use the checkpoint's values, another --output-dir, or --no-resume")
    return adjusted


def resized_from(saved, current):
    """The checkpoint's world size where this launch has another one, else None.

    Under --elastic both hold "elastic" (the size is the job's, not the run's); a
    run that switches between elastic and plain is refused on ``elastic`` itself.
    """
    old, new = saved.get(RESIZABLE), current[RESIZABLE]
    return old if isinstance(old, int) and isinstance(new, int) and old != new else None


def ranks_checkpoint(size):
    """"2 ranks' checkpoint", "1 rank's checkpoint"."""
    return f"{size} ranks' checkpoint" if size != 1 else "1 rank's checkpoint"


def resize_refusal_line(old_size, new_size, directory, refusal):
    """Why a checkpoint cannot go on at another size: the usage error, one line."""
    return f"cannot resume {ranks_checkpoint(old_size)} in {directory} on {new_size}: {refusal}"


def resize_line(old_size, settings, directory):
    """The one line a resized resume prints: what changes with the size and what does not."""
    new_size = settings.world_size
    head = f"resuming {ranks_checkpoint(old_size)} on {new_size} from {directory}"
    if settings.global_batch:
        return (f"{head}: --global-batch {settings.global_batch} kept, so the samples per step, the LR and the "
                f"optimisation do not change; the epoch goes on from its sample position")
    old, new = old_size * settings.step_batch, new_size * settings.step_batch
    return (f"{head}: {settings.step_batch} samples per rank and step kept, so the global batch goes from "
            f"{old} to {new}{settings.resize_consequence(old_size)}; the epoch goes on from its sample position "
            f"(--global-batch N keeps a step's samples at any size)")


def announce(adjusted, print_fn):
    for name, old, new in adjusted:
        print_fn(f"note: resuming with {name} {new!r} instead of the checkpoint's {old!r}: {ADJUSTABLE[name]}")
