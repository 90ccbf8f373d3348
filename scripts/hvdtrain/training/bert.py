"""The BERT pretraining step: a Trainer with ``forward_backward`` and ``step``, the shape of training/cnn.py.

``forward_backward(micro_batches, meter)`` runs an optimizer update's micro-batches
(--accumulation-steps of them) and returns the sequences trained; ``step()``
applies the update. scripts/pretrain_bert.py builds one, and scripts/benchmark.py
times the same step under Horovod, DDP and alone. Also this rank's training data
in the current world, the metrics' rows and results.json's summary.
"""
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from hvdtrain.data import bert_data, bert_elastic
from hvdtrain.durations import UNTIMED
from hvdtrain.errors import UsageError
from hvdtrain.models import bert as bert_models
from hvdtrain.runtime.checkpoint_files import load_init_checkpoint
from hvdtrain.runtime.run import TrainState
from hvdtrain.runtime.settings import RunSettings
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
    balance: bool  # each step's instances split among the ranks by their measured speed

    @classmethod
    def saved_as_now(cls, saved):
        return {"global_batch": None, "balance": False, **saved}  # from before --global-batch, --balance

    def resize_refusal(self, train_state):
        """Mid-epoch without a global position: each rank read its own share of the epoch's shards,
        so what is left of the epoch is no prefix that another number of ranks could split."""
        if self.global_position or self.balance or not train_state["step_in_epoch"]:
            return None
        return (f"its epoch {train_state['epoch']} is in progress (step {train_state['step_in_epoch']} of it) "
                "and without --global-batch each rank reads its own share of the epoch's shards; relaunch on "
                "the checkpoint's number of ranks, at least until the epoch ends")


class Inputs(NamedTuple):
    """What train() reads besides the trainer: the prepared data's metadata (its shards), the model's
    configuration, the --init-checkpoint's weights (or None) and the epoch's global position (or None)."""
    metadata: dict
    config: object
    init: object
    position: object


@dataclass
class BertState(TrainState):
    """Where training stands (a checkpoint component), and the first logged MLM loss."""
    initial_mlm_loss: float = None


def upgrade_checkpoint(saved):
    """A checkpoint written by an earlier version, in today's layout (Checkpointer.restore's ``upgrade``):
    until 2026-11 the position of --elastic, --global-batch and --balance was saved as "bert_position"."""
    if "bert_position" in saved:
        saved["position"] = saved.pop("bert_position")
    return saved


