"""A run's settings, frozen once after validation, and the resume contract.

Both trainers parse their arguments, resolve every default that depends on the
machine or the data (AMP on CUDA, loader workers, the used learning rate, the
world size, the data set's identity) and then freeze the result: nothing
mutates settings afterwards, and the frozen values are what a checkpoint holds.

On resume every saved setting is compared with the new one:
- ADJUSTABLE settings may change: the new value is used and announced
  (e.g. a longer --epochs/--steps extends the schedule);
- OPERATIONAL settings change nothing that is computed (paths, threads, how
  often to checkpoint or log): used silently;
- every other setting must match: a difference is refused with one line that
  lists each (setting, checkpoint value, new value).
"""
from pathlib import Path

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
    "verify_images", "checkpoint_every", "keep_checkpoints", "log_every", "stop_check_every", "stop_after",
    "horovod_timeline", "horovod_autotune", "horovod_autotune_log", "config", "take_over_lock",
    "scaled_lr",  # follows from lr, world_size and accumulation_steps, which are compared
    "nonfinite_loss", "max_nonfinite_steps",  # what to do should a loss turn NaN, not what is computed
    "elastic_commit_every",
}


class Settings:
    """Read-only attribute access to a dict of plain values (what checkpoints store)."""

    def __init__(self, values):
        object.__setattr__(self, "_values", {key: _plain(value) for key, value in values.items()})

    def __getattr__(self, name):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError(f"settings are frozen after validation (tried to set {name})")

    def keys(self):
        return self._values.keys()

    def __getitem__(self, name):
        return self._values[name]


def _plain(value):
    """Paths as strings, tuples as lists: what a weights_only checkpoint can hold."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def resume_differences(saved, current):
    """(refused, adjusted): lists of (setting, checkpoint value, new value)."""
    refused, adjusted = [], []
    for name in sorted(set(saved) | set(current.keys())):
        if name in OPERATIONAL:
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


def announce(adjusted, print_fn):
    for name, old, new in adjusted:
        print_fn(f"note: resuming with {name} {new!r} instead of the checkpoint's {old!r}: {ADJUSTABLE[name]}")
