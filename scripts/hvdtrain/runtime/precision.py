"""The training precision: ``--precision auto|fp32|bf16|fp16`` resolved for the device.

``auto`` takes mixed precision where the hardware runs it natively and fp32
elsewhere:
- CUDA: the trainer's own choice (``cuda_auto``): fp16 with a GradScaler for
  train_cnn.py, as its ``--amp`` default always was; bf16 for
  pretrain_bert.py where the GPU supports it, else fp32;
- CPU: bf16 where the CPU has native bf16 arithmetic (the ``amx_bf16`` or
  ``avx512_bf16`` flag in /proc/cpuinfo: Intel Sapphire Rapids and later, AMD
  Zen 4 and later), else fp32. Elsewhere oneDNN emulates bf16 with fp32
  arithmetic plus conversions, slower than fp32 (docs/performance.md).

fp16 autocast needs CUDA. bf16 never needs a GradScaler: its exponent range is
fp32's. What is resolved is a setting (compared on resume); the reason is for
the run's first line.
"""
from typing import NamedTuple

import torch

from hvdtrain.errors import UsageError
from hvdtrain.options import PRECISIONS

CHOICES = PRECISIONS  # --precision (options.py)
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# /proc/cpuinfo flag -> the name of the unit that runs bf16 natively, best first
NATIVE_BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}


class Precision(NamedTuple):
    name: str  # fp32, bf16 or fp16
    reason: str  # why, for the log: "auto: the CPU has AMX", "requested", ...

    @property
    def dtype(self):
        """The autocast dtype, or None for fp32 (no autocast)."""
        return DTYPES[self.name]

    @property
    def scaler(self):
        """Whether a GradScaler is needed: fp16 only."""
        return self.name == "fp16"

    def line(self):
        return f"precision {self.name} ({self.reason})"


def scaler(name, device):
    """A GradScaler for precision ``name`` on ``device``: enabled for fp16 only (a no-op otherwise)."""
    return torch.amp.GradScaler(device.type, enabled=name == "fp16")


def cpu_flags(path="/proc/cpuinfo"):
    """The CPU's feature flags (the first ``flags`` line), or an empty set where none can be read."""
    try:
        with open(path) as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def native_cpu_bf16(flags):
    """The unit that runs bf16 natively on a CPU with these flags (``"AMX"``, ...), or None."""
    return next((unit for flag, unit in NATIVE_BF16_FLAGS.items() if flag in flags), None)


def resolve(requested, device_type, cuda_auto="bf16", flags=None, cuda_bf16=None):
    """The Precision for ``requested`` (one of CHOICES) on ``device_type`` ("cuda" or "cpu").

    ``cuda_auto``: what auto takes on CUDA ("fp16", or "bf16" where the GPU
    supports it, else fp32). ``flags``/``cuda_bf16``: the CPU's flags and
    torch.cuda.is_bf16_supported(), read from this machine when None (tests
    pass their own). Raises UsageError for a precision the device cannot run.
    The result is also kept for ``description``.
    """
    if requested not in CHOICES:
        raise UsageError(f"--precision {requested}: choose one of {', '.join(CHOICES)}")
    cuda = device_type == "cuda"
    if requested == "fp16" and not cuda:
        raise UsageError("--precision fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
    if cuda:
        if requested != "auto":
            chosen = Precision(requested, "requested")
        elif cuda_auto == "fp16":
            chosen = Precision("fp16", "auto: CUDA")
        elif torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16:
            chosen = Precision("bf16", "auto: the GPU has bf16")
        else:
            chosen = Precision("fp32", "auto: the GPU has no bf16")
    else:
        unit = native_cpu_bf16(cpu_flags() if flags is None else flags)
        if requested == "auto":
            chosen = Precision("bf16", f"auto: the CPU has {unit}") if unit else \
                Precision("fp32", "auto: the CPU has no native bf16")
        elif requested == "bf16":
            chosen = Precision("bf16", f"requested; the CPU has {unit}" if unit else
                               "requested; emulated: the CPU has no native bf16, slower than fp32")
        else:
            chosen = Precision("fp32", "requested")
    _RESOLVED[device_type] = chosen
    return chosen


_RESOLVED = {}  # device type -> the latest resolve() in this process


def description(name, device_type):
    """The run's words for its resolved precision ``name``: "precision bf16 (auto: the CPU has AMX)"."""
    latest = _RESOLVED.get(device_type)
    return latest.line() if latest is not None and latest.name == name else f"precision {name}"
