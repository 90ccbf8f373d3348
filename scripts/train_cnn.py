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
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
import horovod.torch as hvd

from hvdtrain.training import batchnorm, optim
from hvdtrain import cli
from hvdtrain.runtime import consistency, dist, elastic, signals
from hvdtrain.data import images
from hvdtrain.runtime import run as run_skeleton
from hvdtrain.errors import UsageError
from hvdtrain.runtime.metrics import SumMeter, averages, rate_text, topk_correct, total_throughput
from hvdtrain.models import resnet
from hvdtrain.runtime.run import Run, TrainState
from hvdtrain.data.sampling import ElasticBatchSampler, ShardedSampler, UnpaddedShardSampler
from hvdtrain.runtime.settings import Settings
from hvdtrain.runtime.signals import StopRequest

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
                      help="input resolution (default: digits 16, cifar10/synthetic 32, imagefolder 224)")
    data.add_argument("--workers", type=cli.non_negative_int,
                      help="DataLoader processes per rank (default: 4 for imagefolder, else 0)")
    data.add_argument("--verify-images", action=flag, default=True,
                      help="decode every image file before training (each rank checks its share)")
    data.add_argument("--synthetic-samples", type=cli.positive_int, default=4096, help="synthetic epoch size")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="resnet20", choices=sorted(resnet.MODELS),
                       help="resnet20/56: CIFAR-style; resnet18/50: ImageNet-style; convnet: no BatchNorm")
    model.add_argument("--sync-bn", action="store_true",
                       help="Horovod SyncBatchNorm: statistics over the global batch (CUDA only); without it "
                            "the ranks' BatchNorm statistics are averaged before evaluation and checkpoints")
    train = parser.add_argument_group("optimisation (defaults suit the digits data set)")
    train.add_argument("--epochs", type=cli.positive_int, default=8, help="length of the LR schedule")
    train.add_argument("--batch-size", type=cli.positive_int, default=16, help="per worker and backward pass")
    train.add_argument("--lr", type=cli.positive_float, default=0.1,
                       help="base LR per worker batch; used LR = lr x workers x accumulation steps")
    train.add_argument("--warmup-epochs", type=float, default=1.0, help="linear warmup (Goyal et al. 2017)")
    train.add_argument("--lr-decay", default="cosine", choices=["cosine", "step"], help="after the warmup")
    train.add_argument("--lr-milestones", type=float, nargs="+", default=[30, 60, 80],
                       help="epochs at which --lr-decay step multiplies the LR by --lr-gamma")
    train.add_argument("--lr-gamma", type=float, default=0.1, help="step decay factor")
    train.add_argument("--momentum", type=cli.fraction, default=0.9, help="SGD momentum")
    train.add_argument("--nesterov", action=flag, default=True, help="Nesterov momentum")
    train.add_argument("--weight-decay", type=float, default=5e-4, help="not on BatchNorm and bias parameters")
    train.add_argument("--label-smoothing", type=cli.fraction, default=0.0, help="of the training loss")
    horovod = run_skeleton.add_run_arguments(parser, output_dir="runs/cnn", checkpoint_every=0)
    horovod.add_argument("--use-adasum", action="store_true",
                         help="combine updates with Adasum instead of averaging gradients (needs MPI)")
    horovod.add_argument("--gradient-predivide-factor", type=cli.positive_float, default=1.0,
                         help="divide gradients by this before the sum and by size/factor after")
    horovod.add_argument("--amp", action=flag, help="mixed precision (default: on with CUDA)")
    horovod.add_argument("--channels-last", action=flag, help="NHWC layout (default: on with CUDA)")
    elastic.add_elastic_arguments(horovod, commit_every=20)
    return parser.parse_args(argv)


def check_args(args, ctx):
    """Flag combinations that cannot work, and the defaults that depend on the device.

    Returns the resolved values; the same verdict on every rank.
    """
    elastic.check_launcher(args.elastic)
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
    return {"amp": cuda if args.amp is None else args.amp,
            "channels_last": cuda if args.channels_last is None else args.channels_last,
            "workers": (4 if args.dataset == "imagefolder" else 0) if args.workers is None else args.workers}


