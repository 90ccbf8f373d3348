"""Your own data set for train_cnn.py: ``--dataset MODULE:CALLABLE``, with every guarantee kept.

    def my_data(data_dir):                 # --data DIR, or None
        return train_set, val_set, num_classes

The sets are map-style (``len()`` and ``[index]``), each sample an (input tensor,
integer label) pair, or a dict of them (``{"pixel_values": ..., "labels": ...}``, as
Hugging Face's data sets give); the input's first dimension is its channels (what
``--model`` is built for). Every rank builds the same sets, and each trains its share of them.

Exact resume needs a sample's random augmentation to depend only on (seed, epoch,
index), whichever rank, DataLoader worker or relaunch reads it. ``KeyedSamples``
makes that hold for your own random transforms too: each sample is read with
Python's ``random``, NumPy's global generator and torch's global generator seeded
from that key, and their states put back afterwards (the training's own draws,
dropout say, go on undisturbed). Randomness from a generator of your own (a
``numpy.random.default_rng()`` made once, say) escapes it: ``probe`` reads sample
0 twice with the same key at start and says in one line that exact resume does
not hold when the two differ.
"""
import contextlib
import hashlib
import io
import pickle
import random
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import Dataset

from hvdtrain import usercode
from hvdtrain.data.images import sample_key
from hvdtrain.errors import UsageError


@contextlib.contextmanager
def keyed_generators(seed, epoch, index):
    """Python's, NumPy's and torch's global generators seeded from (seed, epoch, index) inside;
    their states as they were outside."""
    key = sample_key(seed, epoch, index)
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(key)
    np.random.seed(key % 2**32)
    torch.manual_seed(key)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


# A dict sample's keys (Hugging Face's names first): its label, and its input where it holds more than one other.
LABEL_KEYS = ("labels", "label")
INPUT_KEYS = ("pixel_values", "input_values", "inputs", "input")


def as_pair(item):
    """A sample as (input, label): a dict sample's input and label (LABEL_KEYS, INPUT_KEYS, or its one
    other key) taken out; anything else as it is (``sample`` checks it)."""
    if not isinstance(item, Mapping):
        return item
    labels = [key for key in LABEL_KEYS if key in item]
    others = [key for key in item if key not in LABEL_KEYS]
    inputs = others if len(others) == 1 else [key for key in INPUT_KEYS if key in item]
    if len(labels) != 1 or len(inputs) != 1:
        raise UsageError(f"a dict sample needs one label key ({' or '.join(LABEL_KEYS)}) and one input: its only "
                         f"other key, or one of {', '.join(INPUT_KEYS)}; its keys are {', '.join(map(str, item))}")
    return item[inputs[0]], item[labels[0]]


class KeyedSamples(Dataset):
    """A user's map-style data set whose global random generators are keyed per sample; its samples
    as (input, label) pairs."""

    def __init__(self, samples, seed):
        self.samples, self.seed, self.epoch = samples, seed, 0

    def set_epoch(self, epoch):
        """Call before iterating: DataLoader workers copy the data set at that moment."""
        self.epoch = epoch

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        with keyed_generators(self.seed, self.epoch, index):
            return as_pair(self.samples[index])


def load(spec, data_dir, seed, options=None):
    """(train set, val set, number of classes, channels) from the user's ``spec``, called with
    ``options`` (--dataset-arg) as keyword arguments; UsageError, one line, for anything that does not fit."""
    build = usercode.load_callable(spec, "--dataset")
    made = usercode.call(spec, "--dataset", build, data_dir, **(options or {}))
    if not (isinstance(made, (tuple, list)) and len(made) == 3):
        raise UsageError(f"--dataset {spec}: {build.__name__}(data_dir) must return (train set, val set, "
                         f"number of classes), not {type(made).__name__}")
    train, val, classes = made
    for name, part in (("training", train), ("validation", val)):
        if not (hasattr(part, "__len__") and hasattr(part, "__getitem__")):
            raise UsageError(f"--dataset {spec}: its {name} set is not map-style (len() and [index]): "
                             f"{type(part).__name__}")
        if len(part) == 0:
            raise UsageError(f"--dataset {spec}: its {name} set is empty")
    if not (isinstance(classes, int) and classes >= 2):
        raise UsageError(f"--dataset {spec}: the number of classes must be an integer of 2 or more, not {classes!r}")
    train, val = KeyedSamples(train, seed), KeyedSamples(val, seed)
    first = sample(train, spec, 0)
    return train, val, classes, first[0].shape[0] if first[0].dim() else 1


