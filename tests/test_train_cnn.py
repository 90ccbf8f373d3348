"""scripts/train_cnn.py under real launches: accuracy, np-invariance, exact resume,
image folders of every Pillow mode, preemption signals and bad input."""
import json
import re
import shutil
import sys

import numpy as np
import pytest
import torch

from hvdtrain.runtime import precision
from support.checkpoints import CHECKPOINT_GLOB, best_file, checkpoint_files
from support.checks import ok, one_error_line
from support.image_data import make_cifar10, make_image_folder
from support.launch import SCRIPTS, horovodrun, launch, python
from support.weights import EXACT, assert_same_weights, checkpoint_at

SCRIPT = str(SCRIPTS / "train_cnn.py")

pytestmark = pytest.mark.usefixtures("need_horovod")


def train(np, args, out, timeout=240, transport="gloo"):
    """One launch of the trainer writing to ``out``; asserts it succeeded."""
    return ok(horovodrun(np, [SCRIPT, "--output-dir", out, *args], timeout=timeout, transport=transport))


def test_default_data_reaches_95_percent(tmp_path):
    """`make demo`'s command: two workers, every default, embedded digits data."""
    out = tmp_path / "demo"
    run = train(2, ["--no-resume"], out, timeout=420)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # --precision auto: what this machine runs natively
    assert f"device {device}, {precision.resolve('auto', device, cuda_auto='fp16').line()}" in run.output
    results = json.loads((out / "results.json").read_text())
    assert results["val_top1"] >= 0.95, results
    assert results["world_size"] == 2 and results["dataset"] == "digits"
    assert results["images_per_sec"] > 0 and results["steps"] > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(1, results["epochs"] + 1))
    for field in ("epoch", "step", "lr", "train_loss", "train_top1", "val_loss", "val_top1",
                  "val_top5", "images_per_sec", "epoch_seconds"):
        assert all(field in row for row in rows), field
    assert rows[-1]["val_top1"] == results["val_top1"]
    # 359 validation images, each counted once: top-1 is a multiple of 1/359.
    assert abs(results["val_top1"] * 359 - round(results["val_top1"] * 359)) < 1e-6
    assert best_file(out).is_file() and len(checkpoint_files(out)) == 3
    # Rank 0's collective moments, timed (tools/scale_study.py reads them at 1-32 ranks).
    moments = results["durations"]
    assert moments["checking that the ranks agree"]["count"] == 1, moments
    saved = moments["writing a checkpoint"]["count"]
    assert saved >= results["epochs"] and moments["gathering the ranks' checkpoint entries"]["count"] == saved, moments
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # The reported accuracy is the saved model's: best.pt, evaluated in this one
    # process, scores the best epoch's val_top1 (BatchNorm statistics averaged).
    assert saved_model_top1(best_file(out)) == pytest.approx(results["best_val_top1"], abs=1e-9)


def saved_model_top1(path):
    from hvdtrain.data import images
    from hvdtrain.models import resnet
    state = torch.load(path, weights_only=True)
    _, val_set, classes, channels = images.load("digits", None, None, 42, 0)
    model = resnet.build(state["settings"]["model"], classes, channels)
    model.load_state_dict(state["model"])
    model.eval()
    inputs = torch.stack([val_set[i][0] for i in range(len(val_set))])
    labels = torch.tensor([val_set[i][1] for i in range(len(val_set))])
    with torch.no_grad():
        return (model(inputs).argmax(dim=1) == labels).sum().item() / len(labels)


