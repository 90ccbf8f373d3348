"""Optimiser pieces written once: decay groups, LAMB, schedules."""
import math
from contextlib import nullcontext

import torch
from torch.optim.lr_scheduler import LambdaLR

from hvdtrain.durations import UNTIMED



def finish_step(optimizer, scaler, max_grad_norm=0.0, parameters=(), guard=None, timer=UNTIMED):
    """Step after the backward passes: the same code for Horovod, DDP and one process.

    A Horovod DistributedOptimizer is synchronised first (the gradient
    allreduce finishes), the gradients are unscaled and clipped when asked,
    then it steps without synchronising a second time (the GradScaler
    pattern). A plain optimizer (under DDP, or alone) just steps.

    ``guard`` (a nonfinite.NonFiniteGuard that watched this step's losses):
    the ranks decide together, after the allreduce and before anything uses
    the gradients, whether to skip the step. Returns False for a skipped step.
    ``timer`` (runtime/stragglers.py): the waits are "comm", the rest "optimizer".
    """
    horovod = hasattr(optimizer, "synchronize")
    with timer.section("comm"):  # waiting for the other ranks, not this rank's own work
        if horovod:
            optimizer.synchronize()  # Horovod: wait for the averaged gradients
        skip = guard is not None and guard.skip_step()  # a collective: every rank decides the same
    with timer.section("optimizer"):
        if skip:
            optimizer.zero_grad()  # every rank drops the (non-finite) averaged gradients
            return False
        _step(optimizer, scaler, max_grad_norm, parameters, horovod)
        return True


def _step(optimizer, scaler, max_grad_norm, parameters, horovod):
    if max_grad_norm > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
    with optimizer.skip_synchronize() if horovod else nullcontext():  # Horovod: synchronised above
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()  # set_to_none, the torch 2 default


