#!/usr/bin/env python
"""Data-parallel image classification with Horovod: ResNets on digits, CIFAR-10,
an image folder (ImageNet layout) or synthetic data.

    horovodrun -np 2 python scripts/train_cnn.py                     # digits, resnet20
    horovodrun -np 8 -H a:4,b:4 python scripts/train_cnn.py --dataset imagefolder \\
        --data /data/imagenet --model resnet50 --epochs 90 --warmup-epochs 5 --lr 0.0125

Every rank trains on its own shard of each epoch; Horovod averages the gradients,
so N workers with batch b train like one worker with batch N*b. Checkpoints hold
everything needed to continue at the exact next batch (see --resume).
"""
import argparse
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
import horovod.torch as hvd

from hvdtrain import checkpoint, cli, dist, images, optim, signals
from hvdtrain.cli import UsageError
from hvdtrain.metrics import SumMeter, Throughput, topk_correct, total_throughput
from hvdtrain.models import resnet
from hvdtrain.runlog import RunLog
from hvdtrain.sampling import ShardedSampler, UnpaddedShardSampler
from hvdtrain.signals import StopRequest

# A signal is acted on within this many steps (an allreduce each time: on a busy
# 2-core machine checking every step cost a quarter of the step time).
SIGNAL_CHECK_STEPS = 10

def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    flag = argparse.BooleanOptionalAction
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", default="digits",
                      choices=["digits", "cifar10", "imagefolder", "synthetic"],
                      help="digits: scikit-learn's embedded 8x8 digits (no download); cifar10: "
                           "the python batches directory; imagefolder: train/<class>/*, val/<class>/*")
    data.add_argument("--data", help="data directory (cifar10, imagefolder)")
    data.add_argument("--image-size", type=cli.positive_int,
                      help="input resolution; unset (%(default)s): digits 16, cifar10/synthetic 32, imagefolder 224")
    data.add_argument("--workers", type=cli.non_negative_int,
                      help="DataLoader processes per rank; unset (%(default)s): 4 for imagefolder, else 0")
    data.add_argument("--verify-images", action=flag, default=True,
                      help="decode every image file before training (each rank checks its share)")
    data.add_argument("--synthetic-samples", type=cli.positive_int, default=4096, help="synthetic epoch size")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="resnet20", choices=sorted(resnet.MODELS),
                       help="resnet20/56: CIFAR-style; resnet18/50: ImageNet-style; convnet: no BatchNorm")
    model.add_argument("--sync-bn", action="store_true",
                       help="Horovod SyncBatchNorm: statistics over the global batch (CUDA only)")
    train = parser.add_argument_group("optimisation (defaults suit the digits data set)")
    train.add_argument("--epochs", type=cli.positive_int, default=8, help="length of the LR schedule")
    train.add_argument("--max-steps", type=cli.positive_int,
                       help="stop with a checkpoint after this many steps; the LR schedule still spans --epochs")
    train.add_argument("--batch-size", type=cli.positive_int, default=16, help="per worker and backward pass")
    train.add_argument("--lr", type=cli.positive_float, default=0.1,
                       help="base LR per worker batch; used LR = lr x workers x batches-per-allreduce")
    train.add_argument("--warmup-epochs", type=float, default=1.0, help="linear warmup (Goyal et al. 2017)")
    train.add_argument("--lr-decay", default="cosine", choices=["cosine", "step"], help="after the warmup")
    train.add_argument("--lr-milestones", type=float, nargs="+", default=[30, 60, 80],
                       help="epochs at which --lr-decay step multiplies the LR by --lr-gamma")
    train.add_argument("--lr-gamma", type=float, default=0.1, help="step decay factor")
    train.add_argument("--momentum", type=cli.fraction, default=0.9, help="SGD momentum")
    train.add_argument("--nesterov", action=flag, default=True, help="Nesterov momentum")
    train.add_argument("--weight-decay", type=float, default=5e-4, help="not on BatchNorm and bias parameters")
    train.add_argument("--label-smoothing", type=cli.fraction, default=0.0, help="of the training loss")
    horovod = parser.add_argument_group("Horovod")
    horovod.add_argument("--batches-per-allreduce", type=cli.positive_int, default=1,
                         help="backward passes (of --batch-size each) accumulated locally per allreduce")
    horovod.add_argument("--fp16-allreduce", action="store_true", help="send gradients as fp16")
    horovod.add_argument("--use-adasum", action="store_true",
                         help="combine updates with Adasum instead of averaging gradients (needs MPI)")
    horovod.add_argument("--gradient-predivide-factor", type=cli.positive_float, default=1.0,
                         help="divide gradients by this before the sum and by size/factor after")
    device = parser.add_argument_group("device")
    device.add_argument("--cpu", action="store_true", help="ignore GPUs")
    device.add_argument("--amp", action=flag, help="mixed precision; unset (%(default)s): on with CUDA")
    device.add_argument("--channels-last", action=flag, help="NHWC layout; unset (%(default)s): on with CUDA")
    device.add_argument("--threads", type=cli.positive_int,
                        help="CPU threads per rank; unset (%(default)s): cores / ranks on the node")
    out = parser.add_argument_group("output and checkpoints")
    out.add_argument("--output-dir", default="runs/cnn", help="checkpoints, metrics.jsonl, results.json")
    out.add_argument("--resume", action=flag, default=True,
                     help="continue from the newest checkpoint in --output-dir; --no-resume starts over "
                          "and deletes that directory's earlier checkpoints and metrics")
    out.add_argument("--checkpoint-every", type=cli.non_negative_int, default=0,
                     help="also checkpoint every N steps (0: at epoch ends only)")
    out.add_argument("--keep-checkpoints", type=cli.positive_int, default=3,
                     help="newest checkpoints kept (plus best.pt)")
    out.add_argument("--seed", type=int, default=42, help="initialisation, data order, augmentation")
    return parser.parse_args(argv)