@dataclass
class Trainer:
    model: torch.nn.Module
    objective: torch.nn.Module  # batch -> bert_models.pretraining_sums (the model, maybe under DDP)
    optimizer: torch.optim.Optimizer  # Horovod's DistributedOptimizer (or a plain one: DDP, one process)
    scheduler: object
    scaler: object
    device: torch.device
    amp_dtype: object  # autocast dtype, or None for fp32
    passes: int  # micro-batches per optimizer update
    max_grad_norm: float
    guard: object = None  # a nonfinite.NonFiniteGuard: a NaN/Inf loss skips the update on every rank, or stops
    timer: object = UNTIMED  # a durations.SectionTimer: data, compute, comm, optimizer
    # --global-batch, --balance: micro-batches -> (masked tokens, sequences) of the step on every rank
    # (an allreduce); each loss is then its share of the global mean, and the gradients are summed.
    global_counts: object = None
    last_lr: float = 0.0  # the LR of the latest step
    last_tokens: int = 0  # real (unpadded) tokens of the latest step

    @classmethod
    def of(cls, settings, model, objective, optimizer, scheduler, device, amp_dtype, use_scaler, **parts):
        """The trainer of a run's ``settings`` (accumulation, clipping) with a GradScaler when
        ``use_scaler`` (fp16); ``parts``: guard, timer, global_counts."""
        scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
        return cls(model, objective, optimizer, scheduler, scaler, device, amp_dtype, settings.accumulation_steps,
                   settings.max_grad_norm, **parts)

    def components(self):
        """What a checkpoint saves of the step's parts."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "scaler": self.scaler}

    def forward_backward(self, micro_batches, meter):
        """An update's forward and backward passes, one per micro-batch (read lazily: waiting for
        one is "data"); their gradients add up and Horovod's allreduce starts after the last.
        Their sums go into ``meter`` (taken back if the step is skipped). Returns the sequences."""
        sequences = tokens = 0
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        self._meter_before = (meter, meter.state_dict())  # a skipped step adds nothing to the metrics
        over, micro_batches = None, self.timer.timed(micro_batches, "data")
        if self.global_counts is not None:  # the whole step read first: its counts divide every loss
            micro_batches = list(micro_batches)
            over = self.global_counts(micro_batches)  # Horovod: the step's counts, an allreduce
        for micro_batch in micro_batches:
            with self.timer.section("compute"):
                sums = self._micro_batch(micro_batch, over)
            meter.add("mlm_loss", sums["mlm_loss"], sums["mlm_count"])
            meter.add("mlm_accuracy", sums["mlm_correct"], sums["mlm_count"])
            meter.add("nsp_loss", sums["nsp_loss"], sums["nsp_count"])
            meter.add("nsp_accuracy", sums["nsp_correct"], sums["nsp_count"])
            sequences += sums["nsp_count"]
            tokens += int(micro_batch["attention_mask"].sum())
        self.last_tokens = tokens
        return sequences

    def step(self):
        """The update after ``forward_backward``; False when it was skipped on every rank.

        Horovod: ``optimizer.synchronize()`` waits for the averaged gradients, then the ranks'
        NaN/Inf vote (one allreduce) skips the update on every rank or none; clipping and the
        step follow (optim.finish_step). The schedule moves on either way, as GradScaler's skips do.
        """
        stepped = optim.finish_step(self.optimizer, self.scaler, self.max_grad_norm, self.model.parameters(),
                                    self.guard, self.timer)
        if not stepped:
            meter, before = self._meter_before
            meter.load_state_dict(before)
        self.scheduler.step()
        return stepped

    def _micro_batch(self, micro_batch, over=None):
        """One micro-batch's pretraining sums; its backward pass adds to the gradients.

        ``over``: the step's global counts (see ``global_counts``), or None: a mean per micro-batch.
        """
        micro_batch = {k: v.to(self.device, non_blocking=True) for k, v in micro_batch.items()}
        with torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext():
            sums = self.objective(micro_batch)
        loss = bert_models.training_loss(sums) / self.passes if over is None else bert_models.training_loss(sums, over)
        if self.guard is not None:
            loss = self.guard.watch(loss)
        self.scaler.scale(loss).backward()  # Horovod: the allreduce starts after the last micro-batch
        return sums


def load_init(path):
    """--init-checkpoint: a checkpoint of ours (or its directory: the newest), or a Hugging Face BERT
    directory (continued pretraining from an existing model: models/bert.load_pretrained)."""
    if bert_models.is_pretrained_directory(path):
        return bert_models.load_pretrained(path)
    return load_init_checkpoint(path)


def init_origin(init):
    """Where --init-checkpoint's weights come from, for the run's line."""
    if init.get("source") == "huggingface":
        heads = f"; {', '.join(init['fresh_heads'])} freshly initialised" if init["fresh_heads"] else ""
        return f"a Hugging Face model{heads}"
    return f"its step {init['train_state']['step']}"


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


def training_data(settings, metadata, ctx, position=None, shares=None):
    """This rank's batches in the current world: its own share of each epoch's shards, or under
    --elastic, --global-batch or --balance (``position``, a bert_elastic.BinPosition) its slices of the epoch's
    global order (``shares``: --balance's balance.Shares). UsageError where not one step fits."""
    args = (settings.data, metadata, ctx.rank, ctx.size, settings.seed, settings.batch_size,
            settings.accumulation_steps)
    kwargs = dict(mlm_probability=settings.mlm_probability, binned=not settings.no_binning,
                  reading=lambda: ctx.watchdog.phase("reading a shard"))
    if settings.global_batch and settings.global_batch < ctx.size * settings.accumulation_steps:
        raise UsageError(f"--global-batch {settings.global_batch} leaves ranks of the {ctx.size} without a "
                         f"sequence for each of {settings.accumulation_steps} micro-batches")
    if position is None:
        data = bert_data.PretrainingData(*args, **kwargs)
    else:
        data = bert_elastic.ElasticPretrainingData(*args, position, global_batch=settings.global_batch,
                                                   shares=shares and shares.shares, **kwargs)
    if data.steps_in_epoch(0) == 0:  # a whole epoch at this size (or epoch 0's steps trained and left)
        what = (f"--global-batch {settings.global_batch} (at least {settings.accumulation_steps} sequences per "
                "rank)" if settings.global_batch else
                f"{settings.batch_size} x {settings.accumulation_steps} sequences on each")
        raise UsageError(f"{metadata['num_instances']} instances in {settings.data} are not enough for one step "
                         f"of {what} of {ctx.size} ranks")
    return data


def step_counts(allreduce):
    """``Trainer.global_counts`` over ``allreduce`` (a float64 tensor summed over the ranks)."""
    def counts(micro_batches):
        local = torch.tensor([sum(int((m["labels"] != -100).sum()) for m in micro_batches),
                              sum(len(m["next_sentence_label"]) for m in micro_batches)], dtype=torch.float64)
        tokens, sequences = allreduce(local).tolist()
        return int(tokens), int(sequences)
    return counts


def log_row(state, meter, lr):
    """The metrics row of the steps since the last: exact averages over every rank's tokens
    (collective: one allreduce of the sums)."""
    values = meter.reduce("bert")  # Horovod: the sums and counts of every rank, an allreduce
    meter.reset()
    return {"step": state.step, "epoch": state.epoch, "lr": lr, **values,
            "mlm_perplexity": math.exp(min(values["mlm_loss"], 50.0))}


def row_line(row):
    return (f"step {row['step']:>6} | mlm loss {row['mlm_loss']:.4f} acc {row['mlm_accuracy']:.3f} | "
            f"nsp loss {row['nsp_loss']:.4f} acc {row['nsp_accuracy']:.3f} | lr {row['lr']:.3g}")


def results(state, settings, batching, sequences, tokens):
    """results.json: the latest metrics row, this launch's throughput (``sequences``, ``tokens``: its
    Throughputs, summed over the ranks here: two allreduces)."""
    seq_total, seq_per_worker = sequences.launch_rates(batching.size)
    tok_total, tok_per_worker = tokens.launch_rates(batching.size)
    last = state.last_row
    return {"steps": state.step, "total_steps": settings.steps, "world_size": batching.size,
            "initial_mlm_loss": state.initial_mlm_loss, "final_mlm_loss": last.get("mlm_loss"),
            "mlm_accuracy": last.get("mlm_accuracy"), "mlm_perplexity": last.get("mlm_perplexity"),
            "nsp_loss": last.get("nsp_loss"), "nsp_accuracy": last.get("nsp_accuracy"),
            "sequences_per_sec": seq_total, "sequences_per_sec_per_worker": seq_per_worker,
            "tokens_per_sec": tok_total, "tokens_per_sec_per_worker": tok_per_worker,
            "global_batch": batching.global_batch}


def export(model, settings, metadata):
    """The Hugging Face model directory (--export-dir), with the data's tokenizer; its path."""
    tokenizer = bert_data.load_tokenizer(settings.data, metadata)
    return str(bert_models.export(model, tokenizer, settings.export_dir))