def load_data(args, ctx):
    """(train set, val set, classes, channels); run under agree_on_errors."""
    with ctx.watchdog.phase("scanning and verifying the images"):
        data = images.load(args.dataset, args.data, args.image_size, args.seed, args.synthetic_samples,
                           verify_share=(ctx.rank, ctx.size) if args.verify_images else None,
                           on_file=ctx.watchdog.beat)
    train_set = data[0]
    shard = len(train_set) // ctx.size
    if shard == 0:
        raise UsageError(f"more workers than training samples: {ctx.size} workers, "
                         f"{len(train_set)} samples")
    if shard < args.batch_size * args.accumulation_steps:
        raise UsageError(f"not enough training samples: {len(train_set)} samples over {ctx.size} workers "
                         f"leave {shard} per worker, fewer than one batch of "
                         f"{args.batch_size * args.accumulation_steps}")
    if args.workers > shard:
        raise UsageError(f"--workers {args.workers}: more DataLoader workers than the {shard} "
                         f"training samples each rank loads")
    return data


def data_facts(args, train_set, val_set):
    """What every rank's data must share beyond the settings' train_samples and num_classes."""
    facts = {"val_samples": len(val_set)}
    if isinstance(train_set, images.ImageFolder):  # its files, relative to --data (a per-node path)
        facts["image_files_sha256"] = consistency.digest(
            f"{os.path.relpath(path, args.data)} {label}" for path, label in train_set.samples + val_set.samples)
    return facts


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

    def train_step(self, images_batch, targets, meter, guard=None):
        """One optimizer step; ``guard``: a nonfinite.NonFiniteGuard (skips or stops on NaN/Inf)."""
        images_batch, targets = self.to_device(images_batch, targets)
        before = meter.state_dict()  # a skipped step adds nothing to the metrics
        # tensor_split: always `passes` pieces, also of an --elastic step's uneven batch.
        for x, y in zip(images_batch.tensor_split(self.passes), targets.tensor_split(self.passes)):
            with self.autocast():
                logits = self.model(x)
                loss = self.criterion(logits, y)
            if guard is not None:
                loss = guard.watch(loss)
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
            self.optimizer.zero_grad()
            if guard is not None:
                guard.skip_step(can_skip=False)  # too late to skip: a non-finite loss stops the run
        # Horovod: the allreduce finishes here; False: skipped on every rank (a NaN/Inf loss)
        elif not optim.finish_step(self.optimizer, self.scaler, guard=guard):
            meter.load_state_dict(before)
        self.scheduler.step()  # a skipped step moves the schedule on too, as GradScaler's do

    @torch.no_grad()
    def evaluate(self, loader):
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
        self.model.train()
        return meter.reduce("val")


def build_trainer(settings, ctx, num_classes, channels, steps_per_epoch):
    model = resnet.build(settings.model, num_classes, channels)
    if settings.sync_bn:
        model = dist.to_sync_batchnorm(model)  # Horovod: statistics over the global batch
    layout = torch.channels_last if settings.channels_last else torch.preserve_format
    model = model.to(ctx.device, memory_format=layout)
    optimizer = torch.optim.SGD(optim.decay_groups(model, settings.weight_decay), lr=settings.scaled_lr,
                                momentum=settings.momentum,
                                nesterov=settings.nesterov and settings.momentum > 0)
    # Horovod: allreduce gradients during backward, every `passes` backward calls.
    passes = settings.accumulation_steps
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if settings.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=passes, op=hvd.Adasum if settings.use_adasum else hvd.Average,
        gradient_predivide_factor=settings.gradient_predivide_factor)
    scheduler = optim.warmup_then_decay(
        optimizer, round(settings.warmup_epochs * steps_per_epoch), settings.epochs * steps_per_epoch,
        decay=settings.lr_decay, milestones=[round(m * steps_per_epoch) for m in settings.lr_milestones],
        gamma=settings.lr_gamma)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=settings.amp)
    criterion = nn.CrossEntropyLoss(label_smoothing=settings.label_smoothing)
    return Trainer(model, optimizer, scheduler, scaler, criterion, ctx.device, settings.amp,
                   settings.channels_last, passes, settings.use_adasum)