def check_args(args, ctx):
    """Flag combinations that cannot work; the same verdict on every rank."""
    if args.use_adasum and args.gradient_predivide_factor != 1.0:
        raise UsageError("--gradient-predivide-factor only applies to averaging, not --use-adasum")
    if args.dataset in ("digits", "synthetic") and args.data:
        raise UsageError(f"--data is not used with --dataset {args.dataset}")
    cuda = ctx.device.type == "cuda"
    if args.amp and not cuda:
        raise UsageError("--amp needs a CUDA device (none is in use)")
    if args.use_adasum and not hvd.mpi_enabled():
        raise UsageError("--use-adasum needs MPI: launch with mpirun or horovodrun --mpi, not --gloo")
    if args.amp and args.use_adasum:
        raise UsageError("--use-adasum does not support --amp (GradScaler must see averaged gradients)")
    if args.sync_bn and not cuda:
        raise UsageError("--sync-bn needs CUDA: Horovod's SyncBatchNorm only runs on GPUs")
    args.amp = cuda if args.amp is None else args.amp
    args.channels_last = cuda if args.channels_last is None else args.channels_last
    if args.workers is None:
        args.workers = 4 if args.dataset == "imagefolder" else 0  # others are in memory


def load_data(args, ctx):
    """(train set, val set, classes, channels); run under agree_on_errors."""
    data = images.load(args.dataset, args.data, args.image_size, args.seed, args.synthetic_samples,
                       verify_share=(ctx.rank, ctx.size) if args.verify_images else None,
                       on_file=ctx.watchdog.beat)
    train_set = data[0]
    shard = len(train_set) // ctx.size
    if shard == 0:
        raise UsageError(f"more workers than training samples: {ctx.size} workers, "
                         f"{len(train_set)} samples")
    if shard < args.batch_size * args.batches_per_allreduce:
        raise UsageError(f"not enough training samples: {len(train_set)} samples over {ctx.size} workers "
                         f"leave {shard} per worker, fewer than one batch of "
                         f"{args.batch_size * args.batches_per_allreduce}")
    if args.workers > shard:
        raise UsageError(f"--workers {args.workers}: more DataLoader workers than the {shard} "
                         f"training samples each rank loads")
    return data


