#!/usr/bin/env python
"""An example trainer to copy: a 1-D convolutional net learns the frequency of noisy signals, with Horovod.

    horovodrun -np 2 python scripts/train_signals.py --output-dir runs/signals

Another task than the two shipped (sequence regression, generated data, no files), built
from the package's pieces as train_cnn.py is, so it keeps what every script guarantees:
a stop (SIGTERM/SIGUSR1, --stop-after) checkpoints and a relaunch goes on exactly where
it stopped; bad input is one line; a rank that freezes ends the job through the
watchdog; --elastic runs under hvd.elastic.run. docs/adapting.md walks through it, the
lines of it that are the task's own marked.
"""
import math
from dataclasses import dataclass

import torch
import horovod.torch as hvd

from hvdtrain import cli, options
from hvdtrain.data.images import sample_generator
from hvdtrain.durations import SectionTimer
from hvdtrain.errors import UsageError
from hvdtrain.runtime import collectives, dist, elastic, nonfinite, precision, rng
from hvdtrain.runtime.checkpoint import Checkpointer
from hvdtrain.runtime.metrics import EpochSums, SumMeter
from hvdtrain.runtime.run import Run, TrainState
from hvdtrain.runtime.settings import RunSettings
from hvdtrain.training import optim
from hvdtrain.training.batching import Batching
from hvdtrain.training.epochs import EpochPlan, schedule_length


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    task = parser.add_argument_group("the task")
    task.add_argument("--samples", type=cli.positive_int, default=2048, help="training signals (and a quarter as many to validate)")
    task.add_argument("--length", type=cli.positive_int, default=64, help="points per signal")
    task.add_argument("--noise", type=cli.fraction, default=0.3, help="the noise's standard deviation, drawn anew each epoch")
    task.add_argument("--channels", type=cli.positive_int, default=16, help="the convolutions' width")
    task.add_argument("--epochs", type=cli.positive_int, default=4)
    task.add_argument("--batch-size", type=cli.positive_int, default=32, help="per worker")
    task.add_argument("--lr", type=cli.positive_float, default=3e-3, help="per --batch-size; scaled with the workers")
    task.add_argument("--workers", type=cli.non_negative_int, default=0, help="DataLoader processes per rank")
    device = options.add_run_arguments(parser, output_dir="runs/signals", checkpoint_every=0)
    options.add_precision_arguments(device, cuda_auto="bf16")
    options.add_elastic_arguments(device, commit_every=20)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class SignalSettings(RunSettings):  # the task's: what a checkpoint records and a resume compares
    samples: int
    length: int
    noise: float
    channels: int
    epochs: int
    lr: float
    workers: int
    precision: str  # resolved: fp32, bf16 or fp16 (fp16 with a GradScaler)


@dataclass
class SignalState(TrainState):  # where training stands: the epoch's samples trained (training/epochs.py)
    epoch_samples: int = 0

    def next_epoch(self):
        super().next_epoch()
        self.epoch_samples = 0


@dataclass
class Parts:  # what train() trains with, built once by main()
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # Horovod's DistributedOptimizer
    scheduler: object
    scaler: object  # precision.scaler: fp16's GradScaler, else a no-op
    guard: nonfinite.NonFiniteGuard  # a NaN/Inf loss skips the step on every rank (or stops)
    sums: EpochSums  # the epoch's training MSE over every rank
    train_set: torch.utils.data.Dataset
    val_set: torch.utils.data.Dataset


class Signals(torch.utils.data.Dataset):  # the task's data: sample i's noise keyed by (seed, epoch, i)
    """Sines of 1 to 8 cycles per signal, random phase, and the frequency to learn (standardised)."""

    def __init__(self, count, length, noise, seed):
        self.count, self.length, self.noise, self.seed, self.epoch = count, length, noise, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        shape = sample_generator(self.seed, 0, index)  # the signal itself: the same every epoch
        frequency = 1 + 7 * torch.rand((), generator=shape)
        phase = 2 * math.pi * torch.rand((), generator=shape)
        t = torch.arange(self.length) / self.length
        noise = torch.randn(self.length, generator=sample_generator(self.seed, self.epoch, index)) * self.noise
        signal = torch.sin(2 * math.pi * frequency * t + phase) + noise
        return signal.unsqueeze(0), ((frequency - 4.5) / 2).reshape(1)