def used_lr(args, ctx):
    """Horovod: the global batch grows with the workers, so does the LR (Goyal et al.).

    Adasum adapts to the gradients itself; as in Horovod's ImageNet example it
    scales by the local GPUs only, where NCCL sums them before Adasum runs.
    """
    passes = args.accumulation_steps
    if not args.use_adasum:
        return args.lr * ctx.size * passes
    local = ctx.local_size if ctx.device.type == "cuda" and hvd.nccl_built() else 1
    return args.lr * passes * local


@dataclass
class CnnState(TrainState):
    best_top1: float = 0.0


@dataclass
class ElasticPosition:
    """--elastic: where the epoch stands in samples (valid at any world size) and its metric totals.

    A checkpoint component. The ranks' metric sums are folded in at every
    commit, so a lost worker takes none of the committed steps' counts with
    it: the epoch's row covers every sample once (``train_samples``).
    """
    samples: int = 0  # of the epoch's order, trained and committed
    totals: dict = field(default_factory=dict)  # name -> [sum, count] over every rank

    def state_dict(self):
        return asdict(self)

    def load_state_dict(self, state):
        self.samples, self.totals = state["samples"], {k: list(v) for k, v in state["totals"].items()}

    def fold(self, meter):
        """Add every rank's partial sums to the totals; collective."""
        for name, (total, count) in meter.reduce_totals("train").items():
            kept = self.totals.setdefault(name, [0.0, 0.0])
            kept[0], kept[1] = kept[0] + total, kept[1] + count
        meter.reset()

    def epoch_metrics(self, meter, world_size):
        self.fold(meter)
        return {**averages(self.totals), "train_samples": int(self.totals["train_top1"][1]),
                "world_size": world_size}

    def next_epoch(self):
        self.samples, self.totals = 0, {}


def train_epoch_elastic(run, trainer, train_data, meter, commits, position):
    """--elastic: train_epoch from the global sample position at the current world size, with commits."""
    settings, state = run.settings, run.state
    train_set, sampler, loader = train_data
    train_set.set_epoch(state.epoch)
    sampler.set_epoch(state.epoch, position.samples)
    peak_lr = used_lr(settings, run.ctx)  # for the current world size
    with run.ctx.watchdog.phase("starting the data loader"):
        batches = iter(loader)
    for (_, stop), (images_batch, targets) in zip(sampler.steps, batches):
        elastic.follow_schedule(trainer.scheduler, state.epoch * len(train_set) + position.samples, peak_lr)
        trainer.train_step(images_batch, targets, meter, run.nonfinite)
        position.samples = stop
        reason = run.step_done(len(targets))
        if reason:
            return reason
        # Commit first: once a checkpoint of this step is on disk, every rank holds its commit too.
        if commits.commit_due(state.step):
            commits.commit()  # HostsUpdatedInterrupt from here when hosts were added or removed
        if settings.checkpoint_every and state.step % settings.checkpoint_every == 0 and stop < len(train_set):
            position.fold(meter)
            run.checkpoint()
    return None


def train_epoch(run, trainer, train_data, meter):
    """Train the rest of the current epoch; returns why this launch must stop, or None."""
    settings, state = run.settings, run.state
    train_set, sampler, loader = train_data
    train_set.set_epoch(state.epoch)  # the augmentation key; workers copy it at iter()
    sampler.set_epoch(state.epoch, state.step_in_epoch)
    with run.ctx.watchdog.phase("starting the data loader"):  # worker processes import torch
        batches = iter(loader)
    for images_batch, targets in batches:
        trainer.train_step(images_batch, targets, meter, run.nonfinite)
        reason = run.step_done(len(targets))
        if reason:
            return reason
        if (settings.checkpoint_every and state.step % settings.checkpoint_every == 0
                and state.step_in_epoch < sampler.batches_per_epoch):
            run.checkpoint()
    return None