@dataclass
class Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object
    criterion: nn.Module
    device: torch.device
    amp: bool
    channels_last: bool
    passes: int  # backward passes per optimizer step
    adasum: bool
    last_lr: float = 0.0  # the LR of the latest step

    def to_device(self, images_batch, targets):
        layout = torch.channels_last if self.channels_last else torch.preserve_format
        return (images_batch.to(self.device, non_blocking=True, memory_format=layout),
                targets.to(self.device, non_blocking=True))

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp)

    def train_step(self, images_batch, targets, meter):
        images_batch, targets = self.to_device(images_batch, targets)
        for x, y in zip(images_batch.chunk(self.passes), targets.chunk(self.passes)):
            with self.autocast():
                logits = self.model(x)
                loss = self.criterion(logits, y)
            # Horovod: gradients of `passes` backward calls add up locally, then
            # one allreduce averages them; dividing keeps the loss a mean.
            self.scaler.scale(loss / self.passes).backward()
            meter.add("train_loss", loss.detach().float() * len(y), len(y))
            meter.add("train_top1", topk_correct(logits, y, (1,))[0], len(y))
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        if self.adasum:
            # Horovod: Adasum already stepped locally during backward; step()
            # combines the ranks' weight deltas.
            self.optimizer.step()
        else:
            # Horovod: finish the gradient allreduce, unscale the averaged gradients,
            # then step without synchronising a second time (GradScaler pattern).
            self.optimizer.synchronize()
            self.scaler.unscale_(self.optimizer)
            with self.optimizer.skip_synchronize():
                self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad()  # set_to_none, the torch 2 default
        self.scheduler.step()

    @torch.no_grad()
    def evaluate(self, loader, beat):
        """Loss, top-1, top-5 over every validation sample exactly once."""
        self.model.eval()
        meter = SumMeter("val_loss", "val_top1", "val_top5")
        for images_batch, targets in loader:
            images_batch, targets = self.to_device(images_batch, targets)
            with self.autocast():
                logits = self.model(images_batch)
            top1, top5 = topk_correct(logits, targets, (1, 5))
            meter.add("val_loss", F.cross_entropy(logits.float(), targets, reduction="sum"), len(targets))
            meter.add("val_top1", top1, len(targets))
            meter.add("val_top5", top5, len(targets))
            beat()  # a long validation is progress too, for the stall watchdog
        self.model.train()
        return meter.reduce("val")


def build_trainer(args, ctx, num_classes, channels, steps_per_epoch):
    model = resnet.build(args.model, num_classes, channels)
    if args.sync_bn:
        model = dist.to_sync_batchnorm(model)  # Horovod: statistics over the global batch
    layout = torch.channels_last if args.channels_last else torch.preserve_format
    model = model.to(ctx.device, memory_format=layout)
    passes = args.batches_per_allreduce
    # Horovod: the global batch grows with the workers, so does the LR (Goyal et al.).
    # Adasum adapts to the gradients itself; as in Horovod's ImageNet example it
    # scales by the local GPUs only, where NCCL sums them before Adasum runs.
    if not args.use_adasum:
        lr_scale = ctx.size * passes
    else:
        lr_scale = passes * ctx.local_size if ctx.device.type == "cuda" and hvd.nccl_built() else 1
    args.scaled_lr = args.lr * lr_scale
    optimizer = torch.optim.SGD(optim.decay_groups(model, args.weight_decay), lr=args.scaled_lr,
                                momentum=args.momentum, nesterov=args.nesterov and args.momentum > 0)
    # Horovod: allreduce gradients during backward, every `passes` backward calls.
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=passes, op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)
    scheduler = optim.warmup_then_decay(
        optimizer, round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch,
        decay=args.lr_decay, milestones=[round(m * steps_per_epoch) for m in args.lr_milestones],
        gamma=args.lr_gamma)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.amp)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    return Trainer(model, optimizer, scheduler, scaler, criterion, ctx.device, args.amp,
                   args.channels_last, passes, args.use_adasum)


@dataclass
class Progress:
    """Where training stands; part of every checkpoint."""
    epoch: int = 0  # the epoch in progress
    batch: int = 0  # batches of it already trained
    step: int = 0  # optimizer steps in all
    best_top1: float = 0.0
    last_row: dict = field(default_factory=dict)  # the latest metrics.jsonl row


