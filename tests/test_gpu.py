"""GPU paths of the trainers, under real horovodrun launches on CUDA devices.

Every test here carries the ``gpu`` marker: tests/conftest.py deselects them
where no CUDA GPU is visible (pytest's summary says how many and why). Run them
on a GPU machine after `make setup` with `.venv/bin/python -m pytest -m gpu tests`.
With one GPU the jobs run one rank, with two or more GPUs two ranks (one GPU each).

Self-contained on purpose: it uses only options the scripts have today and its
own small helpers, not those of test_train_cnn.py / test_bert.py.
"""
import json
import re
from pathlib import Path

import pytest
import torch

from support.bert_data import make_small_static_data
from support.checkpoints import checkpoint_file
from support.checks import ok
from support.launch import SCRIPTS, horovodrun, launch
from support.needs import require
from support.weights import checkpoint_at

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_horovod")]

CNN = SCRIPTS / "train_cnn.py"
PRETRAIN = SCRIPTS / "pretrain_bert.py"
# One rank per GPU: Horovod pins rank r of a node to cuda:r.
NP = max(1, min(2, torch.cuda.device_count()))
# Compilation and cuDNN autotuning make first steps slow; the stall watchdog must wait.
ENV = {"HVDTRAIN_WATCHDOG_SECONDS": "900", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "900"}


def results(directory):
    return json.loads((Path(directory) / "results.json").read_text())


def max_difference(first, second):
    """Largest absolute difference over every floating-point tensor of two state dicts."""
    assert first.keys() == second.keys()
    return max((a.double() - b.double()).abs().max().item()
               for a, b in zip(first.values(), second.values()) if a.is_floating_point())


def cnn(args, out, timeout=600):
    return ok(horovodrun(NP, [CNN, "--output-dir", out, "--image-size", "16", *args], timeout=timeout, env=ENV))


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    """A few documents, static masking: tiny shards for short GPU runs."""
    return make_small_static_data(tmp_path_factory.mktemp("gpu-bert"), timeout=180)


def bert(data, out, args, timeout=600):
    return ok(horovodrun(NP, [PRETRAIN, "--data", data, "--output-dir", out, "--model", "tiny",
                              "--batch-size", "4", "--log-every", "1", *args], timeout=timeout, env=ENV))


def test_horovod_has_nccl_and_cuda():
    check = launch(["horovodrun", "--check-build"], timeout=60)
    assert re.search(r"\[X\] NCCL\b", check.output), check.describe()
    import horovod.torch as hvd
    assert hvd.nccl_built() and hvd.cuda_built()


def test_each_rank_is_pinned_to_its_own_gpu_and_allreduces_there(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch, horovod.torch as hvd\n"
        "from hvdtrain.runtime import dist\n"
        "ctx = dist.init()\n"
        "x = torch.full((4,), float(ctx.rank + 1), device=ctx.device)\n"
        "total = hvd.allreduce(x, op=hvd.Sum, name='probe')\n"
        "print(f'PROBE rank={ctx.rank} local_rank={ctx.local_rank} device={ctx.device} '\n"
        "      f'current={torch.cuda.current_device()} result_device={total.device} sum={total[0].item():g}')\n")
    run = ok(horovodrun(NP, [probe], timeout=120, env={**ENV, "PYTHONPATH": str(SCRIPTS)}))
    lines = re.findall(r"PROBE (.*)", run.output)
    assert len(lines) == NP, run.describe()
    expected_sum = NP * (NP + 1) // 2
    for rank in range(NP):
        assert (f"rank={rank} local_rank={rank} device=cuda:{rank} current={rank} "
                f"result_device=cuda:{rank} sum={expected_sum:g}") in lines, run.describe()


def test_cnn_amp_with_gradscaler_and_two_batches_per_allreduce(tmp_path):
    out = tmp_path / "amp"
    run = cnn(["--amp", "--batches-per-allreduce", "2", "--epochs", "1", "--max-steps", "12",
               "--checkpoint-every", "6", "--no-resume"], out)
    assert "device cuda, precision fp16 (requested)" in run.output, run.describe()  # --amp: fp16
    state = checkpoint_at(out, 12)
    # GradScaler was on: its state (the loss scale) is part of the checkpoint.
    assert state["scaler"] and state["scaler"]["scale"] > 0, state["scaler"]
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert results(out)["train_loss"] == results(out)["train_loss"]  # not NaN


def test_cnn_channels_last_keeps_conv_weights_nhwc(tmp_path):
    for flag, nhwc in (("--channels-last", True), ("--no-channels-last", False)):
        out = tmp_path / flag
        cnn([flag, "--epochs", "1", "--max-steps", "4", "--no-resume"], out)
        weights = [t for t in checkpoint_at(out, 4)["model"].values() if t.dim() == 4]
        # (Kernels with one input channel or 1x1 pixels are contiguous in both layouts.)
        telling = [t for t in weights if t.shape[1] > 1 and t.shape[2:] != (1, 1)]
        assert telling and all(t.is_contiguous(memory_format=torch.channels_last) == nhwc
                               for t in telling), flag


