"""The checkpoint files a run leaves in its --output-dir, by name: one place for the naming.

runtime/checkpoint.py writes ``step-<step, 9 digits>.pt`` at each checkpoint with a sidecar
``<file>.sha256`` beside it (``sha256sum -c`` reads it), links ``best.pt`` to the best one,
and renames an unreadable checkpoint (and its sidecar) ``<file>.corrupt``. Written here
again rather than imported from the package: a test that read the package's naming would
agree with a wrong one.
"""
from pathlib import Path

CHECKPOINT_GLOB = "step-*.pt"  # also what a shell loop waits for: until ls DIR/step-*.pt ...
BEST = "best.pt"


def checkpoint_name(step):
    """The name of the file a run writes at ``step``."""
    return f"step-{step:09d}.pt"


def checkpoint_file(output_dir, step):
    """The file a run in ``output_dir`` writes at ``step`` (there or not yet)."""
    return Path(output_dir) / checkpoint_name(step)


def checkpoint_files(output_dir):
    """The checkpoints ``output_dir`` holds, oldest first (a set-aside ``*.corrupt`` is none)."""
    return sorted(Path(output_dir).glob(CHECKPOINT_GLOB))


def checkpoint_names(output_dir):
    """The names of the checkpoints ``output_dir`` holds, oldest first."""
    return [path.name for path in checkpoint_files(output_dir)]


def any_checkpoint(output_dir):
    """Whether ``output_dir`` holds a checkpoint yet: a run has begun training and writing."""
    return any(Path(output_dir).glob(CHECKPOINT_GLOB))


def newest_checkpoint(output_dir):
    """The checkpoint of the latest step ``output_dir`` holds (ValueError: none)."""
    return max(Path(output_dir).glob(CHECKPOINT_GLOB))


def checkpoint_step(path):
    """The step whose checkpoint ``path`` is."""
    return int(Path(path).stem.split("-")[1])


def newest_step(output_dir):
    """The latest step ``output_dir`` holds a checkpoint of (ValueError: none): where a run resumes."""
    return max(checkpoint_step(path) for path in Path(output_dir).glob(CHECKPOINT_GLOB))


def best_file(output_dir):
    """The copy of the checkpoint with the best validation so far."""
    return Path(output_dir) / BEST


def checksum_file(path):
    """The sidecar holding ``path``'s sha256 (a file, or a bare name: then a bare name too)."""
    return Path(f"{path}.sha256")


def set_aside(path):
    """The name an unreadable checkpoint ``path`` is renamed to, never to outrank a good one."""
    return Path(f"{path}.corrupt")
