#!/usr/bin/env python
"""plain.py with Horovod and the package's pieces: n ranks train what one rank does, a stopped job
relaunched goes on exactly where it stopped, bad input is one line, and a hung rank ends the job.

    horovodrun -np 2 python examples/your_loop/with_horovod.py --output-dir runs/mine

Each line marked "# +" is one added to plain.py, "# ~" one changed (docs/adapting.md counts them).
"""
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler  # +
import horovod.torch as hvd  # +

from hvdtrain import cli  # +
from hvdtrain.errors import UsageError  # +
from hvdtrain.runtime import dist, rng  # +
from hvdtrain.runtime.checkpoint import Checkpointer  # +

BATCH = 16  # the global batch: 16 on any number of ranks, so that n ranks train what one does
EPOCHS = 3


def points():
    """512 generated points in 8 dimensions; the class is how many of the first two are positive."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 8, generator=generator)
    return TensorDataset(inputs, (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0).long())


class Progress:  # + where training stands, in the checkpoint
    def __init__(self):  # +
        self.epoch = self.batch = self.step = 0  # +

    def state_dict(self):  # +
        return dict(vars(self))  # +

    def load_state_dict(self, state):  # +
        vars(self).update(state)  # +


def main():
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])  # ~ a bad option: one line, exit 2
    parser.add_argument("--output-dir", type=Path, default=Path("runs/mine"))  # ~
    parser.add_argument("--stop-after", type=cli.positive_int, metavar="STEP",  # +
                        help="stop after this step, as a preempted job does; the same command resumes")  # +
    args = parser.parse_args()
    # Horovod: hvd.init(), this rank's threads, the progress watchdog and the heartbeat (a hung or lost
    # rank ends the job with one line naming it)
    ctx = dist.init(use_cuda=False)  # +
    if BATCH % hvd.size():  # + every rank finds it: rank 0 alone says it
        raise UsageError(f"{hvd.size()} ranks cannot share a batch of {BATCH}: use a divisor of it", on_every_rank=True)  # +
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = points()  # +
    # Each rank its share of every batch: sample i of the epoch's order goes to rank i mod size
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)  # +
    loader = DataLoader(dataset, batch_size=BATCH // hvd.size(), sampler=sampler)  # ~
    # Horovod: the gradients averaged over the ranks by allreduce during backward
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  # +
    progress = Progress()  # +
    recorded = {"global_batch": BATCH, "precision": "fp32"}  # + the run's settings, in each checkpoint
    checkpointer = Checkpointer(ctx, args.output_dir, keep=2, shared={  # +
        "model": model, "optimizer": optimizer, "train_state": progress}, per_rank={"rng": rng.RngState(0)})  # +
    if checkpointer.restore() is None:  # + the newest checkpoint, if there is one
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # + Horovod: rank 0's initial weights
    while progress.epoch < EPOCHS:  # ~
        sampler.set_epoch(progress.epoch)  # +
        for index, (inputs, labels) in enumerate(loader):
            if index < progress.batch:  # + a resumed epoch goes on at its next batch
                continue  # +
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            progress.batch, progress.step = index + 1, progress.step + 1  # +
            ctx.watchdog.step(progress.step)  # + progress: a rank that stops making it ends the job
            if progress.step == args.stop_after:  # +
                checkpointer.save(progress.step, recorded)  # +
                return checkpointer.wait_for_writes()  # +
        progress.epoch, progress.batch = progress.epoch + 1, 0  # +
        loss = hvd.allreduce(loss.detach(), name="epoch_loss")  # + Horovod: the ranks' mean
        ctx.print0(f"epoch {progress.epoch} loss {loss.item():.4f}")  # ~ rank 0 alone
        checkpointer.save(progress.step, recorded)  # +
    checkpointer.wait_for_writes()  # +
    if hvd.rank() == 0:  # +
        torch.save(model.state_dict(), args.output_dir / "model.pt")


if __name__ == "__main__":
    cli.run_main(main)  # ~ an error on any rank: one line, not a traceback per rank