def test_cnn_resume_with_amp_matches_an_uninterrupted_run(tmp_path):
    """12 steps == 6, a new launch, 6 more: weights and GradScaler state carried over."""
    common = ["--amp", "--epochs", "1", "--checkpoint-every", "6"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    cnn([*common, "--max-steps", "12"], whole)
    cnn([*common, "--max-steps", "6"], parts)
    second = cnn([*common, "--max-steps", "12"], parts)
    assert "(step 6)" in second.output, second.describe()
    expected, actual = checkpoint_at(whole, 12), checkpoint_at(parts, 12)
    assert actual["scaler"]["scale"] == expected["scaler"]["scale"]
    # cuDNN may pick different (equally valid) kernels per launch: allow rounding noise.
    assert max_difference(expected["model"], actual["model"]) < 1e-4


def test_the_example_trainer_on_cuda_in_fp16_resumes_exactly(tmp_path):
    """scripts/train_signals.py, the trainer docs/adapting.md has users copy: on the GPU, fp16 with its
    GradScaler (in the checkpoint), stopped after step 5 and resumed == uninterrupted."""
    common = [SCRIPTS / "train_signals.py", "--precision", "fp16", "--samples", "256", "--length", "32",
              "--epochs", "2", "--batch-size", "16", "--checkpoint-every", "4"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    first = ok(horovodrun(NP, [*common, "--output-dir", whole], timeout=300, env=ENV))
    assert "device cuda, precision fp16" in first.output, first.describe()
    ok(horovodrun(NP, [*common, "--stop-after", "5", "--output-dir", parts], timeout=300, env=ENV))
    ok(horovodrun(NP, [*common, "--output-dir", parts], timeout=300, env=ENV))
    steps = results(whole)["steps"]
    expected, actual = checkpoint_at(whole, steps), checkpoint_at(parts, steps)
    assert expected["scaler"]["scale"] > 0 and actual["scaler"]["scale"] == expected["scaler"]["scale"]
    assert max_difference(expected["model"], actual["model"]) < 1e-4


def test_bert_fp16_gradscaler_with_clipping_and_accumulation(bert_data, tmp_path):
    out = tmp_path / "fp16"
    run = bert(bert_data, out, ["--precision", "fp16", "--accumulation-steps", "2", "--max-grad-norm", "1.0",
                                "--steps", "8", "--checkpoint-every", "0", "--no-resume"])
    assert "precision fp16 (requested)" in run.output, run.describe()
    state = checkpoint_at(out, 8)
    assert state["scaler"] and state["scaler"]["scale"] > 0, state["scaler"]
    done = results(out)
    assert done["completed"] and done["final_mlm_loss"] == done["final_mlm_loss"], done  # finished, not NaN


def test_bert_bf16_autocast_without_gradscaler(bert_data, tmp_path):
    require(torch.cuda.is_bf16_supported(), "bf16 support on this GPU", "run it on an Ampere or newer GPU")
    out = tmp_path / "bf16"
    run = bert(bert_data, out, ["--precision", "bf16", "--steps", "6", "--checkpoint-every", "0", "--no-resume"])
    assert "precision bf16 (requested)" in run.output, run.describe()
    assert not checkpoint_at(out, 6)["scaler"]  # GradScaler is only for fp16
    done = results(out)
    assert done["completed"] and done["final_mlm_loss"] < done["initial_mlm_loss"] * 1.5, done


def test_bert_compile_trains(bert_data, tmp_path):
    out = tmp_path / "compiled"
    bert(bert_data, out, ["--compile", "--precision", "fp32", "--steps", "4", "--checkpoint-every", "0",
                          "--no-resume"], timeout=900)
    done = results(out)
    assert done["completed"] and done["steps"] == 4, done


def test_bert_resume_restores_the_cuda_rng(bert_data, tmp_path):
    """Dropout draws from the CUDA generator: 8 steps == 3, stop, resume to 8; and
    the same resume from a checkpoint whose CUDA RNG states were replaced differs."""
    common = ["--precision", "fp32", "--accumulation-steps", "2", "--steps", "8", "--checkpoint-every", "0"]
    whole, parts, control = tmp_path / "whole", tmp_path / "parts", tmp_path / "control"
    bert(bert_data, whole, common)
    bert(bert_data, parts, [*common, "--stop-after", "3"])
    stopped = checkpoint_at(parts, 3)
    rng_states = [rank["rng"] for rank in stopped["ranks"]]
    assert len(rng_states) == NP and all("cuda" in state for state in rng_states)

    # The control: the step-3 checkpoint with other CUDA generator states.
    control.mkdir()
    # (A CUDA generator state is its seed's 8 bytes, then the offset's 8 bytes.)
    for state in rng_states:
        other = state["cuda"].clone()
        other[:8] = (other[:8].int() + 101).remainder(256).to(torch.uint8)  # another seed
        state["cuda"] = other
    torch.save(stopped, checkpoint_file(control, 3))

    resumed = bert(bert_data, parts, common)
    assert "at step 3" in resumed.output, resumed.describe()
    bert(bert_data, control, common)
    expected = checkpoint_at(whole, 8)["model"]
    resumed_error = max_difference(expected, checkpoint_at(parts, 8)["model"])
    control_error = max_difference(expected, checkpoint_at(control, 8)["model"])
    # GPU kernels (atomics in backward passes) are not all bit-reproducible, so allow
    # rounding noise, but far less than what other dropout masks make.
    assert resumed_error < 1e-5, resumed_error
    assert control_error > 100 * max(resumed_error, 1e-7), (resumed_error, control_error)
