"""The CNN training step: a Trainer with ``forward_backward``, ``step`` and ``evaluate``.

The same shape as training/bert.py: a dataclass of the step's parts (model,
Horovod's DistributedOptimizer, scaler, the NaN/Inf guard, the section timer);
the loop calls ``forward_backward(batch, meter)`` then ``step()`` for one
optimizer step. scripts/train_cnn.py builds one; scripts/benchmark.py times the
same step under Horovod, DDP and alone. Also the script's argument checks, the
world's arithmetic (``batching``), data facts and results.json summary.
"""
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvdtrain import usercode
from hvdtrain.data import custom, images
from hvdtrain.durations import UNTIMED
from hvdtrain.errors import UsageError
from hvdtrain.models import resnet
from hvdtrain.runtime import consistency, dist, elastic, precision
from hvdtrain.runtime.metrics import SumMeter, topk_correct
from hvdtrain.runtime.run import TrainState
from hvdtrain.runtime.settings import RunSettings
from hvdtrain.training import optim
from hvdtrain.training.batching import Batching


@dataclass(frozen=True)
class CnnSettings(RunSettings):
    """train_cnn.py's settings: its flags, resolved (see runtime/settings.py)."""
    dataset: str
    data: Optional[str]
    dataset_arg: dict  # --dataset-arg: your own --dataset's keyword arguments
    image_size: Optional[int]
    workers: int  # resolved: 4 for imagefolder, else 0
    verify_images: bool
    synthetic_samples: int
    model: str
    model_arg: dict  # --model-arg: your own --model's keyword arguments
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
    train_samples: int
    num_classes: int
    balance: bool  # --balance: shares of the global batch follow the ranks' speed

    def resize_consequence(self, old_size):
        """Without --global-batch the LR follows the global batch (``batching``)."""
        if self.use_adasum:
            return ""
        old, new = (Batching.of(self, size, lr_scale=linear_scaling(self)).lr for size in (old_size, self.world_size))
        return f" and the LR from {old:g} to {new:g}"

    @classmethod
    def saved_as_now(cls, saved):
        """A checkpoint from before --precision: its ``amp`` on/off was fp16/fp32."""
        if "amp" in saved and "precision" not in saved:
            saved = {**saved, "precision": "fp16" if saved["amp"] else "fp32"}
            del saved["amp"]
        # from before --balance, --global-batch, --model-arg and --dataset-arg
        return {"balance": False, "global_batch": None, "model_arg": {}, "dataset_arg": {}, **saved}


def check_args(args, ctx):
    """Flag combinations that cannot work, and the defaults that depend on the device.

    Returns the resolved values; the same verdict on every rank.
    """
    if args.balance and (args.elastic or args.global_batch or args.use_adasum
                         or args.gradient_predivide_factor != 1.0 or not args.straggler_interval):
        raise UsageError("--balance needs the ranks' timings (--straggler-interval > 0) and plain averaging: "
                         "not with --elastic, --global-batch, --use-adasum or --gradient-predivide-factor")
    if args.global_batch and (args.use_adasum or args.gradient_predivide_factor != 1.0):
        raise UsageError("--global-batch sums the ranks' shares of each step: not with --use-adasum or "
                         "--gradient-predivide-factor")
    if args.global_batch and args.global_batch < ctx.size * args.accumulation_steps:
        raise UsageError(f"--global-batch {args.global_batch} leaves ranks of the {ctx.size} without a sample "
                         f"for each of {args.accumulation_steps} backward passes")
    elastic.check_launcher(args.elastic)
    if args.use_adasum and args.gradient_predivide_factor != 1.0:
        raise UsageError("--gradient-predivide-factor only applies to averaging, not --use-adasum")
    if args.dataset in ("digits", "synthetic") and args.data:
        raise UsageError(f"--data is not used with --dataset {args.dataset}")
    if usercode.is_spec(args.dataset) and args.image_size:
        raise UsageError(f"--image-size is for the named data sets: --dataset {args.dataset} sizes its own samples")
    cuda = ctx.device.type == "cuda"
    chosen = precision.resolve(args.precision, ctx.device.type, cuda_auto="fp16")  # fp16 needs CUDA
    if args.use_adasum and not dist.mpi_controller():
        raise UsageError("--use-adasum needs MPI: launch with mpirun or horovodrun --mpi, not --gloo")
    if chosen.scaler and args.use_adasum:
        raise UsageError("--use-adasum does not support fp16 (GradScaler must see averaged gradients)")
    if args.sync_bn and not cuda:
        raise UsageError("--sync-bn needs CUDA: Horovod's SyncBatchNorm only runs on GPUs")
    return {"precision": chosen.name,
            "channels_last": cuda if args.channels_last is None else args.channels_last,
            "workers": (4 if args.dataset == "imagefolder" else 0) if args.workers is None else args.workers}