def restore(args, ctx, trainer):
    """Progress from the newest checkpoint in --output-dir, or a fresh start."""
    output = Path(args.output_dir)
    if not args.resume and ctx.is_main:
        checkpoint.clear_run_outputs(output)
    state = checkpoint.restore_on_all_ranks(ctx, output, enabled=args.resume)
    progress = Progress()
    if state is not None:
        saved = state["args"]
        for key in ("model", "dataset", "batch_size", "batches_per_allreduce", "world_size"):
            if saved[key] != vars(args)[key]:
                raise UsageError(f"cannot resume from {output}: it was written with {key}={saved[key]}, "
                                 f"not {vars(args)[key]} (use the same setting or --no-resume)",
                                 on_every_rank=True)
        checkpoint.load_training_state(ctx, state, trainer.model, trainer.optimizer,
                                       trainer.scheduler, trainer.scaler)
        progress = Progress(**{f.name: state[f.name] for f in fields(Progress)})
    # Horovod: every rank starts from rank 0's weights, buffers and optimizer state.
    # (Sent as a state dict: hvd.broadcast_optimizer_state would take a zero-gradient
    # step first, and weight decay would move the weights.)
    hvd.broadcast_parameters(trainer.model.state_dict(), root_rank=0)
    optim.broadcast_optimizer_state(trainer.optimizer, root_rank=0)
    return progress


def save_checkpoint(args, ctx, trainer, progress, is_best=False):
    """Collective (every rank's RNG state is gathered); rank 0 writes."""
    state = checkpoint.training_state(trainer.model, trainer.optimizer, trainer.scheduler,
                                      trainer.scaler, args=vars(args), **asdict(progress))
    if ctx.is_main:
        checkpoint.save(state, args.output_dir, progress.step, args.keep_checkpoints, is_best)


def train_epoch(args, ctx, trainer, train_data, progress, total_steps, stop_request, log, timer):
    """Train the rest of ``progress.epoch``; returns (why it stopped early or None, meter)."""
    train_set, sampler, loader = train_data
    train_set.set_epoch(progress.epoch)  # the augmentation key; workers copy it at iter()
    sampler.set_epoch(progress.epoch, progress.batch)
    meter = SumMeter("train_loss", "train_top1")
    for images_batch, targets in loader:
        trainer.train_step(images_batch, targets, meter)
        ctx.watchdog.beat()  # progress: the stall watchdog must not fire
        progress.step, progress.batch = progress.step + 1, progress.batch + 1
        timer.step(len(targets))
        log.progress(progress.step)
        if progress.step >= total_steps:
            return "max-steps", meter
        # Collective, so every few steps only: all ranks stop after the same step.
        if progress.step % SIGNAL_CHECK_STEPS == 0 and stop_request.should_stop():
            # Horovod: name the signal and the rank that got it, whichever rank that was.
            received = hvd.allgather_object(stop_request.received, name="stop_signal")
            rank = next(r for r, name in enumerate(received) if name)
            return f"{received[rank]} (rank {rank})", meter
        if (args.checkpoint_every and progress.step % args.checkpoint_every == 0
                and progress.batch < sampler.batches_per_epoch):
            save_checkpoint(args, ctx, trainer, progress)
    return None, meter


def make_loader(dataset, sampler, batch_size, workers, pin_memory):
    extra = {}
    if workers > 0:
        # Horovod: forkserver workers that leave SIGTERM/SIGUSR1 to the rank.
        extra = signals.worker_loader_options()
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=pin_memory, drop_last=False, **extra)


