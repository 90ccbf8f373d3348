"""The compiled LAMB step (training/lamb_fused.py) against the multi-tensor one (optim.LAMB).

On a GPU the compiled passes are Inductor's Triton kernels; here the same graphs compile
with Inductor's C++ backend. The tolerance, RTOL, is relative to each tensor's largest
value. The two steps run the same float32 formulas in the same order. They may differ in
where a multiply and an add fuse into one rounding (CPU kernels use fused multiply-adds for
``add(alpha=)``), in the order a norm sums, and on a GPU in Triton's division (within 2
ulp): a few ulp per step. The moments' recurrences shrink old differences (beta < 1), and
a weight moves by lr * ratio * update, far less than its size. A different formula is far
outside it: a lost trust ratio or bias correction changes weights by ~lr, 1e-2 here
(test_the_tolerance_sees_a_formula_change).
"""
import io

import pytest
import torch

from hvdtrain.errors import UsageError
from hvdtrain.training import lamb_fused, optim
from support.needs import require_module, require_program

RTOL = 1e-6  # ~8 float32 ulp of each tensor's largest value
LRS = [0.02, 0.015, 0.01, 0.012, 0.008, 0.005]  # a schedule: the compiled passes must not recompile for it


@pytest.fixture(scope="module")
def inductor():
    """torch.compile's CPU backend (it compiles C++); the module's compiled tests on one xdist worker."""
    require_program("g++", "install a C++ compiler (apt-get install g++): torch.compile's CPU backend needs one")
    yield
    lamb_fused.reset()


@pytest.fixture
def fresh():
    """Nothing compiled yet; torch.compile's counters from zero."""
    lamb_fused.reset()
    torch._dynamo.utils.counters.clear()
    yield
    lamb_fused.reset()


def start_weights():
    """Weights a BERT layer's groups look like, with the corner cases: a zero-initialised
    matrix (||w|| = 0: trust ratio 1) and a bias whose gradient is always 0 (||update|| = 0
    without weight decay: ratio 1 under NVLAMB)."""
    generator = torch.Generator().manual_seed(0)
    decay = [torch.randn(48, 32, generator=generator) * 0.05, torch.randn(16, 8, 3, generator=generator),
             torch.zeros(24, 8)]
    no_decay = [torch.randn(32, generator=generator) * 0.1, torch.ones(16), torch.randn(5, generator=generator)]
    return decay, no_decay


ZERO_GRAD = 4  # the bias whose gradient is 0 (index into decay + no_decay)
SKIPPED = (2, 1)  # (step, tensor): no gradient that step, so that tensor's step count lags its group's


def gradients(step, shapes, device):
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(shape, generator=generator) * scale
             for shape, scale in zip(shapes, (1e-2, 1.0, 3e-3, 0.5, 1.0, 1e-4))]
    grads[ZERO_GRAD].zero_()
    return [grad.to(device) for grad in grads]


def build(fused, nvlamb, device="cpu"):
    decay, no_decay = start_weights()
    params = [torch.nn.Parameter(t.to(device)) for t in decay + no_decay]
    optimizer = optim.LAMB([{"params": params[:len(decay)], "weight_decay": 0.01},
                            {"params": params[len(decay):], "weight_decay": 0.0}],
                           lr=LRS[0], eps=1e-6, nvlamb=nvlamb, fused=fused)
    return params, optimizer


def train(params, optimizer, steps, graphs=None):
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = LRS[step]
        grads = gradients(step, [p.shape for p in params], params[0].device)
        for index, (parameter, grad) in enumerate(zip(params, grads)):
            parameter.grad = None if (step, index) == SKIPPED else grad
        optimizer.step()
        if graphs is not None:
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def assert_same_training(params, optimizer, ref_params, reference, exact_moments=False):
    for index, (mine, theirs) in enumerate(zip(params, ref_params)):
        assert_close(mine.detach(), theirs.detach(), f"weight {index}")
        ours, expected = optimizer.state[mine], reference.state[theirs]
        assert ours["step"].item() == expected["step"].item(), index
        for key in ("exp_avg", "exp_avg_sq"):
            if exact_moments:
                assert torch.equal(ours[key], expected[key]), (index, key)
            assert_close(ours[key], expected[key], f"{key} {index}")