def data_facts(args, train_set, val_set, model=None):
    """What every rank's data and model must share beyond the settings' train_samples and num_classes."""
    facts = {"val_samples": len(val_set)}
    if model is not None:  # its parameters' names, shapes and types: ranks that imported other code differ
        facts["model_sha256"] = consistency.digest(f"{name} {tuple(tensor.shape)} {tensor.dtype}"
                                                   for name, tensor in model.state_dict().items())
    if isinstance(train_set, images.ImageFolder):  # its files, relative to --data (a per-node path)
        facts["image_files_sha256"] = consistency.digest(
            f"{os.path.relpath(path, args.data)} {label}" for path, label in train_set.samples + val_set.samples)
    if isinstance(train_set, custom.KeyedSamples):  # your own: its first sample, as this rank reads it
        facts["first_sample_sha256"] = custom.fingerprint(train_set, args.dataset)
    return facts


def resume_note(settings, train_set):
    """Your own data set: None, or the one line saying exact resume does not hold for it (custom.probe)."""
    return custom.probe(train_set, settings.dataset) if isinstance(train_set, custom.KeyedSamples) else None


@dataclass
class CnnState(TrainState):
    """Where training stands (a checkpoint component), and the best validation top-1 so far."""
    best_top1: float = 0.0
    # The epoch's position: its samples trained (a prefix of its order, data/sampling.py), at
    # whatever world sizes; where a resumed epoch goes on (training/epochs.py).
    epoch_samples: int = 0

    def next_epoch(self):
        super().next_epoch()
        self.epoch_samples = 0


def upgrade_checkpoint(saved):
    """A checkpoint written by an earlier version, in today's layout (Checkpointer.restore's ``upgrade``).

    Until 2026-11, --elastic and --global-batch kept their position apart, "elastic_position"
    {samples, totals}: its samples are the train state's ``epoch_samples`` now (plain runs
    counted them there already), its metric totals "epoch_sums". Before ``epoch_samples``
    existed, an epoch's steps were all of the checkpoint's own size.
    """
    state = saved["train_state"]
    if "elastic_position" in saved:
        position = saved.pop("elastic_position")
        state["epoch_samples"] = position["samples"]
        saved["epoch_sums"] = {"totals": position["totals"]}
    saved.setdefault("epoch_sums", {"totals": {}})
    if state.get("epoch_samples") is None:
        settings = saved["settings"]
        state["epoch_samples"] = (state["step_in_epoch"] * settings["world_size"] * settings["batch_size"]
                                  * settings["accumulation_steps"])
    return saved


