"""Rank 0's checkpoint file written in the background while training goes on.

By default (``--checkpoint-write auto``) the step that checkpoints pays the gather
and a copy of the state in host memory (``host_copy``), and a writer thread
serialises, writes, fsyncs and checksums (``BackgroundWriter``: one write in flight,
the next checkpoint and every stop wait for it, its failure is one line on every
rank). ``auto`` writes in the background where the copy fits in half the memory the
kernel says is available (``available_memory``). No collective here.
"""
import copy
import threading

import torch

from hvdtrain import durations
from hvdtrain.errors import UsageError


class BackgroundWriter:
    """Rank 0's checkpoint file written by a thread while training goes on; one write in flight.

    The thread is not a daemon: an interpreter that exits normally (the end of training, an
    uncaught error) waits for the write in flight. A process killed mid-write leaves a temporary
    file and the previous checkpoint the newest valid one (atomic_save).
    """

    def __init__(self):
        self.thread = None
        self.failure = None  # why the last write failed, a line

    def start(self, write, what):
        """Run ``write()`` in the background; ``what`` names it in a failure's line."""
        def run():
            try:
                write()
            except Exception as error:  # noqa: BLE001 - reported in one line by wait()
                self.failure = write_failure(what, error)
        self.thread = threading.Thread(target=run, name="checkpoint-writer")
        self.thread.start()

    @property
    def busy(self):
        """Whether a write is in flight now."""
        return self.thread is not None and self.thread.is_alive()

    def wait(self):
        """Block until the write in flight has ended; a UsageError (one line, exit 2) if it failed:
        --output-dir could not take it (a full disk, an I/O error, a lost mount)."""
        if self.thread is not None:
            with durations.timed("waiting for a background checkpoint write"):
                self.thread.join()
            self.thread = None
        failure, self.failure = self.failure, None
        if failure:
            raise UsageError(failure)

    def finish(self):
        """The write in flight on disk, here and now (no collective: an --elastic reset, whose world
        is being re-formed); a failure is said as a warning, and the next checkpoint is written anew."""
        try:
            self.wait()
        except UsageError as failure:
            print(f"warning: {failure}", flush=True)


def write_failure(what, error):
    return (f"writing the checkpoint {what} failed ({error.__class__.__name__}: {error}); the previous "
            "checkpoint is the newest valid one")


def host_copy(value):
    """``value`` (a state to save) with every tensor copied to host memory (pinned where it was on
    a GPU): what training changes next cannot reach the copy a background write serialises."""
    return copy_state(value, to_host=True)


def copy_state(value, to_host=False):
    """``value`` (a state_dict, nested) with every tensor copied (``to_host``: into host memory,
    pinned where it was on a GPU), its dicts, lists and tuples rebuilt (a dict's attributes kept: a
    module's state_dict carries ``_metadata``), anything else deep-copied. copy.deepcopy makes the
    same copy at several times the CPU (ResNet-20's model and optimizer: 4.7 ms against 0.8 ms), and
    an --elastic commit copies on every rank: at 16 ranks on 2 cores each ms a rank is 8 of the job's."""
    if isinstance(value, torch.Tensor):
        if not to_host or value.device.type == "cpu":
            return value.detach().clone()
        pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        return pinned.copy_(value.detach())
    if isinstance(value, dict):
        copied = type(value)((key, copy_state(item, to_host)) for key, item in value.items())
        if hasattr(value, "__dict__"):
            copied.__dict__.update(copy.deepcopy(value.__dict__))
        return copied
    if isinstance(value, (list, tuple)):
        return type(value)(copy_state(item, to_host) for item in value)
    return copy.deepcopy(value)


def tensor_bytes(value):
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def available_memory():
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