def main():
    args = parse_args()
    dist.exit_quietly_on_interrupt()
    stop_request = StopRequest()
    ctx = dist.init(use_cuda=not args.cpu, threads=args.threads)  # Horovod: hvd.init() and device
    dist.agree_on_errors(check_args, args, ctx)
    args.world_size = ctx.size
    dist.seed_everything(args.seed)
    train_set, val_set, num_classes, channels = dist.agree_on_errors(load_data, args, ctx)

    step_batch = args.batch_size * args.batches_per_allreduce
    sampler = ShardedSampler(len(train_set), ctx.rank, ctx.size, step_batch, args.seed)
    steps_per_epoch = sampler.batches_per_epoch
    cuda = ctx.device.type == "cuda"
    train_loader = make_loader(train_set, sampler, step_batch, args.workers, cuda)
    val_loader = make_loader(val_set, UnpaddedShardSampler(len(val_set), ctx.rank, ctx.size),
                             2 * args.batch_size, args.workers, cuda)
    trainer = build_trainer(args, ctx, num_classes, channels, steps_per_epoch)
    progress = restore(args, ctx, trainer)
    total_steps = min(args.max_steps or 10**18, args.epochs * steps_per_epoch)

    log = RunLog(ctx, args.output_dir, total_steps)
    log.info(f"{args.model} on {args.dataset}: {len(train_set)} train / {len(val_set)} val images, "
             f"{num_classes} classes; {ctx.size} worker{'s' if ctx.size > 1 else ''} x batch "
             f"{step_batch} = global batch {ctx.size * step_batch}; lr {args.scaled_lr:g}; "
             f"{steps_per_epoch} steps/epoch; device {ctx.device.type}, amp {'on' if args.amp else 'off'}"
             + (f"; resuming at epoch {progress.epoch} batch {progress.batch} (step {progress.step})"
                if progress.step else ""))
    started = time.perf_counter()
    timed = [0, 0.0]  # images and seconds this rank timed, over all epochs of this launch
    while progress.epoch < args.epochs and progress.step < total_steps:
        timer = Throughput(warmup_steps=1 if timed[1] else 5)  # first steps: allocation, negotiation
        epoch_start = time.perf_counter()
        stop, meter = train_epoch(args, ctx, trainer, (train_set, sampler, train_loader), progress,
                                  total_steps, stop_request, log, timer)
        rate = timer.per_second()
        if rate:
            timed[0] += timer.samples
            timed[1] += timer.samples / rate
        total_rate, per_worker = total_throughput(rate)
        if stop not in (None, "max-steps"):
            save_checkpoint(args, ctx, trainer, progress)
            log.info(f"stopped by {stop} at step {progress.step}: checkpoint written to "
                     f"{args.output_dir}; relaunch the same command to continue")
            log.close()
            return
        row = {"epoch": round(progress.epoch + progress.batch / steps_per_epoch, 4),
               "step": progress.step, "lr": trainer.last_lr, **meter.reduce("train"),
               **trainer.evaluate(val_loader, ctx.watchdog.beat), "images_per_sec": total_rate,
               "images_per_sec_per_worker": per_worker, "epoch_seconds": time.perf_counter() - epoch_start}
        if progress.batch == steps_per_epoch:
            row["epoch"] = progress.epoch = progress.epoch + 1
            progress.batch = 0
        is_best = row["val_top1"] > progress.best_top1
        progress.best_top1, progress.last_row = max(progress.best_top1, row["val_top1"]), row
        save_checkpoint(args, ctx, trainer, progress, is_best)
        log.record(row, progress.step)
        log.info(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    write_results(args, ctx, trainer, progress, val_loader, log, timed, time.perf_counter() - started)
    log.close()


def write_results(args, ctx, trainer, progress, val_loader, log, timed, seconds):
    row = progress.last_row
    if not row:  # resumed past --max-steps from a mid-epoch checkpoint: measure the model
        row = {"epoch": progress.epoch, **trainer.evaluate(val_loader, ctx.watchdog.beat)}
    total_rate, per_worker = total_throughput(timed[0] / timed[1] if timed[1] else None)
    if not total_rate:  # nothing timed in this launch: the figures of the last epoch trained
        total_rate = row.get("images_per_sec", 0.0)
        per_worker = row.get("images_per_sec_per_worker", 0.0)
    step_batch = args.batch_size * args.batches_per_allreduce
    results = {key: row.get(key) for key in ("val_top1", "val_top5", "val_loss", "train_loss", "train_top1")}
    results.update(images_per_sec=total_rate, images_per_sec_per_worker=per_worker, world_size=ctx.size,
                   epochs=row["epoch"], steps=progress.step, model=args.model, dataset=args.dataset,
                   batch_size=args.batch_size, global_batch_size=ctx.size * step_batch, lr=args.scaled_lr,
                   best_val_top1=progress.best_top1, seconds=seconds)
    path = log.results(results)
    log.info(f"val_top1 {results['val_top1']:.4f} val_top5 {results['val_top5']:.4f} "
             f"{total_rate:.1f} images/s ({per_worker:.1f} per worker); results in {path}")


if __name__ == "__main__":
    cli.run_main(main)