def assert_close(actual, expected, what):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("nvlamb", [False, True], ids=["fusedlamb-default", "nvlamb"])
def test_compiled_lamb_equals_the_multi_tensor_lamb_over_steps(inductor, fresh, nvlamb):
    """Six steps with a changing LR, a zero-initialised tensor, a zero gradient, a tensor
    skipped for a step (its bias corrections then differ from its group's), a weight-decay-0
    group with (nvlamb) and without a trust ratio: weights and moments within RTOL, step counts
    equal. Compiled once: after the step that skipped a tensor (a new tensor list) no LR or
    gradient makes a new graph."""
    ref_params, reference = build(fused=False, nvlamb=nvlamb)
    params, optimizer = build(fused=True, nvlamb=nvlamb)
    graphs = []
    train(ref_params, reference, range(len(LRS)))
    train(params, optimizer, range(len(LRS)), graphs)
    assert_same_training(params, optimizer, ref_params, reference)
    assert not lamb_fused._failed and graphs[0] > 0, (lamb_fused._failed, graphs)
    assert len(set(graphs[SKIPPED[0]:])) == 1, graphs  # no recompilation for a new LR or new gradients


@pytest.mark.gpu
@pytest.mark.parametrize("nvlamb", [False, True], ids=["fusedlamb-default", "nvlamb"])
def test_on_a_gpu_compiled_lamb_equals_the_multi_tensor_lamb(monkeypatch, fresh, nvlamb):
    """The same on CUDA: Inductor's Triton kernels (the default there) against the multi-tensor step."""
    monkeypatch.delenv(lamb_fused.ENV, raising=False)
    ref_params, reference = build(fused=False, nvlamb=nvlamb, device="cuda")
    params, optimizer = build(fused=None, nvlamb=nvlamb, device="cuda")  # the CUDA default: compiled
    graphs = []
    train(ref_params, reference, range(len(LRS)))
    train(params, optimizer, range(len(LRS)), graphs)
    assert_same_training(params, optimizer, ref_params, reference)
    assert not lamb_fused._failed and graphs[0] > 0, (lamb_fused._failed, graphs)
    assert all(optimizer.state[p]["step"].device.type == "cpu" for p in params)  # the format: CPU step counts


@pytest.mark.parametrize("nvlamb", [False, True], ids=["fusedlamb-default", "nvlamb"])
def test_the_passes_run_eagerly_equal_the_multi_tensor_lamb(monkeypatch, nvlamb):
    """The fallback (and the formulas alone): the same passes uncompiled give the same moments
    bit for bit; the weights' last multiply-add rounds once or twice, within RTOL."""
    monkeypatch.setattr(lamb_fused, "COMPILE", False)
    ref_params, reference = build(fused=False, nvlamb=nvlamb)
    params, optimizer = build(fused=True, nvlamb=nvlamb)
    train(ref_params, reference, range(len(LRS)))
    train(params, optimizer, range(len(LRS)))
    assert_same_training(params, optimizer, ref_params, reference, exact_moments=True)


def test_a_pass_that_fails_to_compile_runs_eagerly(monkeypatch, fresh):
    """A compilation that fails (no C++ compiler, no Triton, an Inductor bug) warns once per
    pass and runs it eagerly: nothing was updated before it failed, so training stays exact."""
    def failing(*args, **kwargs):
        def call(*args):
            raise torch._dynamo.exc.InternalTorchDynamoError("simulated")
        return call
    monkeypatch.setattr(torch, "compile", failing)
    ref_params, reference = build(fused=False, nvlamb=False)
    params, optimizer = build(fused=True, nvlamb=False)
    train(ref_params, reference, range(len(LRS)))
    with pytest.warns(UserWarning, match="failed to compile, running it eagerly") as warned:
        train(params, optimizer, range(len(LRS)))
    assert len(warned) == 3 and lamb_fused._failed == {"update", "apply", "adam"}, [str(w.message) for w in warned]
    assert_same_training(params, optimizer, ref_params, reference, exact_moments=True)


def test_the_tolerance_sees_a_formula_change(monkeypatch):
    """What RTOL would catch: NVLAMB's trust ratio on the weight-decay-0 group, the one
    difference between the two modes, moves those weights far outside it."""
    monkeypatch.setattr(lamb_fused, "COMPILE", False)
    plain, with_plain = build(fused=True, nvlamb=False)
    adapted, with_adapted = build(fused=True, nvlamb=True)
    train(plain, with_plain, range(2))
    train(adapted, with_adapted, range(2))
    with pytest.raises(AssertionError):
        assert_close(adapted[3].detach(), plain[3].detach(), "weight 3")


