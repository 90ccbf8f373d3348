"""The CNN training step: a Trainer with ``train_step`` and ``evaluate``.

The same shape as training/bert.py: a dataclass of the parts (model, Horovod's
DistributedOptimizer, scheduler, scaler), ``train_step(batch, meter, guard)``
running one optimizer step and returning the samples it trained, and
``components()`` naming what a checkpoint holds. scripts/train_cnn.py builds
one; scripts/benchmark.py times the same step under Horovod, DDP and alone.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import horovod.torch as hvd

from hvdtrain.models import resnet
from hvdtrain.runtime import dist, precision
from hvdtrain.runtime.metrics import SumMeter, topk_correct
from hvdtrain.runtime.run import TrainState
from hvdtrain.runtime.settings import RunSettings
from hvdtrain.runtime.stragglers import UNTIMED
from hvdtrain.training import optim


@dataclass(frozen=True)
class CnnSettings(RunSettings):
    """train_cnn.py's settings: its flags, resolved (see runtime/settings.py)."""
    dataset: str
    data: Optional[str]
    image_size: Optional[int]
    workers: int  # resolved: 4 for imagefolder, else 0
    verify_images: bool
    synthetic_samples: int
    model: str
    sync_bn: bool
    epochs: int
    lr: float  # per worker batch
    warmup_epochs: float
    lr_decay: str
    lr_milestones: list
    lr_gamma: float
    momentum: float
    nesterov: bool
    weight_decay: float
    label_smoothing: float
    use_adasum: bool
    gradient_predivide_factor: float
    precision: str  # resolved: fp32, bf16 or fp16 (runtime/precision.py; auto: fp16 on CUDA)
    channels_last: bool  # resolved: on with CUDA
    scaled_lr: float  # the LR used: used_lr()
    train_samples: int
    num_classes: int

    @classmethod
    def saved_as_now(cls, saved):
        """A checkpoint from before --precision: its ``amp`` on/off was fp16/fp32."""
        if "amp" in saved and "precision" not in saved:
            saved = {**saved, "precision": "fp16" if saved["amp"] else "fp32"}
            del saved["amp"]
        return saved


@dataclass
class CnnState(TrainState):
    """Where training stands (a checkpoint component), and the best validation top-1 so far."""
    best_top1: float = 0.0


@dataclass
class Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object
    criterion: nn.Module
    device: torch.device
    precision: str  # fp32, bf16 or fp16: the autocast dtype (fp16 with the scaler on)
    channels_last: bool
    passes: int  # backward passes per optimizer step
    adasum: bool
    last_lr: float = 0.0  # the LR of the latest step

    def components(self):
        """What a checkpoint saves of the step's parts."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "scaler": self.scaler}

    def to_device(self, images_batch, targets):
        layout = torch.channels_last if self.channels_last else torch.preserve_format
        return (images_batch.to(self.device, non_blocking=True, memory_format=layout),
                targets.to(self.device, non_blocking=True))

    def autocast(self):
        dtype = precision.DTYPES[self.precision]
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def train_step(self, batch, meter, guard=None, timer=UNTIMED):
        """One optimizer step on ``batch`` = (images, targets); returns the samples trained.

        ``guard``: a nonfinite.NonFiniteGuard (skips or stops on NaN/Inf);
        ``timer``: a stragglers.SectionTimer (compute, comm, optimizer).
        """
        with timer.section("compute"):
            images_batch, targets = self.to_device(*batch)
            before = meter.state_dict()  # a skipped step adds nothing to the metrics
            self.forward_backward(images_batch, targets, meter, guard)
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        if self.adasum:
            # Horovod: Adasum already stepped locally during backward; step()
            # combines the ranks' weight deltas.
            with timer.section("comm"):
                self.optimizer.step()
            self.optimizer.zero_grad()
            if guard is not None:
                guard.skip_step(can_skip=False)  # too late to skip: a non-finite loss stops the run
        # Horovod: the allreduce finishes here; False: skipped on every rank (a NaN/Inf loss)
        elif not optim.finish_step(self.optimizer, self.scaler, guard=guard, timer=timer):
            meter.load_state_dict(before)
        self.scheduler.step()  # a skipped step moves the schedule on too, as GradScaler's do
        return len(targets)

    def forward_backward(self, images_batch, targets, meter, guard):
        """The backward passes of one step; Horovod's allreduce starts during the last."""
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


def build_model(settings, ctx, num_classes, channels):
    """The ResNet on this rank's device, in the layout asked for."""
    model = resnet.build(settings.model, num_classes, channels)
    if settings.sync_bn:
        model = dist.to_sync_batchnorm(model)  # Horovod: statistics over the global batch
    layout = torch.channels_last if settings.channels_last else torch.preserve_format
    return model.to(ctx.device, memory_format=layout)


def build_optimizer(settings, model):
    """SGD with momentum, no weight decay on biases and BatchNorm, at the used (scaled) LR."""
    return torch.optim.SGD(optim.decay_groups(model, settings.weight_decay), lr=settings.scaled_lr,
                           momentum=settings.momentum, nesterov=settings.nesterov and settings.momentum > 0)


def build_schedule(settings, optimizer, schedule_length):
    """Warmup, then cosine or step decay; ``schedule_length``: steps per epoch (samples under --elastic)."""
    return optim.warmup_then_decay(
        optimizer, round(settings.warmup_epochs * schedule_length), settings.epochs * schedule_length,
        decay=settings.lr_decay, milestones=[round(m * schedule_length) for m in settings.lr_milestones],
        gamma=settings.lr_gamma)


def used_lr(settings, ctx):
    """Horovod: the global batch grows with the workers, so does the LR (Goyal et al.).

    Adasum adapts to the gradients itself; as in Horovod's ImageNet example it
    scales by the local GPUs only, where NCCL sums them before Adasum runs.
    """
    passes = settings.accumulation_steps
    if not settings.use_adasum:
        return settings.lr * ctx.size * passes
    local = ctx.local_size if ctx.device.type == "cuda" and hvd.nccl_built() else 1
    return settings.lr * passes * local