def test_two_workers_equal_one_worker_with_the_same_global_batch(tmp_path):
    """np-invariance, a model without BatchNorm: 2 x 8 == 1 x 16 == 1 x 8 x 2 passes.

    The used LR is lr x workers x batches-per-allreduce, so --lr is set to give
    0.1 in every run.
    """
    common = ["--model", "convnet", *EXACT, "--max-steps", "20", "--checkpoint-every", "10", "--no-resume"]
    runs = {"2x8": (2, ["--batch-size", "8", "--lr", "0.05"]),
            "1x16": (1, ["--batch-size", "16", "--lr", "0.1"]),
            "1x8x2": (1, ["--batch-size", "8", "--batches-per-allreduce", "2", "--lr", "0.05"])}
    for name, (np_, args) in runs.items():
        train(np_, [*common, *args], tmp_path / name)
    reference = {step: checkpoint_at(tmp_path / "2x8", step) for step in (10, 20)}
    for name in ("1x16", "1x8x2"):
        for step in (10, 20):
            assert_same_weights(checkpoint_at(tmp_path / name, step), reference[step], f"{name} step {step}")
    # The steps in between moved the weights far beyond that tolerance.
    moved = max((reference[20]["model"][k] - reference[10]["model"][k]).abs().max().item()
                for k in reference[20]["model"])
    assert moved > 1e-3


def test_three_workers_train_the_same_weights_bit_for_bit_whatever_horovods_cycle_time(tmp_path):
    """The same 3-rank job with a 1 s and a 0.1 ms HOROVOD_CYCLE_TIME (a knob `benchmark.py tune` turns).

    Horovod fuses the gradients a cycle finds ready (at 1 s: all of a step's, at 0.1 ms: one
    by one), and from three ranks on an element's place in the fused buffer decides the order
    the ring sums it in: without fixed buckets (dist.fixed_gradient_buckets) the two runs'
    weights differed by rounding after the first step, and more each step after.
    """
    common = [SCRIPT, "--model", "convnet", *EXACT, "--batch-size", "8", "--max-steps", "20",
              "--checkpoint-every", "20", "--no-resume"]
    for cycle_ms in ("1000", "0.1"):
        ok(horovodrun(3, [*common, "--output-dir", tmp_path / cycle_ms], timeout=240,
                      env={"HOROVOD_CYCLE_TIME": cycle_ms}))
    slow, fast = checkpoint_at(tmp_path / "1000", 20), checkpoint_at(tmp_path / "0.1", 20)
    for key, value in slow["model"].items():
        assert torch.equal(fast["model"][key], value), (key, (fast["model"][key] - value).abs().max().item())


# Stop and resume = the uninterrupted run, bit for bit: test_checkpoints.py (its rows and weights).


def test_image_folder_of_mixed_modes_trains_one_epoch_under_mpi(tmp_path, need_mpi):
    """Also: DataLoader workers come from a fork server that imported torch once per rank
    (it had each of them import torch again, 1.7 CPU-s a worker, every epoch)."""
    data = make_image_folder(tmp_path / "images")
    out = tmp_path / "out"
    run = ok(horovodrun(2, [SCRIPT, "--output-dir", out, "--dataset", "imagefolder", "--data", data,
                            "--model", "resnet18", "--image-size", "32", "--batch-size", "2", "--epochs", "1",
                            "--workers", "1", "--no-resume"], timeout=240, transport="mpi",
                        env={"PYTHONPROFILEIMPORTTIME": "1"}))
    # Two ranks and their two fork servers import torch; the four workers (train and val) do not.
    assert len(re.findall(r"\| torch$", run.output, re.MULTILINE)) == 4, run.output.count("\n")
    assert "12 train / 6 val images, 3 classes" in run.output, run.describe()
    results = json.loads((out / "results.json").read_text())
    assert results["epochs"] == 1 and results["steps"] == 3 and results["world_size"] == 2
    # An epoch shorter than the 5 warm-up steps is rated over its steps, not reported as 0.
    assert results["images_per_sec"] > 0
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["images_per_sec"] > 0, row
    # 6 validation images split 3 + 3 over the ranks: accuracy is a multiple of 1/6.
    assert abs(results["val_top1"] * 6 - round(results["val_top1"] * 6)) < 1e-6