class FrequencyNet(torch.nn.Sequential):  # the task's model
    def __init__(self, channels, length):
        super().__init__(torch.nn.Conv1d(1, channels, 9, padding=4), torch.nn.ReLU(),
                         torch.nn.Conv1d(channels, channels, 9, padding=4), torch.nn.ReLU(),
                         torch.nn.Flatten(), torch.nn.Linear(channels * length, 1))


def check_args(args, ctx):
    """What the arguments resolve to on this rank's device: its precision (UsageError: one line)."""
    elastic.check_launcher(args.elastic)
    if args.samples // ctx.size < args.batch_size * args.accumulation_steps:
        raise UsageError(f"--samples {args.samples} over {ctx.size} workers leave fewer than one batch of "
                         f"{args.batch_size * args.accumulation_steps} each")
    return {"precision": precision.resolve(args.precision, ctx.device.type, cuda_auto="bf16").name}


def main():
    args = parse_args()
    startup = dist.before_init(args)  # quiet Ctrl-C, SIGTERM/SIGUSR1 a stop request, the variables hvd.init() reads
    # Horovod: initialize Horovod
    hvd.init()
    # Horovod: this rank's GPU (one per process; --cpu: none), its share of the node's cores, its watchdog
    ctx = dist.after_init(startup)
    # Horovod: a bad argument stops every rank with the same one line
    resolved = collectives.agreement(alone=args.elastic)(check_args, args, ctx)
    settings = SignalSettings.build(args, **resolved, world_size="elastic" if args.elastic else ctx.size,
                                    global_batch=None)
    ctx.print0(f"signals: {settings.samples} of {settings.length} points; {ctx.size} workers x batch "
               f"{settings.batch_size}; device {ctx.device.type}, precision {settings.precision}")
    rng.seed_everything(settings.seed)  # the same initial weights on every rank
    train_set = Signals(settings.samples, settings.length, settings.noise, settings.seed)
    val_set = Signals(settings.samples // 4, settings.length, 0.0, settings.seed + 1)
    model = FrequencyNet(settings.channels, settings.length).to(ctx.device)
    batching = Batching.of(settings, ctx.size, lr_scale=lambda global_batch: global_batch / settings.batch_size)
    # Horovod: the gradients averaged by allreduce during backward
    optimizer = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=batching.lr),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=settings.accumulation_steps)
    dist.fixed_gradient_buckets(optimizer)  # Horovod: fused the same way every step, bit-for-bit results
    length = schedule_length(settings, batching, len(train_set))
    scheduler = optim.warmup_then_decay(optimizer, length // 2, settings.epochs * length)
    scaler = precision.scaler(settings.precision, ctx.device)  # fp16 only: the loss scaled, steps checked
    state = SignalState()
    sums = EpochSums(SumMeter("train_mse"), folded=settings.global_position)
    checkpointer = Checkpointer(ctx, settings.output_dir, keep=settings.keep_checkpoints,
                                write_mode=settings.checkpoint_write,
                                shared={"model": model, "optimizer": optimizer, "scheduler": scheduler,
                                        "scaler": scaler, "epoch_sums": sums, "train_state": state},
                                per_rank={"rng": rng.RngState(settings.seed), "meter": sums.meter})
    # Horovod: the run's elastic state (committed, restored and synced under --elastic)
    commits = elastic.Commits(checkpointer, ctx, settings.elastic_commit_every, enabled=settings.elastic)
    run = Run(ctx, settings, state, checkpointer, commits, SectionTimer())
    guard = nonfinite.NonFiniteGuard.from_settings(settings, ctx.rank, state, say=ctx.print0)
    # Horovod: under --elastic, hvd.elastic.run calls train() again after every reset
    train_in_world = hvd.elastic.run(train) if settings.elastic else train
    train_in_world(commits, run, Parts(model, optimizer, scheduler, scaler, guard, sums, train_set, val_set))


def train(commits, run, parts):
    """The epochs left, in this world (hvd.elastic.run calls it again after every reset). ``run``: the
    settings, this rank's context, the train state and the run's life (runtime/run.py)."""
    settings, ctx, state, timer = run.settings, run.ctx, run.state, run.timer
    if run.begin() == "fresh":
        # Horovod: every rank starts from rank 0's initial weights
        collectives.broadcast_parameters(parts.model.state_dict(), root_rank=0)
    if run.nothing_to_train(finished=state.epoch >= settings.epochs):
        return
    batching = Batching.of(settings, ctx.size, lr_scale=lambda global_batch: global_batch / settings.batch_size)
    plan = EpochPlan(settings, batching, ctx.rank, state, parts.train_set, parts.val_set)  # the sample position at this size
    run.retarget(plan.total_steps)
    reason = None
    while state.epoch < settings.epochs:
        plan.start_epoch()
        for signals_batch, frequencies in timer.timed(plan.train_loader, "data"):
            plan.set_learning_rate(parts.scheduler)
            with timer.section("compute"):
                signals_batch, frequencies = signals_batch.to(ctx.device), frequencies.to(ctx.device)
                with autocast(settings.precision, ctx.device):
                    predicted = parts.model(signals_batch)
                loss = parts.guard.watch(torch.nn.functional.mse_loss(predicted.float(), frequencies))
                parts.scaler.scale(loss).backward()  # Horovod: the gradients' allreduce starts here
            # Horovod: wait for the averaged gradients, the ranks' NaN/Inf vote (an allreduce), step
            if optim.finish_step(parts.optimizer, parts.scaler, guard=parts.guard, timer=timer):
                parts.sums.meter.add("train_mse", loss.detach() * len(frequencies), len(frequencies))
            parts.scheduler.step()
            plan.advance()
            reason = run.step_done()  # Horovod: the stop vote every --stop-check-every steps
            if reason or plan.epoch_done:
                break
            run.save()  # Horovod: a checkpoint's collectives and --elastic's commit, when due
        if plan.epoch_done:
            row = {"epoch": state.epoch + 1, "step": state.step, **parts.sums.epoch_metrics(ctx.size),  # Horovod: allreduce
                   **validate(parts.model, plan.val_loader, settings.precision, ctx.device)}  # Horovod: allreduce
            parts.sums.next_epoch()
            state.next_epoch()
            state.last_row = row
            run.log.record(row, state.step)
            run.log.info(" ".join(f"{key} {value:.4g}" for key, value in row.items()))
        run.save(epoch_end=plan.epoch_done, last=state.epoch == settings.epochs, stopping=reason is not None)
        if reason:
            return run.stop(reason, {"steps": state.step, **state.last_row})
    path = run.finish({"steps": state.step, **state.last_row})
    run.log.info(f"val_mse {state.last_row['val_mse']:.4g}; results in {path}")


def autocast(name, device):
    """The forward pass in precision ``name`` (fp32: as it is)."""
    dtype = precision.DTYPES[name]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


@torch.no_grad()
def validate(model, loader, precision_name, device):
    model.eval()
    meter = SumMeter("val_mse")
    for signals_batch, frequencies in loader:
        signals_batch, frequencies = signals_batch.to(device), frequencies.to(device)
        with autocast(precision_name, device):
            predicted = model(signals_batch)
        meter.add("val_mse", torch.nn.functional.mse_loss(predicted.float(), frequencies, reduction="sum"),
                  len(frequencies))
    model.train()
    return meter.reduce("val")


if __name__ == "__main__":
    cli.run_main(main)