@dataclass
class Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer  # Horovod's DistributedOptimizer (or a plain one: DDP, one process)
    scheduler: object  # its LR is set before each step (training/epochs.py); it counts the steps
    scaler: object
    criterion: nn.Module
    device: torch.device
    precision: str  # fp32, bf16 or fp16: the autocast dtype (fp16 with the scaler on)
    channels_last: bool
    passes: int  # backward passes per optimizer step
    adasum: bool
    guard: object = None  # a nonfinite.NonFiniteGuard: a NaN/Inf loss skips (or stops) on every rank
    timer: object = UNTIMED  # a durations.SectionTimer: compute, comm, optimizer
    sum_over: Optional[int] = None  # --balance, --global-batch: the global batch; Horovod sums the gradients
    last_lr: float = 0.0  # the LR of the latest step

    @classmethod
    def of(cls, settings, model, optimizer, scheduler, criterion, device, **parts):
        """The trainer of a run's ``settings`` (precision and its scaler, layout, accumulation,
        Adasum); ``parts``: guard, timer, sum_over."""
        return cls(model, optimizer, scheduler, precision.scaler(settings.precision, device), criterion, device,
                   settings.precision, settings.channels_last, settings.accumulation_steps, settings.use_adasum,
                   **parts)

    def to_device(self, images_batch, targets):
        # NHWC is a layout of images (N, C, H, W) only: other inputs (signals, volumes) stay as they are.
        layout = torch.channels_last if self.channels_last and images_batch.dim() == 4 else torch.preserve_format
        images_batch = images_batch.to(self.device, non_blocking=True, memory_format=layout)
        if images_batch.dtype == torch.uint8:  # image files' pixels: normalised here, a batch at once
            images_batch = images.normalize_pixels(images_batch)
        return images_batch, targets.to(self.device, non_blocking=True)

    def autocast(self):
        dtype = precision.DTYPES[self.precision]
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def forward_backward(self, batch, meter):
        """A step's forward and backward passes on this rank's ``batch`` (images, targets): ``passes``
        of them, whose gradients add up; Horovod's allreduce starts during the last. Their loss and
        top-1 sums go into ``meter`` (taken back if the step is skipped). Returns the samples."""
        with self.timer.section("compute"):
            images_batch, targets = self.to_device(*batch)
            self._meter_before = (meter, meter.state_dict())  # a skipped step adds nothing to the metrics
            # tensor_split: always `passes` pieces, also of an --elastic step's uneven batch.
            for x, y in zip(images_batch.tensor_split(self.passes), targets.tensor_split(self.passes)):
                with self.autocast():
                    logits = self.model(x)
                    loss = self.criterion(logits, y)
                if self.guard is not None:
                    loss = self.guard.watch(loss)
                self.scaler.scale(loss * self.loss_scale(len(y))).backward()
                meter.add("train_loss", loss.detach().float() * len(y), len(y))
                meter.add("train_top1", topk_correct(logits, y, (1,))[0], len(y))
        return len(targets)

    def step(self):
        """The optimizer step after ``forward_backward``; False when it was skipped on every rank.

        Horovod: ``optimizer.synchronize()`` waits for the averaged gradients, then the ranks'
        NaN/Inf vote (one allreduce, NonFiniteGuard.skip_step) skips the step on every rank or
        none (optim.finish_step); Adasum steps during backward and combines the ranks' updates here.
        """
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        stepped = True
        if self.adasum:
            with self.timer.section("comm"):
                self.optimizer.step()
            self.optimizer.zero_grad()
            if self.guard is not None:
                self.guard.skip_step(can_skip=False)  # too late to skip: a non-finite loss stops the run
        elif not optim.finish_step(self.optimizer, self.scaler, guard=self.guard, timer=self.timer):
            meter, before = self._meter_before
            meter.load_state_dict(before)
            stepped = False
        self.scheduler.step()  # a skipped step moves the schedule on too, as GradScaler's do
        return stepped

    def loss_scale(self, samples):
        """Horovod: gradients of `passes` backward calls add up locally, then one allreduce
        averages them; dividing by `passes` keeps the loss a mean. --balance: ranks hold
        unequal shares, so each loss counts its samples out of the global batch and the
        allreduce sums: exactly the mean over the global batch."""
        return samples / self.sum_over if self.sum_over else 1 / self.passes

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


def build_model(settings, ctx, num_classes, channels, train_set):
    """The model on this rank's device, in the layout asked for: a preset (models/resnet.py), or your
    own (--model MODULE:CALLABLE: ``CALLABLE(num_classes, in_channels, **--model-arg)``, checked on two
    samples)."""
    if usercode.is_spec(settings.model):
        model = user_model(settings.model, num_classes, channels, train_set, settings.model_arg)
    else:
        model = resnet.build(settings.model, num_classes, channels)
    if settings.sync_bn:
        model = dist.to_sync_batchnorm(model)  # Horovod: statistics over the global batch
    layout = torch.channels_last if settings.channels_last else torch.preserve_format
    return model.to(ctx.device, memory_format=layout)


def with_arguments(spec, options):
    """``spec`` as the run's first line names it: with its --model-arg/--dataset-arg, e.g. "net.py:build(width=4)"."""
    return spec + (f"({', '.join(f'{key}={value!r}' for key, value in options.items())})" if options else "")


