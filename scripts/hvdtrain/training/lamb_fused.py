"""LAMB's step for one parameter group in a few compiled kernels (training/optim.py's LAMB uses it).

The multi-tensor LAMB step makes about 15 passes over the weights, gradients and moments,
one per ``torch._foreach_*`` formula. Here the same formulas, in the same order, go through
``torch.compile``, whose Inductor backend fuses each pass's elementwise work into a few
multi-tensor (foreach) kernels for the whole group:

- a group with a trust ratio (weight decay, or every group with NVLAMB): the moments and the
  update in one compiled pass (reads w, g, m, v; writes m, v and the update), the two norms
  per tensor with torch's own multi-tensor norm (``torch._foreach_norm``, a few kernels for
  the group; reductions inside the compiled pass would be one kernel per tensor), then
  w -= lr * ratio * update in a second compiled pass. About 48 bytes per parameter in fp32
  against the ~28 of torch's fused AdamW, the bound for any Adam-family step;
- a group without one (weight decay 0 and no NVLAMB: Adam's step): one compiled pass.

What changes from step to step (the learning rate, each tensor's bias corrections) travels
as one small float64 tensor, so the compiled passes are compiled once per group shape and
never again; the step counters stay on the host as in the multi-tensor step (the state dict
keeps its format: per tensor a CPU float32 ``step``, ``exp_avg`` and ``exp_avg_sq``), and
reading them costs no device synchronisation.

``HVDTRAIN_LAMB_FUSED``: unset or ``auto`` uses this step for CUDA parameters and the
multi-tensor step elsewhere; ``1`` this step everywhere (a CPU compiles it with its C++
backend: tests/test_lamb.py); ``0`` the multi-tensor step everywhere (to compare).
A compilation that fails falls back to the same function run eagerly, once, with a warning.
"""
import os
import warnings

import torch

from hvdtrain.errors import UsageError

ENV = "HVDTRAIN_LAMB_FUSED"
_CHOICES = {"": None, "auto": None, "1": True, "0": False}


def wanted(setting, device):
    """Whether a group on ``device`` takes the compiled step: ``setting`` True/False, else the environment."""
    if setting is None:
        value = os.environ.get(ENV, "").strip().lower()
        if value not in _CHOICES:
            raise UsageError(f"{ENV}={value}: choose 1 (the compiled LAMB step), 0 (the multi-tensor one) or auto")
        setting = _CHOICES[value]
    return device.type == "cuda" if setting is None else bool(setting)


def step_group(params, grads, exp_avgs, exp_avg_sqs, counts, lr, betas, eps, weight_decay, adapt):
    """One LAMB step for a group's tensors, the moments and weights updated in place.

    ``counts``: each tensor's step number, already incremented (host floats); ``adapt``: the
    trust ratio applies (weight decay, or NVLAMB).
    """
    beta1, beta2 = betas
    scalars = _scalars(lr, counts, beta1, beta2, params[0].device)
    if not adapt:
        _run("adam", params, grads, exp_avgs, exp_avg_sqs, scalars, beta1, beta2, eps)
        return
    updates = _run("update", params, grads, exp_avgs, exp_avg_sqs, scalars, beta1, beta2, eps, weight_decay)
    weight_norms = torch.stack(torch._foreach_norm(params))
    update_norms = torch.stack(torch._foreach_norm(updates))
    _run("apply", params, updates, weight_norms, update_norms, scalars)


def _scalars(lr, counts, beta1, beta2, device):
    """[lr, 1 - beta1^t per tensor, 1 - beta2^t per tensor]: computed on the host in double
    precision as the multi-tensor step computes them, then one copy to the device."""
    values = [float(lr)] + [1 - beta1 ** count for count in counts] + [1 - beta2 ** count for count in counts]
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.float64, device=device)
    # Pinned memory from torch's caching host allocator: the copy is queued, not waited for,
    # and the buffer is not reused before it completes.
    return torch.tensor(values, dtype=torch.float64, pin_memory=True).to(device, non_blocking=True)


def moments_and_update(params, grads, exp_avgs, exp_avg_sqs, scalars, beta1, beta2, eps, weight_decay):
    """The moments in place and the update m_hat / (sqrt(v_hat) + eps) + weight_decay * w:
    the multi-tensor step's formulas in its order (training/optim.py, LAMB._step_group)."""
    count = len(params)
    bias1 = scalars[1:1 + count].unbind()
    bias2 = scalars[1 + count:1 + 2 * count].unbind()
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    updates = torch._foreach_div(exp_avgs, bias1)
    denominators = torch._foreach_div(exp_avg_sqs, bias2)
    torch._foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, eps)
    torch._foreach_div_(updates, denominators)
    if weight_decay:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    return updates


def adam_step(params, grads, exp_avgs, exp_avg_sqs, scalars, beta1, beta2, eps):
    """No trust ratio: w -= lr * update in the same pass as the moments."""
    updates = moments_and_update(params, grads, exp_avgs, exp_avg_sqs, scalars, beta1, beta2, eps, 0.0)
    torch._foreach_mul_(updates, -scalars[0])
    torch._foreach_add_(params, updates)


def apply_trust_ratios(params, updates, weight_norms, update_norms, scalars):
    """w -= lr * ratio * update, the ratio ||w|| / ||update|| or 1 where either is 0 (optim.trust_ratios)."""
    ratios = torch.where((weight_norms > 0) & (update_norms > 0),
                         weight_norms / update_norms, torch.ones_like(weight_norms))
    steps = torch._foreach_mul(updates, ratios.unbind())  # not in place: the updates are an input
    torch._foreach_mul_(steps, -scalars[0])
    torch._foreach_add_(params, steps)


_PASSES = {"update": moments_and_update, "adam": adam_step, "apply": apply_trust_ratios}
COMPILE = True  # False: the passes run eagerly (tests/test_lamb.py compares both with the multi-tensor step)
_compiled = {}
_failed = set()


def _run(name, *args):
    """The pass compiled (once per process; torch.compile keys each group's shapes itself), or eager after a failure."""
    function = _PASSES[name]
    if not COMPILE or name in _failed:
        return function(*args)
    if name not in _compiled:
        # dynamic=False: each group's shapes compile to their own static kernels (BERT's two
        # groups, two entries per pass), not to one shape-generic kernel after the second group.
        _compiled[name] = torch.compile(function, fullgraph=True, dynamic=False)
    try:
        return _compiled[name](*args)
    except Exception as error:  # compilation fails before the pass runs: nothing was updated yet
        if not _is_compile_error(error):
            raise
        _failed.add(name)
        warnings.warn(f"LAMB: the compiled {name} pass failed to compile, running it eagerly: "
                      f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        return function(*args)


def reset():
    """Forget the compiled passes and any failure (tests: each starts with nothing compiled)."""
    _compiled.clear()
    _failed.clear()
    torch._dynamo.reset()


def _is_compile_error(error):
    """Raised while tracing or compiling (Dynamo's own, Inductor's as BackendCompilerFailed), before any kernel ran."""
    from torch._dynamo.exc import TorchDynamoException
    return isinstance(error, TorchDynamoException)