def end_epoch(run, trainer, val_loader, meter, position=None):
    """Evaluate, append the epoch's row, checkpoint (best.pt too when it is the best)."""
    state = run.state
    total_rate, per_worker = total_throughput(run.throughput.window_rate())
    batchnorm.average_statistics(trainer.model)  # what is evaluated is what is saved
    train_metrics = meter.reduce("train") if position is None else position.epoch_metrics(meter, run.ctx.size)
    with run.ctx.watchdog.phase("evaluating"):  # a long validation set is no hang
        evaluation = trainer.evaluate(val_loader)
    row = {"epoch": state.epoch + 1, "step": state.step, "lr": trainer.last_lr, **train_metrics,
           **evaluation, "images_per_sec": total_rate,
           "images_per_sec_per_worker": per_worker,
           "epoch_seconds": run.throughput.window_all[1]}
    meter.reset()
    state.next_epoch()
    if position is not None:
        position.next_epoch()
    is_best = row["val_top1"] > state.best_top1
    state.best_top1, state.last_row = max(state.best_top1, row["val_top1"]), row
    run.log.record(row, state.step)  # before the checkpoint: a crash in between repeats the row once
    run.checkpoint(is_best)
    run.log.info(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


def make_loader(dataset, sampler, batch_size, workers, pin_memory):
    extra = {}
    if workers > 0:
        # Horovod: forkserver workers that leave SIGTERM/SIGUSR1 to the rank.
        extra = signals.worker_loader_options()
    if batch_size is None:  # the sampler yields whole batches (ElasticBatchSampler)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory, **extra)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=pin_memory, drop_last=False, **extra)


def main():
    args = parse_args()
    dist.exit_quietly_on_interrupt()
    stop_request = StopRequest()
    dist.request_diagnostics(args.horovod_timeline, args.horovod_autotune, args.horovod_autotune_log)
    # Horovod: hvd.init() and device
    ctx = dist.init(use_cuda=not args.cpu, threads=args.threads, elastic=args.elastic)
    agree = lambda check, *a: elastic.agree_before_start(args.elastic, check, *a)  # noqa: E731
    vars(args).update(agree(check_args, args, ctx))
    dist.seed_everything(args.seed)
    train_set, val_set, num_classes, channels = agree(load_data, args, ctx)
    # --elastic: the size changes while the run goes on (and between relaunches); not compared on resume.
    settings = Settings({**vars(args), "world_size": "elastic" if args.elastic else ctx.size,
                         "scaled_lr": used_lr(args, ctx), "train_samples": len(train_set),
                         "num_classes": num_classes})
    if not settings.elastic:  # a worker joining an elastic job may make no collective before its sync
        consistency.check_ranks_agree(settings, data_facts(args, train_set, val_set))  # same job on every rank
    step_batch = settings.batch_size * settings.accumulation_steps
    steps_per_epoch = len(train_set) // (ctx.size * step_batch)
    # --elastic: the LR schedule counts samples, whose number per epoch no world size changes.
    trainer = build_trainer(settings, ctx, num_classes, channels,
                            len(train_set) if settings.elastic else steps_per_epoch)
    meter = SumMeter("train_loss", "train_top1")
    state = CnnState()
    components = {"model": trainer.model, "optimizer": trainer.optimizer, "scheduler": trainer.scheduler,
                  "scaler": trainer.scaler}
    position = ElasticPosition() if settings.elastic else None
    if position is not None:
        components["elastic_position"] = position
    run = Run(ctx, settings, state, components, meter, settings.epochs * steps_per_epoch, stop_request,
              per_rank={"batchnorm": batchnorm.OwnStatistics(trainer.model)},
              shared_view=lambda: batchnorm.averaged(trainer.model))
    if settings.elastic:
        commits = elastic.Commits(run, settings.elastic_commit_every, before_commit=lambda: position.fold(meter))
        return commits.run_elastic(lambda: train(run, trainer, (train_set, val_set), meter, commits, position))
    run.start()
    return train(run, trainer, (train_set, val_set), meter)


def make_loaders(settings, ctx, train_set, val_set):
    """(sampler, train loader, val loader) for this rank in the current world."""
    step_batch = settings.batch_size * settings.accumulation_steps
    if settings.elastic:
        sampler = ElasticBatchSampler(len(train_set), ctx.rank, ctx.size, step_batch, settings.seed,
                                      min_share=settings.accumulation_steps)
    else:
        sampler = ShardedSampler(len(train_set), ctx.rank, ctx.size, step_batch, settings.seed)
    cuda = ctx.device.type == "cuda"
    train_loader = make_loader(train_set, sampler, None if settings.elastic else step_batch, settings.workers, cuda)
    val_loader = make_loader(val_set, UnpaddedShardSampler(len(val_set), ctx.rank, ctx.size),
                             2 * settings.batch_size, settings.workers, cuda)
    return sampler, train_loader, val_loader


def train(run, trainer, datasets, meter, commits=None, position=None):
    """The epochs left, in the current world; --elastic enters again after every reset."""
    settings, state, ctx = run.settings, run.state, run.ctx
    if state.epoch >= settings.epochs:
        return run.already_finished()
    if run.stop_after_already_reached():
        return
    train_set, val_set = datasets
    sampler, train_loader, val_loader = make_loaders(settings, ctx, train_set, val_set)
    step_batch = settings.batch_size * settings.accumulation_steps
    if position is not None:  # the steps left at this world size
        left = (settings.epochs - state.epoch) * len(train_set) - position.samples
        run.log.retarget(state.step + left // (ctx.size * step_batch))
    where = (f"epoch {state.epoch} sample {position.samples}" if position else
             f"epoch {state.epoch} batch {state.step_in_epoch}")
    run.log.info(f"{settings.model} on {settings.dataset}: {len(train_set)} train / {len(val_set)} val images, "
                 f"{settings.num_classes} classes; {ctx.size} worker{'s' if ctx.size > 1 else ''} x batch "
                 f"{step_batch} = global batch {ctx.size * step_batch}; lr {used_lr(settings, ctx):g}; "
                 f"{len(train_set) // (ctx.size * step_batch)} steps/epoch; device {ctx.device.type}, "
                 f"amp {'on' if settings.amp else 'off'}"
                 + (f"; resuming at {where} (step {state.step})" if state.step else ""))
    started = time.perf_counter()
    while state.epoch < settings.epochs:
        run.throughput.start_window()
        if commits is None:
            reason = train_epoch(run, trainer, (train_set, sampler, train_loader), meter)
            finished_epoch = state.step_in_epoch == sampler.batches_per_epoch
        else:
            reason = train_epoch_elastic(run, trainer, (train_set, sampler, train_loader), meter, commits, position)
            sampler.set_epoch(state.epoch, position.samples)
            finished_epoch = len(sampler) == 0
            if reason:
                position.fold(meter)  # run.stop checkpoints: the totals, not per-rank sums
        if finished_epoch:
            end_epoch(run, trainer, val_loader, meter, position)
            if commits is not None:
                commits.commit()
        if reason:
            return run.stop(reason, results(run, time.perf_counter() - started), checkpoint=not finished_epoch)
    path = run.write_results({**results(run, time.perf_counter() - started), "completed": True})
    row = state.last_row
    run.log.info(f"val_top1 {row['val_top1']:.4f} val_top5 {row['val_top5']:.4f} "
                 f"{rate_text(run.rates()[0], 'images')}; results in {path}")
    run.log.close()


def results(run, seconds):
    """results.json: the saved model's latest metrics, this launch's throughput."""
    settings, state, row = run.settings, run.state, run.state.last_row
    total_rate, per_worker = run.rates()
    step_batch = settings.batch_size * settings.accumulation_steps
    summary = {key: row.get(key) for key in ("val_top1", "val_top5", "val_loss", "train_loss", "train_top1")}
    summary.update(images_per_sec=total_rate or row.get("images_per_sec", 0.0),
                   images_per_sec_per_worker=per_worker or row.get("images_per_sec_per_worker", 0.0),
                   world_size=run.ctx.size, epochs=row.get("epoch", 0), steps=state.step, model=settings.model,
                   dataset=settings.dataset, batch_size=settings.batch_size,
                   global_batch_size=run.ctx.size * step_batch, lr=settings.scaled_lr,
                   best_val_top1=state.best_top1, seconds=seconds)
    return summary


if __name__ == "__main__":
    cli.run_main(main)