@pytest.mark.parametrize("first,then", [(False, True), (True, False)], ids=["multi-tensor-to-compiled",
                                                                           "compiled-to-multi-tensor"])
def test_a_checkpoint_resumes_across_the_two_steps(inductor, fresh, first, then):
    """Three steps with one, its state dict through torch.save/torch.load (as checkpoints
    are: CPU, weights_only), three more with the other: the six steps of the multi-tensor
    LAMB within RTOL. The state dict's format is the multi-tensor one's: the same keys, the
    group settings without nvlamb or fused, a CPU float32 step count per tensor."""
    ref_params, reference = build(fused=False, nvlamb=True)
    train(ref_params, reference, range(len(LRS)))

    params, optimizer = build(fused=first, nvlamb=True)
    train(params, optimizer, range(3))
    buffer = io.BytesIO()
    torch.save({"weights": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location="cpu", weights_only=True)
    old_params, old = build(fused=False, nvlamb=True)
    train(old_params, old, range(3))
    assert_same_format(saved["optimizer"], old.state_dict())

    resumed_params, resumed = build(fused=then, nvlamb=True)
    with torch.no_grad():
        for parameter, weight in zip(resumed_params, saved["weights"]):
            parameter.copy_(weight)
    resumed.load_state_dict(saved["optimizer"])
    assert resumed.nvlamb and resumed.fused is then  # the settings survive the load
    train(resumed_params, resumed, range(3, len(LRS)))
    assert_same_training(resumed_params, resumed, ref_params, reference)


def assert_same_format(state, multi_tensor_state):
    assert state["param_groups"] == multi_tensor_state["param_groups"]
    assert set(state["state"]) == set(multi_tensor_state["state"])
    assert all(set(group) == {"params", "lr", "betas", "eps", "weight_decay"} for group in state["param_groups"])
    for entry in state["state"].values():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        assert entry["step"].dtype == torch.float32 and entry["step"].device.type == "cpu" and entry["step"].dim() == 0


def test_horovod_keeps_nvlamb_and_fused():
    """hvd.DistributedOptimizer builds a subclass and runs __init__ again with the param groups
    alone: --lamb-nvlamb was lost there (the wrapped LAMB stepped without it). Both settings now
    travel in the groups; the wrapped optimizer steps as the unwrapped one, and its state dict
    keeps the format."""
    require_module("horovod.torch")
    import horovod.torch as hvd
    hvd.init()  # one process: size 1, no allreduce hooks
    try:
        params, optimizer = build(fused=False, nvlamb=True)
        named = [(f"p{index}", parameter) for index, parameter in enumerate(params)]
        wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=named)
        assert wrapped.nvlamb is True and wrapped.fused is False
        ref_params, reference = build(fused=False, nvlamb=True)
        train(ref_params, reference, range(2))
        train(params, wrapped, range(2))
        for mine, theirs in zip(params, ref_params):
            assert torch.equal(mine, theirs)
        state = wrapped.state_dict()
        assert all(set(group) == {"params", "lr", "betas", "eps", "weight_decay"} for group in state["param_groups"])
        wrapped.load_state_dict(state)
        assert wrapped.nvlamb is True and wrapped.fused is False
    finally:
        hvd.shutdown()


def test_the_switch(monkeypatch):
    """Automatic: compiled on CUDA, multi-tensor elsewhere; HVDTRAIN_LAMB_FUSED=1/0 forces
    either; a setting given to LAMB wins; another value is one line."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(lamb_fused.ENV, raising=False)
    assert not lamb_fused.wanted(None, cpu) and lamb_fused.wanted(None, cuda)
    for value, expected in (("auto", (False, True)), ("1", (True, True)), ("0", (False, False))):
        monkeypatch.setenv(lamb_fused.ENV, value)
        assert (lamb_fused.wanted(None, cpu), lamb_fused.wanted(None, cuda)) == expected, value
    assert lamb_fused.wanted(False, cuda) is False and lamb_fused.wanted(True, cpu) is True
    monkeypatch.setenv(lamb_fused.ENV, "yes")
    with pytest.raises(UsageError) as error:
        lamb_fused.wanted(None, cpu)
    assert str(error.value) == ("HVDTRAIN_LAMB_FUSED=yes: choose 1 (the compiled LAMB step), "
                                "0 (the multi-tensor one) or auto")