class _HoldsGenerator(Exception):
    pass


class _WorkerPickler(pickle.Pickler):
    """Pickles as the DataLoader sends a data set to its workers, refusing a torch.Generator at any depth."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Generator):
            raise _HoldsGenerator()
        return NotImplemented


def check_workers_receive(dataset, spec, workers):
    """UsageError (one line) when DataLoader worker processes cannot receive ``dataset`` (a KeyedSamples):
    an attribute of the user's set that does not pickle (an open file, a lock), or that is or holds, at
    any depth, a torch.Generator (it pickles, but a forkserver worker dies unpickling it, naming neither
    the set nor the cause)."""
    for name, value in vars(dataset.samples).items():
        try:
            _WorkerPickler(io.BytesIO()).dump(value)
            continue
        except _HoldsGenerator:
            why = ("is a torch.Generator" if isinstance(value, torch.Generator)
                   else f"({type(value).__name__}) holds a torch.Generator")
            why += ", which a DataLoader worker process cannot receive"
        except Exception as error:  # noqa: BLE001 - whatever pickling the user's object raises
            why = f"({type(value).__name__}) does not pickle ({usercode.first_line(error)})"
        raise UsageError(f"--dataset {spec}: its {type(dataset.samples).__name__}.{name} {why}, and --workers "
                         f"{workers} sends the data set to worker processes: create it in __getitem__ (a "
                         f"generator seeded per sample, a file opened on first use), or use --workers 0")


def sample(dataset, spec, index, epoch=0):
    """Sample ``index`` of ``dataset`` (a KeyedSamples) at ``epoch``, checked: (input tensor, integer label)."""
    dataset.set_epoch(epoch)
    try:
        item = dataset[index]
    except UsageError as error:
        raise UsageError(f"--dataset {spec}: sample {index}: {error}") from None
    except Exception as error:  # noqa: BLE001 - the user's code: whatever it raises, one line
        raise UsageError(f"--dataset {spec}: reading sample {index} raised {error.__class__.__name__}: "
                         f"{usercode.first_line(error)}") from None
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and torch.is_tensor(item[0])
            and isinstance(int_label(item[1]), int)):
        raise UsageError(f"--dataset {spec}: a sample must be (input tensor, integer label) or a dict of them, not "
                         f"{type(item).__name__} {str(item)[:60]!r}")
    return item


def int_label(label):
    if torch.is_tensor(label) and label.numel() == 1 and not label.is_floating_point():
        return int(label)
    return label if isinstance(label, (int, np.integer)) and not isinstance(label, bool) else None


def probe(dataset, spec):
    """None, or the one line saying exact resume does not hold: sample 0 read twice with the same key differs."""
    (first, label), (again, label_again) = sample(dataset, spec, 0), sample(dataset, spec, 0)
    if torch.equal(first, again) and int_label(label) == int_label(label_again):
        return None
    return (f"note: --dataset {spec}: sample 0 differs between two reads at the same (seed, epoch, index): its "
            "randomness does not come from Python's, NumPy's or torch's global generators (a generator of its "
            "own?), so a resumed run will not see the samples an uninterrupted one sees (exact resume does not "
            "hold; draw from the global generators, or from one seeded per sample)")


def fingerprint(dataset, spec):
    """sha256 of sample 0 at epoch 0 (its bytes and label): ranks reading other data differ here."""
    data, label = sample(dataset, spec, 0)
    digest = hashlib.sha256(data.detach().cpu().contiguous().numpy().tobytes())
    digest.update(str(int_label(label)).encode())
    return digest.hexdigest()
