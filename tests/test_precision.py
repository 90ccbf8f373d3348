"""--precision auto|fp32|bf16|fp16 (runtime/precision.py): what auto picks on which
hardware, the old --amp spellings, checkpoints from before --precision, and
bf16 CNN training on CPU under a real 2-rank launch."""
import argparse
import json
from dataclasses import fields

import pytest
import torch

from hvdtrain import options
from hvdtrain.errors import UsageError
from hvdtrain.runtime import precision
from hvdtrain.runtime.settings import resume_differences
from support.bert_data import make_small_static_data
from support.checkpoints import best_file
from support.checks import ok, one_error_line
from support.commands import PRETRAIN
from support.launch import SCRIPTS, horovodrun, python

CNN = str(SCRIPTS / "train_cnn.py")
AMX = {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
ZEN4 = {"fpu", "avx2", "avx512f", "avx512_bf16"}
NO_BF16 = {"fpu", "avx2", "fma", "f16c"}  # an AMD EPYC before Zen 4, or an Intel before Cooper Lake


@pytest.mark.parametrize("flags, name, reason", [
    (AMX, "bf16", "auto: the CPU has AMX"),
    (ZEN4, "bf16", "auto: the CPU has AVX512-BF16"),
    (NO_BF16, "fp32", "auto: the CPU has no native bf16"),
    (set(), "fp32", "auto: the CPU has no native bf16"),  # no /proc/cpuinfo (macOS)
])
def test_auto_on_cpu_takes_bf16_only_where_the_cpu_has_it(flags, name, reason):
    chosen = precision.resolve("auto", "cpu", flags=flags)
    assert (chosen.name, chosen.reason) == (name, reason)
    assert chosen.dtype == (torch.bfloat16 if name == "bf16" else None) and not chosen.scaler
    assert chosen.line() == f"precision {name} ({reason})"


def test_auto_on_cuda_is_each_trainers_own():
    cnn = precision.resolve("auto", "cuda", cuda_auto="fp16", cuda_bf16=True)
    assert (cnn.name, cnn.dtype, cnn.scaler) == ("fp16", torch.float16, True)  # as --amp always was
    assert precision.resolve("auto", "cuda", cuda_auto="bf16", cuda_bf16=True).name == "bf16"
    assert precision.resolve("auto", "cuda", cuda_auto="bf16", cuda_bf16=False).name == "fp32"
    # The CPU's flags do not matter on CUDA.
    assert precision.resolve("auto", "cuda", cuda_auto="bf16", flags=set(), cuda_bf16=True).name == "bf16"


def test_requested_precisions_and_what_the_cpu_cannot_run():
    assert precision.resolve("bf16", "cpu", flags=AMX).reason == "requested; the CPU has AMX"
    emulated = precision.resolve("bf16", "cpu", flags=NO_BF16)
    assert emulated.name == "bf16" and "emulated" in emulated.reason and "slower than fp32" in emulated.reason
    assert precision.resolve("fp32", "cpu", flags=AMX) == ("fp32", "requested")
    assert precision.resolve("fp16", "cuda") == ("fp16", "requested")
    with pytest.raises(UsageError, match=r"^--precision fp16 needs a CUDA device \(use bf16 or fp32 on CPU\)$"):
        precision.resolve("fp16", "cpu", flags=AMX)


def test_the_flags_come_from_proc_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                       "flags\t\t: fpu avx512_bf16 amx_bf16 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert precision.cpu_flags(cpuinfo) == {"fpu", "avx512_bf16", "amx_bf16", "amx_tile"}  # the first CPU's
    assert precision.native_cpu_bf16(precision.cpu_flags(cpuinfo)) == "AMX"
    assert precision.cpu_flags(tmp_path / "missing") == set()


def this_cpu_has_native_bf16():
    """Read independently of the helper: the flags words of /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as lines:
            words = next((line.split() for line in lines if line.startswith("flags")), [])
    except OSError:
        return None
    return "amx_bf16" in words and "AMX" or "avx512_bf16" in words and "AVX512-BF16" or None


def test_auto_on_this_machine_follows_its_cpuinfo():
    unit = this_cpu_has_native_bf16()
    chosen = precision.resolve("auto", "cpu")
    assert chosen.name == ("bf16" if unit else "fp32"), (unit, chosen)
    assert precision.description(chosen.name, "cpu") == chosen.line()  # the run's first line says why


def test_amp_flags_are_spellings_of_fp16_and_fp32():
    parser = argparse.ArgumentParser()
    options.add_precision_arguments(parser, cuda_auto="fp16", amp_alias=True)
    assert parser.parse_args([]).precision == "auto"
    assert parser.parse_args(["--amp"]).precision == "fp16"
    assert parser.parse_args(["--no-amp"]).precision == "fp32"
    assert parser.parse_args(["--precision", "bf16", "--no-amp"]).precision == "fp32"  # the later one wins
    assert not hasattr(parser.parse_args([]), "amp")  # one setting, not two


def test_a_checkpoint_from_before_precision_resumes():
    """Its settings hold amp on/off, no precision: read as fp16/fp32 and compared as such."""
    from hvdtrain.training.cnn import CnnSettings
    current = CnnSettings(**{**{item.name: 0 for item in fields(CnnSettings)}, "precision": "fp32"})
    old = {**dict(current), "amp": False}
    del old["precision"]
    assert resume_differences(old, current) == ([], [])
    refused, _ = resume_differences({**old, "amp": True}, current)
    assert refused == [("precision", "fp16", "fp32")]
    assert resume_differences(dict(current), current) == ([], [])  # today's checkpoints: unchanged


def first_line(run):
    return next(line for line in run.output.splitlines() if " steps/epoch; device " in line)


@pytest.mark.usefixtures("need_horovod")
def test_bf16_cnn_trains_on_cpu_with_two_ranks(tmp_path):
    """autocast(cpu, bfloat16), no GradScaler: the loss falls epoch by epoch as in fp32.

    The small convnet learns slowly (fp32 on this data: train loss 2.31, 2.20,
    2.05; val_top1 0.31 after 3 epochs), but it is quick in emulated bf16 too."""
    out = tmp_path / "bf16"
    run = horovodrun(2, [CNN, "--cpu", "--precision", "bf16", "--model", "convnet", "--epochs", "3", "--warmup-epochs", "0.2",
                         "--no-resume", "--output-dir", out], timeout=420)
    ok(run)
    expected = precision.resolve("bf16", "cpu").line()  # native or emulated, as this CPU is
    assert first_line(run).endswith(f"device cpu, {expected}"), run.describe()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [row["train_loss"] for row in rows]
    assert len(rows) == 3 and losses == sorted(losses, reverse=True) and losses[2] < losses[0] - 0.15, rows
    assert rows[2]["val_top1"] > 0.2, rows  # chance: 0.1
    state = torch.load(best_file(out), map_location="cpu", weights_only=True)
    assert state["settings"]["precision"] == "bf16" and "amp" not in state["settings"]
    assert all(value.dtype == torch.float32 for value in state["model"].values() if value.is_floating_point())


@pytest.mark.usefixtures("need_horovod")
def test_fp16_on_cpu_is_one_line_and_exit_2(tmp_path):
    for flags in (["--precision", "fp16"], ["--amp"]):
        run = horovodrun(2, [CNN, "--cpu", *flags, "--output-dir", tmp_path / "out"], timeout=120)
        line = one_error_line(run, "train_cnn.py: error:")
        assert line.endswith("--precision fp16 needs a CUDA device (use bf16 or fp32 on CPU)"), run.describe()


@pytest.mark.usefixtures("need_horovod")
def test_bert_auto_says_what_it_chose_and_bf16_trains_on_cpu(tmp_path):
    """pretrain_bert.py: auto follows this CPU (its first line says so); bf16 on CPU learns, no scaler."""
    data = make_small_static_data(tmp_path)
    quick = ["--data", data, "--model", "tiny", "--batch-size", "8", "--log-every", "5", "--checkpoint-every", "0",
             "--no-resume", "--cpu"]
    auto = ok(python([PRETRAIN, *quick, "--steps", "1", "--output-dir", tmp_path / "auto"], timeout=180))
    assert f", lamb, {precision.resolve('auto', 'cpu', flags=None).line()}" in auto.output, auto.describe()
    run = ok(python([PRETRAIN, *quick, "--precision", "bf16", "--steps", "30", "--lr", "1e-2",
                     "--output-dir", tmp_path / "bf16"], timeout=300))
    assert f", lamb, {precision.resolve('bf16', 'cpu').line()}" in run.output, run.describe()
    summary = json.loads((tmp_path / "bf16" / "results.json").read_text())
    assert summary["final_mlm_loss"] < summary["initial_mlm_loss"] - 0.5, summary
