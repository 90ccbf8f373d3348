"""The training steps benchmark.py times: the trainers' own, on synthetic data.

``build(args, backend)`` returns a workload whose ``step()`` runs one optimizer
step of train_cnn.py or pretrain_bert.py (``training.cnn.Trainer``'s and
``training.bert.Trainer``'s ``forward_backward`` and ``step``) and returns its loss; ``samples`` and ``unit`` say what a step
processes. The backend (backends.HorovodBackend, DdpBackend, SingleBackend) wraps
the model and optimizer, so one workload runs under all three.
"""
import torch
import torch.nn as nn

from hvdtrain.bench.options import BERT_MODELS, CNN_MODELS
from hvdtrain.models import bert as bert_models
from hvdtrain.runtime import precision as precisions
from hvdtrain.training import cnn, optim
from hvdtrain.training import bert as bert_training
from hvdtrain.runtime.metrics import SumMeter
from hvdtrain.durations import SectionTimer
from hvdtrain.models import resnet



def build(args, backend):
    return (BertWorkload if args.model in BERT_MODELS else CnnWorkload)(args, backend)


def precision_of(args, device, amp):
    """--precision as given (fp16 needs CUDA), else ``amp`` with --amp on CUDA, else fp32."""
    if args.precision:
        return precisions.resolve(args.precision, device.type).name
    return amp if args.amp and device.type == "cuda" else "fp32"


class CnnWorkload:
    """A ResNet step of train_cnn.py on a fixed synthetic batch per rank."""

    def __init__(self, args, backend):
        size, classes = CNN_MODELS[args.model]
        size = args.image_size or size
        model = resnet.build(args.model, classes).to(backend.device)
        if args.channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        module, optimizer = backend.wrap(model, list(model.named_parameters()), optimizer)
        self.precision = precision_of(args, backend.device, "fp16")
        scaler = precisions.scaler(self.precision, backend.device)
        self.timer = SectionTimer()  # the step's parts, as the trainers time them (durations.py)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        self.trainer = cnn.Trainer(torch.compile(module) if args.compile else module, optimizer, scheduler, scaler,
                                   nn.CrossEntropyLoss(), backend.device, self.precision, args.channels_last,
                                   args.accumulation_steps, adasum=False, timer=self.timer)
        generator = torch.Generator().manual_seed(args.seed * 1000 + backend.rank)
        samples = args.batch_size * args.accumulation_steps
        self.images = torch.randn(samples, 3, size, size, generator=generator)
        self.targets = torch.randint(0, classes, (samples,), generator=generator)
        self.samples, self.unit = samples, "images"

    def step(self):
        meter = SumMeter("train_loss", "train_top1")
        self.trainer.forward_backward((self.images, self.targets), meter)  # the trainer's own step
        self.trainer.step()
        return meter.sums["train_loss"] / meter.counts["train_loss"]


class BertWorkload:
    """A BERT pretraining step of pretrain_bert.py on synthetic masked sequences."""

    def __init__(self, args, backend):
        config = bert_models.preset_config(BERT_MODELS[args.model], args.vocab_size)
        model = bert_models.build_model(config).to(backend.device)
        optimizer = optim.LAMB(optim.decay_groups(model, 0.01), lr=1e-3)
        encoder = torch.compile(model.bert) if args.compile else model.bert  # as training/bert.py build_model
        objective, optimizer = backend.wrap(bert_models.PretrainingObjective(model, encoder),
                                            list(model.named_parameters()), optimizer)
        self.precision = precision_of(args, backend.device, "bf16")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        self.timer = SectionTimer()
        self.trainer = bert_training.Trainer(
            model, objective, optimizer, scheduler, precisions.scaler(self.precision, backend.device),
            backend.device, precisions.DTYPES[self.precision], args.accumulation_steps, max_grad_norm=1.0,
            timer=self.timer)
        self.data = SyntheticSequences(args, backend.rank)
        self.samples, self.unit = args.batch_size * args.accumulation_steps, "sequences"

    def step(self):
        meter = SumMeter("mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy")
        micro_batches = (self.data.batch(0, micro) for micro in range(self.trainer.passes))
        self.trainer.forward_backward(micro_batches, meter)  # the trainer's own step
        self.trainer.step()
        return meter.sums["mlm_loss"] / max(1, meter.counts["mlm_loss"])


class SyntheticSequences:
    """``PretrainingData.batch``'s interface: full-length sequences, 15% masked."""

    def __init__(self, args, rank):
        generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
        shape = (args.batch_size, args.seq_length)
        labels = torch.full(shape, -100, dtype=torch.int64)
        masked = torch.rand(shape, generator=generator) < 0.15
        masked[:, 0] = False
        labels[masked] = torch.randint(0, args.vocab_size, (int(masked.sum()),), generator=generator)
        self.batch_tensors = {
            "input_ids": torch.randint(0, args.vocab_size, shape, generator=generator),
            "token_type_ids": (torch.arange(args.seq_length) >= args.seq_length // 2).long().expand(shape).clone(),
            "attention_mask": torch.ones(shape, dtype=torch.int64),
            "labels": labels,
            "next_sentence_label": torch.randint(0, 2, (args.batch_size,), generator=generator),
        }

    def batch(self, step, micro):
        return self.batch_tensors
