"""A model and a data set the project has never seen, written by a test: train_cnn.py's two seams.

``write_task(directory)`` writes ``their_task.py`` there and returns the options that name
it (``--model DIR/their_task.py:build --dataset DIR/their_task.py:data``). Its model is a
small MLP without BatchNorm or dropout (so 2 ranks x 8 train what 1 rank x 16 trains,
to float rounding); its data set is generated, 3 classes, and its training samples are
augmented with draws from Python's ``random``, NumPy's global generator and torch's global
generator alike: the trainer must key all three per sample for a resume to be exact.
``vit`` and ``dict_data`` are the same task as a Hugging Face user brings it: a
transformers ViT (its output a ModelOutput) on dict samples.
"""
from pathlib import Path

TASK = '''\
"""Written by tests/support/user_task.py: a model and a data set of a user's own."""
import os
import random
import time

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset


def build(num_classes, in_channels, hidden=24):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 6 * 6, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))


class Points(Dataset):
    def __init__(self, count, seed, augment):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (count,), generator=generator)
        centres = torch.tensor([[-1.0], [0.0], [1.0]])[self.labels].view(count, 1, 1, 1)
        self.inputs = centres + 0.5 * torch.randn(count, 2, 6, 6, generator=generator)
        self.augment = augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        x = self.inputs[index]
        if self.augment:  # every generator a user might reach for
            x = x * (1 + 0.1 * torch.rand(()).item()) + 0.05 * float(np.random.randn()) + 0.01 * random.random()
        return x, int(self.labels[index])


def data(data_dir, count=96):
    return Points(count, 1, augment=True), Points(32, 2, augment=False), 3


def vit(num_classes, in_channels):
    """A Hugging Face model: its output is an ImageClassifierOutput, the scores its .logits."""
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(
        image_size=6, patch_size=3, num_channels=in_channels, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=num_classes, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


class DictPoints(Points):
    """Samples as Hugging Face's image data sets give them."""

    def __getitem__(self, index):
        x, label = super().__getitem__(index)
        return {"pixel_values": x, "labels": label}


def dict_data(data_dir):
    return DictPoints(96, 1, augment=True), DictPoints(32, 2, augment=False), 3


class Waves(Points):
    """1-D inputs: a channel of 36 points a sample."""

    def __getitem__(self, index):
        x, label = super().__getitem__(index)
        return x[:1].reshape(1, 36), label


def waves(data_dir):
    return Waves(96, 1, augment=False), Waves(32, 2, augment=False), 3


def conv1d(num_classes, in_channels):
    return nn.Sequential(nn.Conv1d(in_channels, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, num_classes))


class Jitter:
    """An augmentation that draws from a torch.Generator it holds."""

    def __init__(self, seed):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, x):
        return x + 0.01 * torch.randn(x.shape, generator=self.generator)


class OwnTorchGenerator(Points):
    """Holds a torch.Generator inside an attribute (its augmentation): DataLoader workers cannot receive it."""

    def __init__(self, count, seed, augment):
        super().__init__(count, seed, augment)
        self.jitter = Jitter(seed)

    def __getitem__(self, index):
        x, label = super().__getitem__(index)
        return self.jitter(x), label


def torch_generator(data_dir):
    return OwnTorchGenerator(96, 1, augment=False), Points(32, 2, augment=False), 3


class NoLabel(Points):
    def __getitem__(self, index):
        return {"pixel_values": self.inputs[index], "target": int(self.labels[index]), "id": index}


def no_label(data_dir):
    return NoLabel(96, 1, augment=False), Points(32, 2, augment=False), 3


def no_logits(num_classes, in_channels):
    class Scores(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = build(num_classes, in_channels)

        def forward(self, x):
            return {"scores": self.net(x)}
    return Scores()


class OwnGenerator(Points):
    """Draws from a generator of its own, which no per-sample key reaches."""

    rng = np.random.default_rng(0)

    def __getitem__(self, index):
        return self.inputs[index] + float(self.rng.standard_normal()), int(self.labels[index])


def unkeyed(data_dir):
    return OwnGenerator(96, 1, augment=False), Points(32, 2, augment=False), 3


def not_a_module(num_classes, in_channels):
    return "a string"


def wrong_width(num_classes, in_channels):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 6 * 6, num_classes + 1))


def not_a_pair(data_dir):
    return [torch.zeros(2, 6, 6)] * 8, [torch.zeros(2, 6, 6)] * 4, 3


def two_values(data_dir):
    return Points(96, 1, augment=False), Points(32, 2, augment=False)


class RankOneAverages(nn.Module):
    """An edit that hangs a job: at its 5th training step rank 1 alone averages a metric
    (``shapes``: each rank averages one, of a shape that differs: Horovod's own mismatch)."""

    def __init__(self, num_classes, in_channels, shapes=False):
        super().__init__()
        self.net, self.calls, self.shapes = build(num_classes, in_channels), 0, shapes

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == 5 and self.shapes:
                import horovod.torch as hvd
                hvd.allreduce(torch.ones(3 + hvd.rank()), name="user.metric")
            elif self.calls == 5:
                import horovod.torch as hvd
                if hvd.rank() == 1:
                    hvd.allreduce(torch.ones(3), name="user.rank1_only_metric")
        return self.net(x)


def diverging(num_classes, in_channels):
    return RankOneAverages(num_classes, in_channels)


def mismatching(num_classes, in_channels):
    return RankOneAverages(num_classes, in_channels, shapes=True)


class StuckOnRankOne(Points):
    """Rank 1's 100th read never returns (a lost network file system, a deadlocked decoder)."""

    reads = 0

    def __getitem__(self, index):
        StuckOnRankOne.reads += 1
        if StuckOnRankOne.reads == 100 and os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
            time.sleep(3600)
        return super().__getitem__(index)


def stuck(data_dir):
    return StuckOnRankOne(96, 1, augment=False), Points(32, 2, augment=False), 3
'''


def write_task(directory, hugging_face=False):
    """``their_task.py`` in ``directory``; the options that train with its model and data set
    (``hugging_face``: a transformers ViT on dict samples)."""
    path = Path(directory) / "their_task.py"
    path.write_text(TASK)
    if hugging_face:
        return ["--model", f"{path}:vit", "--dataset", f"{path}:dict_data"]
    return ["--model", f"{path}:build", "--dataset", f"{path}:data"]
