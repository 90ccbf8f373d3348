"""Checkpoints, and the runs whose weights a test compares: one precision rule for all of them.

Two kinds of equality, two precisions:

- **Across splits of the global batch** (n workers = one worker, a balanced split, a job resized
  mid-run = one never resized, 16 ranks x 1 = 1 x 16): equal to float32's summation order, 1e-5,
  and only in fp32. ``--precision auto`` takes bf16 autocast on a CPU with native bf16 (the
  ``avx512_bf16`` or ``amx_bf16`` flag: AMD Zen 4, Intel Sapphire Rapids and later), and bf16 rounds
  each product to 8 bits of mantissa: the gradient of 2 x 8 samples rounds differently from that
  of 1 x 16 (1e-5 to 3e-3 apart after 10-60 steps, measured on such a CPU), so no tolerance short
  of the training's own movement separates a bug from rounding there. Every run such a test
  compares passes ``EXACT``, and ``assert_same_weights`` refuses a checkpoint trained otherwise,
  so a new test cannot forget it.
- **The same split, interrupted or not** (stop and resume, requeue, another launcher of the same
  ranks): bit for bit (``assert_same_tensors``) in any precision, since bf16 autocast is as
  deterministic as fp32 for the same operations in the same order. These run ``auto``, so a CPU
  with bf16 proves bf16's resume too.
"""
import torch

from .checkpoints import checkpoint_file

EXACT = ["--precision", "fp32"]  # the precision in which splits of a batch agree to TOLERANCE
TOLERANCE = 1e-5  # float32 summation order over a few dozen steps


def checkpoint_at(directory, step):
    """The checkpoint ``directory`` holds for ``step``, loaded on the CPU."""
    return torch.load(checkpoint_file(directory, step), map_location="cpu", weights_only=True)


def assert_same_weights(actual, expected, where="", atol=TOLERANCE):
    """The models of two checkpoints (dicts as loaded) equal within ``atol``; both trained in fp32."""
    for name, state in (("actual", actual), ("expected", expected)):
        trained_in = state["settings"].get("precision")
        assert trained_in == "fp32", (
            f"{where}: the {name} run trained in {trained_in}; weights agree across batch splits "
            f"only in fp32: pass support.weights.EXACT to every run compared")
    for key, value in expected["model"].items():
        torch.testing.assert_close(actual["model"][key], value, rtol=0, atol=atol,
                                   msg=lambda m: f"{where} {key}: {m}")
    largest = max((actual["model"][key] - value).abs().max().item() for key, value in expected["model"].items())
    print(f"{where}: the weights agree to {largest:.2e} (held to {atol:g})")  # the margin, in the test's output
    return largest


def assert_same_tensors(a, b, where):
    """Equal bit for bit, through nested dicts and lists (a model, an optimizer state)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{index}]")
