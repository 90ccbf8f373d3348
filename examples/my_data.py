"""Your own data set for train_cnn.py:

    horovodrun -np 2 python scripts/train_cnn.py --dataset examples/my_data.py:load --model examples/my_model.py:build

``load(data_dir)`` returns (training set, validation set, number of classes): map-style
sets of (image tensor [channels, height, width], class) pairs. With --data DIR this one
reads DIR/train.npz and DIR/val.npz (arrays "images" N x C x H x W and "labels" N);
without, it draws stripes to tell apart: horizontal, vertical or diagonal.

Its training samples are augmented with random shifts and noise drawn from torch's
global generator (Python's `random` and NumPy's global one would do as well): the
trainer seeds them per sample from (seed, epoch, index), so a resumed run sees the
samples an uninterrupted one sees.
"""
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class Images(Dataset):
    def __init__(self, images, labels, augment):
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index]
        if self.augment:
            shift = torch.randint(-2, 3, (2,))
            image = torch.roll(image, (int(shift[0]), int(shift[1])), dims=(1, 2))
            image = image + 0.1 * torch.randn_like(image)
        return image, int(self.labels[index])


def stripes(count, size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (count,), generator=generator)
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    period = torch.randint(3, 6, (count, 1, 1), generator=generator)
    along = torch.stack([rows, cols, rows + cols])[labels]  # the coordinate each class stripes along
    images = ((along // period) % 2).float().unsqueeze(1)
    return images, labels


def load(data_dir):
    if data_dir is None:
        return Images(*stripes(1024, seed=1), augment=True), Images(*stripes(256, seed=2), augment=False), 3
    parts = [np.load(Path(data_dir) / f"{split}.npz") for split in ("train", "val")]
    classes = int(max(part["labels"].max() for part in parts)) + 1
    return (Images(torch.from_numpy(parts[0]["images"]).float(), parts[0]["labels"], augment=True),
            Images(torch.from_numpy(parts[1]["images"]).float(), parts[1]["labels"], augment=False), classes)
