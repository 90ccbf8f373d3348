"""Your own network for train_cnn.py:

    horovodrun -np 2 python scripts/train_cnn.py --model examples/my_model.py:build
    horovodrun -np 2 python scripts/train_cnn.py --model examples/my_model.py:build --model-arg width=32

``build(num_classes, in_channels)`` returns any torch.nn.Module whose output is one
score per class; the trainer checks that on two samples before it starts. Its other
parameters (``width``) take --model-arg KEY=VALUE.
"""
import torch.nn as nn


def build(num_classes, in_channels, width=16):
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(width * 4, num_classes))
