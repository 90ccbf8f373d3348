#!/usr/bin/env python
"""A plain PyTorch training loop, one process: where docs/adapting.md's "From your own script" starts.

    python examples/your_loop/plain.py --output-dir runs/plain

with_horovod.py is this file with Horovod and the package's pieces added.
"""
import argparse
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

BATCH = 16
EPOCHS = 3


def points():
    """512 generated points in 8 dimensions; the class is how many of the first two are positive."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 8, generator=generator)
    return TensorDataset(inputs, (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0).long())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/plain"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(points(), batch_size=BATCH, shuffle=True)
    for epoch in range(EPOCHS):
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch + 1} loss {loss.item():.4f}")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.output_dir / "model.pt")


if __name__ == "__main__":
    main()
