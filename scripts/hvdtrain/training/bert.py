"""The BERT pretraining step: a Trainer with ``train_step``, the shape of training/cnn.py.

``train_step(batch, meter, guard)`` runs one optimizer update over ``batch``,
the update's micro-batches (--accumulation-steps of them), and returns the
sequences trained; scripts/pretrain_bert.py builds one with ``build``, and
scripts/benchmark.py times the same step under Horovod, DDP and alone.
"""
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from hvdtrain.models import bert as bert_models
from hvdtrain.runtime.run import TrainState
from hvdtrain.runtime.settings import RunSettings
from hvdtrain.runtime.stragglers import UNTIMED
from hvdtrain.training import optim


@dataclass(frozen=True)
class BertSettings(RunSettings):
    """pretrain_bert.py's settings: its flags, resolved (see runtime/settings.py)."""
    data: str
    max_seq_length: int  # resolved: the shards'
    no_binning: bool
    mlm_probability: float
    model: Optional[str]  # a preset, or None with --config / the --init-checkpoint's configuration
    config: Optional[str]
    init_checkpoint: Optional[str]
    steps: int
    optimizer: str
    lamb_nvlamb: bool
    lr: float
    warmup_proportion: float
    poly_power: float
    weight_decay: float
    max_grad_norm: float
    precision: str  # resolved: fp32, bf16 or fp16
    compile: bool
    export_dir: str
    log_every: int
    architecture: dict
    vocab_sha256: str
    num_instances: int


@dataclass
class BertState(TrainState):
    """Where training stands (a checkpoint component), and the first logged MLM loss."""
    initial_mlm_loss: float = None


@dataclass
class Trainer:
    model: torch.nn.Module
    objective: torch.nn.Module  # batch -> bert_models.pretraining_sums (the model, maybe under DDP)
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object
    device: torch.device
    amp_dtype: object  # autocast dtype, or None for fp32
    passes: int  # micro-batches per optimizer update
    max_grad_norm: float
    last_lr: float = 0.0  # the LR of the latest step
    last_tokens: int = 0  # real (unpadded) tokens of the latest step

    def components(self):
        """What a checkpoint saves of the step's parts."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "scaler": self.scaler}

    def train_step(self, batch, meter, guard=None, timer=UNTIMED):
        """One optimizer update over the micro-batches in ``batch``; returns the sequences trained.

        ``guard``: a nonfinite.NonFiniteGuard (a NaN/Inf loss skips the update
        on every rank, or stops the run); ``timer``: a stragglers.SectionTimer
        (``batch`` is read lazily: waiting for it is "data").
        """
        sequences = tokens = 0
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        before = meter.state_dict()  # a skipped step adds nothing to the metrics
        for micro_batch in timer.timed(batch, "data"):
            with timer.section("compute"):
                sums = self.forward_backward(micro_batch, guard)
            meter.add("mlm_loss", sums["mlm_loss"], sums["mlm_count"])
            meter.add("mlm_accuracy", sums["mlm_correct"], sums["mlm_count"])
            meter.add("nsp_loss", sums["nsp_loss"], sums["nsp_count"])
            meter.add("nsp_accuracy", sums["nsp_correct"], sums["nsp_count"])
            sequences += sums["nsp_count"]
            tokens += int(micro_batch["attention_mask"].sum())
        # Horovod: the gradients are averaged here; False: skipped on every rank (a NaN/Inf loss)
        if not optim.finish_step(self.optimizer, self.scaler, self.max_grad_norm, self.model.parameters(),
                                 guard, timer):
            meter.load_state_dict(before)
        self.scheduler.step()  # a skipped step moves the schedule on too, as GradScaler's do
        self.last_tokens = tokens
        return sequences

    def forward_backward(self, micro_batch, guard):
        """One micro-batch's pretraining sums; its backward pass adds to the gradients."""
        micro_batch = {k: v.to(self.device, non_blocking=True) for k, v in micro_batch.items()}
        with torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext():
            sums = self.objective(micro_batch)
        loss = bert_models.training_loss(sums) / self.passes
        if guard is not None:
            loss = guard.watch(loss)
        self.scaler.scale(loss).backward()  # Horovod: the allreduce starts after the last micro-batch
        return sums


def build_model(settings, ctx, config):
    """(model on this rank's device, objective: batch -> pretraining sums, its encoder compiled on request)."""
    model = bert_models.build_model(config).to(ctx.device)
    encoder = torch.compile(model.bert) if settings.compile else model.bert
    return model, bert_models.PretrainingObjective(model, encoder)


def build_optimizer(settings, model):
    """LAMB (NVIDIA's recipe) or AdamW; no weight decay on biases and LayerNorm."""
    groups = optim.decay_groups(model, settings.weight_decay)
    if settings.optimizer == "lamb":
        return optim.LAMB(groups, lr=settings.lr, nvlamb=settings.lamb_nvlamb)
    return torch.optim.AdamW(groups, lr=settings.lr)


def build_schedule(settings, optimizer):
    """Linear warmup over --warmup-proportion of --steps, then polynomial decay."""
    warmup = round(settings.warmup_proportion * settings.steps)
    return optim.warmup_then_decay(optimizer, warmup, settings.steps, decay="poly", power=settings.poly_power)