def test_cifar10_with_fp16_allreduce_accumulation_and_step_decay(tmp_path):
    """--fp16-allreduce, 2 backward passes per allreduce, gradient predivision,
    label smoothing and step decay together, on CIFAR-10's file format; in the
    channels_last layout (CUDA's default), whose weights and gradients Horovod
    refused as not contiguous until collectives.broadcast_parameters/gradient_compression."""
    out = tmp_path / "out"
    train(2, ["--dataset", "cifar10", "--data", make_cifar10(tmp_path / "cifar"), "--epochs", "2",
              "--channels-last", "--batch-size", "4", "--batches-per-allreduce", "2", "--fp16-allreduce",
              "--gradient-predivide-factor", "2", "--label-smoothing", "0.1", "--lr", "0.1",
              "--lr-decay", "step", "--lr-milestones", "1", "--no-resume"], out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # 100 images // (2 workers x 4 x 2 passes) = 6 steps per epoch; LR 0.1 x 2 x 2
    # after one warmup epoch, then x 0.1 from the milestone at epoch 1.
    assert [row["step"] for row in rows] == [6, 12]
    assert [row["lr"] for row in rows] == pytest.approx([0.4, 0.04])
    assert all(np.isfinite(row["train_loss"]) for row in rows)
    results = json.loads((out / "results.json").read_text())
    assert results["global_batch_size"] == 16 and results["epochs"] == 2
    kernels = [t for t in checkpoint_at(out, 12)["model"].values() if t.dim() == 4 and t.shape[1] > 1]
    assert kernels and all(t.is_contiguous(memory_format=torch.channels_last) for t in kernels)


def test_adasum_under_mpi(tmp_path, need_mpi):
    out = tmp_path / "out"
    train(2, ["--use-adasum", "--model", "convnet", "--max-steps", "4", "--no-resume"], out,
          transport="mpi")
    weights = checkpoint_at(out, 4)["model"]
    assert all(torch.isfinite(value).all() for value in weights.values())


def test_signal_to_one_rank_checkpoints_and_exits_zero_on_every_rank(tmp_path):
    """SIGUSR1 to rank 1 only (Slurm may signal ranks at different moments): every
    rank stops after the same step, rank 0 writes the checkpoint, all exit 0."""
    out = tmp_path / "out"
    ranks = rf"^\S*python\S* \S*train_cnn\.py .*{re.escape(str(out))}"
    script = f"""
        horovodrun -np 2 --gloo {sys.executable} {SCRIPT} --output-dir {out} \\
            --image-size 8 --batch-size 8 --epochs 5 --checkpoint-every 5 &
        launcher=$!
        until ls {out}/{CHECKPOINT_GLOB} >/dev/null 2>&1; do sleep 0.1; done
        for pid in $(pgrep -f '{ranks}'); do
            if tr '\\0' '\\n' < /proc/$pid/environ | grep -qx HOROVOD_RANK=1; then
                kill -USR1 $pid
            fi
        done
        wait $launcher
    """
    run = launch(["bash", "-c", script], timeout=240)
    ok(run)
    match = re.search(r"stopped by SIGUSR1 \(rank 1\) at step (\d+)", run.rank_output(0))
    assert match, run.describe()
    step = int(match.group(1))
    state = checkpoint_at(out, step)
    # Signals are checked (collectively) every 10 steps.
    assert state["train_state"]["step"] == step < 5 * 89 and step % 10 == 0 and len(state["ranks"]) == 2
    assert json.loads((out / "results.json").read_text())["completed"] is False


# An image folder long enough to signal mid-run: 60 training images, 15 steps
# per epoch on 2 ranks, DataLoader workers restarted every epoch.
SIGNALLED_FOLDER_RUN = ["--dataset", "imagefolder", "--model", "convnet", "--image-size", "16",
                        "--batch-size", "2", "--workers", "2", "--epochs", "20", "--checkpoint-every", "5"]


def test_usr1_to_mpirun_with_dataloader_workers_checkpoints_and_resumes(tmp_path, need_mpi):
    """mpirun passes USR1 to each rank's whole process group, DataLoader workers
    included: the workers must leave it to their rank, and every rank stops
    after the same step, checkpoints and exits 0; a relaunch resumes."""
    data = make_image_folder(tmp_path / "images", train_per_class=20)
    out = tmp_path / "out"
    command = ["mpirun", "-np", "2", sys.executable, SCRIPT, "--data", data, "--output-dir", out,
               *SIGNALLED_FOLDER_RUN]
    # Signal once the first periodic checkpoint shows the workers delivering batches.
    script = f"""
        {' '.join(map(str, command))} &
        launcher=$!
        until ls {out}/{CHECKPOINT_GLOB} >/dev/null 2>&1 || ! kill -0 $launcher 2>/dev/null; do sleep 0.1; done
        kill -USR1 $launcher
        wait $launcher
    """
    run = launch(["bash", "-c", script], timeout=240)
    ok(run)
    assert "Traceback" not in run.output and "exited unexpectedly" not in run.output, run.describe()
    match = re.search(r"stopped by SIGUSR1 \(rank \d\) at step (\d+)", run.output)
    assert match, run.describe()
    step = int(match.group(1))
    assert checkpoint_at(out, step)["train_state"]["step"] == step < 20 * 15
    assert json.loads((out / "results.json").read_text())["completed"] is False

    resumed = launch([*command, "--max-steps", step + 2], timeout=240)
    ok(resumed)
    assert f"(step {step})" in resumed.output and "resuming at epoch" in resumed.output, resumed.describe()
    assert json.loads((out / "results.json").read_text())["steps"] == step + 2


def test_a_killed_ranks_dataloader_workers_end_with_it(tmp_path):
    """A rank killed outright (SIGKILL, an OOM kill, a launcher's abort) shuts no DataLoader down:
    its workers, which ignore SIGTERM and whose parent is the fork server (which they keep alive),
    must notice the rank is gone and end, and the fork server with them; nothing is left behind."""
    out = tmp_path / "out"
    script = f"""
        {sys.executable} {SCRIPT} --output-dir {out} --image-size 8 --workers 2 --epochs 50 --checkpoint-every 5 &
        rank=$!
        until ls {out}/{CHECKPOINT_GLOB} >/dev/null 2>&1 || ! kill -0 $rank 2>/dev/null; do sleep 0.1; done
        helpers=$(pgrep -P $rank | tr '\n' ' ')  # the fork server, the resource tracker
        workers=$(for p in $helpers; do pgrep -P $p; done | tr '\n' ' ')
        kill -KILL $rank
        for i in $(seq 150); do
            left=$(for p in $helpers $workers; do kill -0 $p 2>/dev/null && echo $p; done | tr '\n' ' ')
            [ -z "$left" ] && break
            sleep 0.1
        done
        echo "workers: [$workers] left after the rank's kill: [$left]"
    """
    run = launch(["bash", "-c", script], timeout=120)
    match = re.search(r"workers: \[(.*)\] left after the rank's kill: \[(.*)\]", run.output)
    assert match and match.group(1).split(), run.describe()
    assert match.group(2).strip() == "", run.describe()


def test_dataloader_workers_import_the_ranks_package_not_another_on_the_path(tmp_path):
    """The workers run the rank's hvdtrain, not one that PYTHONPATH or a .pth file puts first (another
    checkout, an older copy): Python 3.11's fork server is handed the rank's sys.path and ignores it."""
    decoy, imported = tmp_path / "elsewhere" / "hvdtrain", tmp_path / "the other copy was imported"
    shutil.copytree(SCRIPTS / "hvdtrain", decoy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(decoy / "__init__.py", "a") as init:
        init.write(f"\nopen({str(imported)!r}, 'a').write(__import__('os').getpid().__str__() + ' ')\n")
    ok(python([SCRIPT, "--output-dir", tmp_path / "out", "--image-size", "8", "--workers", "1",
               "--max-steps", "2"], timeout=120, env={"PYTHONPATH": str(decoy.parent)}))
    assert not imported.exists(), f"processes {imported.read_text()} imported {decoy}"


def write_bad_file(folder):
    (folder / "train" / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")


BAD_INPUT = {
    "missing data dir": (lambda d: d / "absent", [], "data directory not found"),
    "empty data dir": (lambda d: _made(d / "empty"), [], "data directory is empty"),
    "class folder without images": (
        lambda d: _emptied(make_image_folder(d / "images"), "fox"), [],
        "class folder {data}/train/fox has no images"),
    "corrupt image": (
        lambda d: _corrupted(make_image_folder(d / "images")), [],
        "cannot read image {data}/train/dog/broken.jpg"),
    "more workers than samples": (
        lambda d: make_image_folder(d / "images", classes=("one",), train_per_class=1), [],
        "more workers than training samples: 2 workers, 1 samples"),
    "more loader workers than samples": (
        lambda d: make_image_folder(d / "images"), ["--workers", "7", "--batch-size", "2"],
        "--workers 7: more DataLoader workers than the 6 training samples each rank loads"),
    "batch size 0": (None, ["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    "unknown model": (None, ["--model", "vgg11"], "argument --model: invalid choice: 'vgg11'"),
}


def _made(folder):
    folder.mkdir()
    return folder


def _emptied(root, name):
    for path in (root / "train" / name).iterdir():
        path.unlink()
    (root / "train" / name / "notes.txt").write_text("not an image")
    return root


def _corrupted(root):
    write_bad_file(root)
    return root


@pytest.mark.parametrize("case", BAD_INPUT, ids=list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_status_2_on_every_rank(tmp_path, case):
    make_data, extra, message = BAD_INPUT[case]
    args = [SCRIPT, "--output-dir", tmp_path / "out", *extra]
    data = None
    if make_data is not None:
        data = make_data(tmp_path)
        args += ["--dataset", "imagefolder", "--data", data, "--model", "convnet", "--image-size", "16"]
    run = horovodrun(2, args, timeout=120)
    assert not run.timed_out, run.describe()
    message = message.format(data=data)
    # horovodrun (Gloo) itself exits 1 and names the first rank that failed and its status,
    # in one line: the project's patch to its launcher (upstream prints a traceback).
    assert re.search(r"horovodrun: error: .*Exit code: 2\b", run.output), run.describe()
    one_error_line(run, "train_cnn.py: error:", message)



def test_the_one_error_line_comes_even_when_the_printing_rank_starts_last(tmp_path):
    """Only rank 0 prints a bad-input line; rank 1 parses the same arguments and must not
    exit (the launcher then kills the job) before rank 0 has printed. Rank 0 starts 3 s late."""
    late = tmp_path / "rank0_late.sh"
    late.write_text('[ "$HOROVOD_RANK" = 0 ] && sleep 3\nexec "$@"\n')
    run = launch(["horovodrun", "-np", "2", "--gloo", "bash", late, sys.executable, SCRIPT, "--batch-size", "0"],
                 timeout=60)
    assert re.search(r"horovodrun: error: .*Exit code: 2\b", run.output), run.describe()
    one_error_line(run, "train_cnn.py: error:", "must be at least 1, got 0")

def test_mpirun_exit_status_is_2_for_a_corrupt_image(tmp_path, need_mpi):
    """mpirun passes the ranks' status through: exactly 2, and both ranks exit."""
    data = _corrupted(make_image_folder(tmp_path / "images"))
    run = launch(["mpirun", "-np", "2", sys.executable, SCRIPT,
                  "--dataset", "imagefolder", "--data", data, "--output-dir", tmp_path / "out"],
                 timeout=120)
    assert run.returncode == 2 and not run.timed_out, run.describe()
    assert f"cannot read image {data}/train/dog/broken.jpg" in run.output


def test_help_shows_defaults():
    run = python([SCRIPT, "--help"], timeout=60)
    ok(run)
    text_of_help = " ".join(run.output.split())  # undo argparse's line wrapping
    for text in ("--batches-per-allreduce", "--fp16-allreduce", "--use-adasum", "--sync-bn",
                 "(default: resnet20)", "(default: digits)", "--resume, --no-resume"):
        assert text in text_of_help, text