def user_model(spec, num_classes, channels, train_set, options=None):
    """``--model MODULE:CALLABLE``'s module, checked: a torch.nn.Module whose output for a batch of two of
    the data's samples is one score per class (UsageError, one line, otherwise): a tensor, or a
    ModelOutput, dict or tuple holding it (its ``logits``, its first item)."""
    build = usercode.load_callable(spec, "--model")
    model = usercode.call(spec, "--model", build, num_classes, channels, **(options or {}))
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec}: {build.__name__}(num_classes, in_channels) returned "
                         f"{type(model).__name__}, not a torch.nn.Module")
    train_set.set_epoch(0)
    batch = torch.stack([torch.as_tensor(train_set[index][0]) for index in range(min(2, len(train_set)))])
    if batch.dtype == torch.uint8:  # image files' pixels, as the trainer normalises them
        batch = images.normalize_pixels(batch)
    model.eval()
    try:
        with torch.no_grad():
            output = model(batch)
    except Exception as error:  # noqa: BLE001 - the user's module: whatever it raises, one line
        raise UsageError(f"--model {spec}: its forward pass on a batch of the data's shape {tuple(batch.shape)} "
                         f"raised {error.__class__.__name__}: {usercode.first_line(error)}") from None
    model.train()
    if not torch.is_tensor(output) and torch.is_tensor(scores(output)):
        # A Hugging Face model's ModelOutput (or a dict, or return_dict=False's tuple): the trainer
        # reads its logits. A forward hook, not a wrapper: the state dict keeps the model's own keys.
        model.register_forward_hook(lambda module, inputs, result: scores(result))
        output = scores(output)
    if not torch.is_tensor(output) or tuple(output.shape) != (len(batch), num_classes):
        shape = tuple(output.shape) if torch.is_tensor(output) else type(output).__name__
        raise UsageError(f"--model {spec}: its output for a batch of {len(batch)} is {shape}, not "
                         f"({len(batch)}, {num_classes}): one score for each of the data's {num_classes} classes")
    return model


def scores(output):
    """The class scores in a model's output: ``output["logits"]`` of a mapping (a Hugging Face
    ModelOutput is one), the first item of a tuple, else the output itself."""
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    if isinstance(output, tuple) and output:
        return output[0]
    return output


def build_optimizer(settings, model, lr):
    """SGD with momentum, no weight decay on biases and BatchNorm, at ``lr`` (Batching.lr)."""
    return torch.optim.SGD(optim.decay_groups(model, settings.weight_decay), lr=lr,
                           momentum=settings.momentum, nesterov=settings.nesterov and settings.momentum > 0)


def build_schedule(settings, optimizer, schedule_length):
    """Warmup, then cosine or step decay; ``schedule_length``: the schedule's units in an epoch
    (steps, or samples: training/epochs.py sets the LR from the samples trained)."""
    return optim.warmup_then_decay(
        optimizer, round(settings.warmup_epochs * schedule_length), settings.epochs * schedule_length,
        decay=settings.lr_decay, milestones=[round(m * schedule_length) for m in settings.lr_milestones],
        gamma=settings.lr_gamma)


def batching(settings, ctx):
    """This world's arithmetic (training/batching.py): the global batch, and the LR it trains at.

    Horovod: the global batch grows with the workers, so does the LR (Goyal et al.);
    --global-batch keeps both. Adasum adapts to the gradients itself; as in Horovod's
    ImageNet example it scales by the local GPUs only, where NCCL sums them before
    Adasum runs.
    """
    if not settings.use_adasum:
        return Batching.of(settings, ctx.size, lr_scale=linear_scaling(settings))
    local = ctx.local_size if ctx.device.type == "cuda" and dist.nccl_built() else 1
    return Batching.of(settings, ctx.size, lr_scale=lambda _: settings.accumulation_steps * local)


def linear_scaling(settings):
    """--lr is per --batch-size samples: the LR grows with the global batch."""
    return lambda global_batch: global_batch / settings.batch_size


def results(state, settings, batching, rates, seconds):
    """results.json: the saved model's latest metrics, this launch's throughput (``rates``: Throughput.launch_rates)."""
    row = state.last_row
    total_rate, per_worker = rates
    summary = {key: row.get(key) for key in ("val_top1", "val_top5", "val_loss", "train_loss", "train_top1")}
    summary.update(images_per_sec=total_rate or row.get("images_per_sec", 0.0),
                   images_per_sec_per_worker=per_worker or row.get("images_per_sec_per_worker", 0.0),
                   world_size=batching.size, epochs=row.get("epoch", 0), steps=state.step, model=settings.model,
                   dataset=settings.dataset, batch_size=settings.batch_size,
                   global_batch_size=batching.global_batch, lr=batching.lr,
                   best_val_top1=state.best_top1, seconds=seconds)
    return summary