def decay_groups(model, weight_decay):
    """Parameter groups with weight decay off for biases and normalisation weights.

    Decaying BatchNorm/LayerNorm scales and biases only hurts accuracy
    (Goyal et al. 2017; BERT): everything with one dimension is exempt.
    """
    decay, no_decay = [], []
    for _, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if parameter.ndim <= 1 else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning").

    Adam moments with bias correction, decoupled weight decay, then a per-tensor
    trust ratio ||w|| / ||update|| scales the step, so every layer moves by a
    similar relative amount at large batch sizes.

    Groups with weight_decay 0 (biases, LayerNorm) take the plain Adam step
    (trust ratio 1), as NVIDIA apex's FusedLAMB does by default (use_nvlamb=False):
    its kernel computes ``ratio = lr`` unless ``use_nvlamb || decay != 0``
    (NVIDIA/apex csrc/multi_tensor_lamb.cu, LAMBStage2Functor; the flag is
    apex/optimizers/fused_lamb.py's ``use_nvlamb``). ``nvlamb=True`` applies the
    trust ratio to every tensor, as FusedLAMB(use_nvlamb=True) does.
    FusedLAMB also clips the global gradient norm itself; here the caller does.

    ``fused``: the step compiled into a few kernels per group (training/lamb_fused.py);
    None (the default) takes it for CUDA parameters, or as HVDTRAIN_LAMB_FUSED says
    (1: everywhere, 0: nowhere). Otherwise one multi-tensor op per formula (CPU default).

    ``nvlamb`` and ``fused`` are settings of the optimizer, not of its groups, so state
    dicts keep their format (state_dict leaves them out; load_state_dict keeps them).
    Horovod's DistributedOptimizer builds a subclass and runs ``__init__`` again with
    this optimizer's param_groups alone: the settings travel in those groups' dicts.
    """

    _SETTINGS = "lamb_settings"  # the key in each param group's dict (see state_dict)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 nvlamb=None, fused=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        carried = next((group[self._SETTINGS] for group in self.param_groups if self._SETTINGS in group), {})
        self.nvlamb = bool(carried.get("nvlamb", False) if nvlamb is None else nvlamb)
        self.fused = carried.get("fused") if fused is None else fused
        self._carry_settings()

    def _carry_settings(self):
        for group in self.param_groups:
            group[self._SETTINGS] = {"nvlamb": self.nvlamb, "fused": self.fused}

    def state_dict(self):
        state = super().state_dict()
        for group in state["param_groups"]:
            group.pop(self._SETTINGS, None)
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._carry_settings()

    @torch.no_grad()
    def step(self, closure=None):
        from hvdtrain.training import lamb_fused  # here: the class is all of this module that uses it
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [parameter for parameter in group["params"] if parameter.grad is not None]
            if not params:
                continue
            if lamb_fused.wanted(self.fused, params[0].device):
                self._fused_step_group(group, params)
            else:
                self._step_group(group, params)
        return loss

    def _step_group(self, group, params):
        # One multi-tensor (torch._foreach_*) op per formula for the whole group, not one
        # op per tensor: BERT-large's ~400 tensors made ~6,000 small kernels a step, and on
        # an H200 the optimizer took longer than the forward and backward passes.
        beta1, beta2 = group["betas"]
        states = [self._state(parameter) for parameter in params]
        grads = [parameter.grad for parameter in params]
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)  # CPU counters: no device sync to read them
        counts = [step.item() for step in steps]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        updates = torch._foreach_div(exp_avgs, [1 - beta1 ** count for count in counts])
        denominators = torch._foreach_div(exp_avg_sqs, [1 - beta2 ** count for count in counts])
        torch._foreach_sqrt_(denominators)
        torch._foreach_add_(denominators, group["eps"])
        torch._foreach_div_(updates, denominators)
        del denominators
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        if group["weight_decay"] or self.nvlamb:
            torch._foreach_mul_(updates, trust_ratios(params, updates))
        torch._foreach_add_(params, updates, alpha=-group["lr"])

    def _fused_step_group(self, group, params):
        # The same formulas compiled into a few multi-tensor kernels (training/lamb_fused.py).
        from hvdtrain.training import lamb_fused
        states = [self._state(parameter) for parameter in params]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)  # CPU counters, as above
        lamb_fused.step_group(params, [parameter.grad for parameter in params],
                              [state["exp_avg"] for state in states], [state["exp_avg_sq"] for state in states],
                              [step.item() for step in steps], group["lr"], group["betas"], group["eps"],
                              group["weight_decay"], adapt=bool(group["weight_decay"]) or self.nvlamb)

    def _state(self, parameter):
        state = self.state[parameter]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(parameter)
            state["exp_avg_sq"] = torch.zeros_like(parameter)
        return state


def trust_ratios(params, updates):
    """Per tensor ||w|| / ||update||, or 1 where either norm is 0 (a zero-initialised tensor)."""
    weight_norms = torch.stack(torch._foreach_norm(params))
    update_norms = torch.stack(torch._foreach_norm(updates))
    ratios = torch.where((weight_norms > 0) & (update_norms > 0),
                         weight_norms / update_norms, torch.ones_like(weight_norms))
    return list(ratios.unbind())


def warmup_then_decay(optimizer, warmup_steps, total_steps, decay="cosine",
                      milestones=(), gamma=0.1, power=1.0):
    """LambdaLR: linear warmup (Goyal et al. 2017) then cosine, step or polynomial decay.

    ``decay`` is "cosine", "step" (multiply by ``gamma`` at each of ``milestones``,
    counted in steps), "poly" (BERT: (1 - progress) ** power) or "constant".
    """
    def factor(step):
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        if decay == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if decay == "poly":
            return (1.0 - progress) ** power
        if decay == "step":
            return gamma ** sum(step >= m for m in milestones)
        return 1.0

    return LambdaLR(optimizer, factor)


def set_schedule_at(scheduler, progress, peak_lr):
    """Set ``scheduler``'s LR for ``progress`` (in its units: steps or samples) at ``peak_lr``.

    The CNN sets its LR before every step from the samples trained (training/epochs.py):
    a step's length in samples changes with the world size under --elastic, the schedule
    must not, and the peak LR follows the size (Goyal et al.'s scaling) from the first
    step of a new world. The same values a LambdaLR stepped once per step gives.
    """
    scheduler.base_lrs = [peak_lr] * len(scheduler.base_lrs)
    scheduler.last_epoch = progress
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = peak_lr * factor(progress)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
