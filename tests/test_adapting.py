"""Your own model and data (train_cnn.py --model/--dataset MODULE:CALLABLE) and your own trainer
(scripts/train_signals.py) keep every guarantee the shipped ones have: n ranks train what one
does, a resume goes on exactly, --elastic and --balance run them, bad input is one line.

The model and data set are written by the test (support/user_task.py): the project has never
seen them. docs/adapting.md's own commands run in test_readme.py.
"""
import json
import sys

import pytest

from support.checks import ok, one_error_line
from support.commands import CNN
from support.elastic_jobs import elastic_command, world_sizes, write_hosts
from support.launch import REPO, SCRIPTS, horovodrun, launch, python
from support.user_task import write_task
from support.weights import EXACT, assert_same_tensors, assert_same_weights, checkpoint_at

pytestmark = pytest.mark.usefixtures("need_horovod")

SIGNALS = SCRIPTS / "train_signals.py"


def test_a_hugging_face_model_on_dict_samples_trains_on_two_ranks_as_on_one_and_resumes_exactly(tmp_path, need_mpi):
    """A transformers ViT (its output a ModelOutput: the trainer reads .logits) on dict samples:
    2 ranks x 8 under horovodrun (DataLoader workers, stopped mid-epoch and relaunched) and under
    mpirun (uninterrupted) == 1 rank x 16: the user's module reaches forkserver workers by name,
    its random augmentation is keyed per sample (Python's, NumPy's and torch's generators), and
    the resume goes on at the next sample."""
    task = write_task(tmp_path, hugging_face=True)
    common = [CNN, *task, *EXACT, "--epochs", "3", "--checkpoint-every", "6", "--keep-checkpoints", "9"]
    two = tmp_path / "two"
    ok(horovodrun(2, [*common, "--batch-size", "8", "--lr", "0.05", "--workers", "1", "--stop-after", "8",
                      "--output-dir", two], timeout=240))
    resumed = ok(horovodrun(2, [*common, "--batch-size", "8", "--lr", "0.05", "--workers", "1",
                                "--output-dir", two], timeout=240))
    assert "resuming at epoch 1 sample 32 (step 8)" in resumed.output, resumed.describe()
    under_mpirun = tmp_path / "mpirun"  # the README's single-machine mpirun form
    ran = ok(launch(["mpirun", "-np", "2", "-hostfile", REPO / "hostfiles" / "localhost", "--bind-to", "none",
                     sys.executable, *common, "--batch-size", "8", "--lr", "0.05", "--output-dir", under_mpirun],
                    timeout=240))
    assert "2 workers x batch 8 = global batch 16" in ran.output, ran.describe()
    one = tmp_path / "one"
    alone = ok(python([*common, "--batch-size", "16", "--lr", "0.1", "--output-dir", one], timeout=240))
    assert "their_task.py:vit on" in alone.output and "note:" not in alone.output, alone.describe()
    assert_same_weights(checkpoint_at(two, 18), checkpoint_at(one, 18), "2 x 8 resumed against 1 x 16")
    assert_same_weights(checkpoint_at(two, 6), checkpoint_at(one, 6), "after the first epoch")
    assert_same_weights(checkpoint_at(under_mpirun, 18), checkpoint_at(one, 18), "2 x 8 under mpirun against 1 x 16")
    rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2, 3] and rows[-1]["val_top1"] > 0.8, rows


def test_their_model_runs_elastic_and_balanced(tmp_path):
    """--elastic (hvd.elastic.run, the model synced from rank 0) and --balance (unequal shares of each
    step) take a user's model and data as they take the presets."""
    task = write_task(tmp_path)
    hosts = tmp_path / "hosts"
    write_hosts(hosts, "localhost:2")
    elastic_run = ok(launch(elastic_command(hosts, 2, [CNN, *task, "--elastic", "--epochs", "2", "--batch-size", "8",
                                                       "--output-dir", tmp_path / "elastic"]), timeout=300))
    assert world_sizes(elastic_run) == [2], elastic_run.describe()
    assert json.loads((tmp_path / "elastic" / "results.json").read_text())["completed"]
    balanced = ok(horovodrun(2, [CNN, *task, "--balance", "--straggler-interval", "3", "--epochs", "2",
                                 "--batch-size", "8", "--output-dir", tmp_path / "balanced"], timeout=300))
    assert json.loads((tmp_path / "balanced" / "results.json").read_text())["completed"], balanced.describe()


def test_channels_last_leaves_inputs_that_are_not_images_as_they_are(tmp_path):
    """--channels-last (the default with CUDA) on 1-D signals and a Conv1d model: NHWC is for images
    only (the batch's .to(memory_format=channels_last) failed at the first step: rank 4 required)."""
    task = write_task(tmp_path)[1].rpartition(":")[0]
    ran = ok(python([CNN, "--model", f"{task}:conv1d", "--dataset", f"{task}:waves", "--channels-last",
                     "--epochs", "1", "--output-dir", tmp_path / "out"], timeout=120))
    assert json.loads((tmp_path / "out" / "results.json").read_text())["completed"], ran.describe()


def test_their_callables_take_keyword_arguments_recorded_in_the_checkpoint(tmp_path):
    """--model-arg and --dataset-arg reach the user's callables as keyword arguments (Python literals):
    said in the run's first line, recorded in the checkpoint's settings, a change refused on resume;
    with a preset, one line."""
    task = write_task(tmp_path)
    out = tmp_path / "out"
    common = [CNN, *task, "--epochs", "1", "--batch-size", "8", "--output-dir", out]
    ran = ok(python([*common, "--model-arg", "hidden=12", "--dataset-arg", "count=48", "--stop-after", "2"],
                    timeout=120))
    assert "their_task.py:build(hidden=12) on" in ran.output, ran.describe()
    assert "their_task.py:data(count=48): 48 train" in ran.output, ran.describe()
    saved = checkpoint_at(out, 2)
    assert saved["settings"]["model_arg"] == {"hidden": 12} and saved["settings"]["dataset_arg"] == {"count": 48}
    assert tuple(saved["model"]["1.weight"].shape) == (12, 72), saved["model"]["1.weight"].shape
    one_error_line(python([*common, "--model-arg", "hidden=16", "--dataset-arg", "count=48"], timeout=120),
                   "model_arg {'hidden': 12} -> {'hidden': 16}")
    one_error_line(python([CNN, "--model-arg", "hidden=12", "--output-dir", tmp_path / "preset"], timeout=60),
                   "--model-arg is for your own callable (MODULE:CALLABLE), not the preset resnet20")


YOUR_LOOP = REPO / "examples" / "your_loop" / "with_horovod.py"


def test_an_existing_loop_made_distributed_trains_on_two_ranks_as_on_one_and_resumes_exactly(tmp_path):
    """examples/your_loop/with_horovod.py, plain.py with the package's pieces added: 2 ranks stopped
    after step 40 and relaunched == 1 rank uninterrupted (the global batch the same); 3 ranks, which
    cannot share its batch, stop with one line."""
    two = tmp_path / "two"
    ok(horovodrun(2, [YOUR_LOOP, "--stop-after", "40", "--output-dir", two], timeout=120))
    resumed = ok(horovodrun(2, [YOUR_LOOP, "--output-dir", two], timeout=120))
    assert "epoch 3 loss" in resumed.output and "epoch 1 loss" not in resumed.output, resumed.describe()
    ok(python([YOUR_LOOP, "--output-dir", tmp_path / "one"], timeout=120))
    assert_same_weights(checkpoint_at(two, 96), checkpoint_at(tmp_path / "one", 96), "2 ranks resumed against 1")
    one_error_line(horovodrun(3, [YOUR_LOOP, "--output-dir", tmp_path / "three"], timeout=120),
                   "3 ranks cannot share a batch of 16: use a divisor of it")


@pytest.mark.parametrize("option, value, naming", [
    ("--model", "no_such_module:build", "--model no_such_module:build: cannot import no_such_module "
                                        "(ModuleNotFoundError"),
    ("--model", "{task}:missing", ":missing: their_task has no callable missing"),
    ("--model", "{task}:not_a_module", "not_a_module(num_classes, in_channels) returned str, not a torch.nn.Module"),
    ("--model", "{task}:wrong_width", "its output for a batch of 2 is (2, 4), not (2, 3)"),
    ("--model", "{task}:no_logits", "its output for a batch of 2 is dict, not (2, 3)"),
    ("--dataset", "{task}:not_a_pair", "a sample must be (input tensor, integer label)"),
    ("--dataset", "{task}:no_label", "sample 0: a dict sample needs one label key (labels or label) and one input"),
    ("--dataset", "{task}:two_values", "must return (train set, val set, number of classes), not tuple"),
    ("--model", "resnet21", "argument --model: invalid choice: 'resnet21' (choose from convnet"),
])
def test_their_code_that_does_not_fit_is_one_line(tmp_path, option, value, naming):
    task = write_task(tmp_path)[1].rpartition(":")[0]
    args = dict(zip(["--model", "--dataset"], [f"{task}:build", f"{task}:data"]))
    args[option] = value.format(task=task)
    one_error_line(python([CNN, *[item for pair in args.items() for item in pair],
                           "--output-dir", tmp_path / "out"], timeout=120), naming)


def test_a_data_set_its_workers_cannot_receive_is_one_line_before_the_first_step(tmp_path):
    """A torch.Generator held by the data set, here inside its augmentation: DataLoader's forkserver
    workers died at the first batch ("unable to resize file" in the worker, "DataLoader worker exited
    unexpectedly" in the rank)."""
    task = write_task(tmp_path)[1].rpartition(":")[0]
    one_error_line(python([CNN, "--model", f"{task}:build", "--dataset", f"{task}:torch_generator", "--workers", "1",
                           "--output-dir", tmp_path / "out"], timeout=120),
                   "its OwnTorchGenerator.jitter (Jitter) holds a torch.Generator, which a DataLoader worker "
                   "process cannot receive, and --workers 1 sends the data set to worker processes")


def test_every_rank_stops_with_the_one_line(tmp_path):
    task = write_task(tmp_path)[1].rpartition(":")[0]
    ran = horovodrun(2, [CNN, "--model", f"{task}:wrong_width", "--dataset", f"{task}:data",
                         "--output-dir", tmp_path / "out"], timeout=120)
    one_error_line(ran, "its output for a batch of 2 is (2, 4), not (2, 3)")


def test_randomness_no_key_reaches_is_said_in_one_line(tmp_path):
    """A data set drawing from a generator of its own cannot be resumed exactly: said at start."""
    task = write_task(tmp_path)[1].rpartition(":")[0]
    ran = ok(python([CNN, "--model", f"{task}:build", "--dataset", f"{task}:unkeyed", "--stop-after", "1",
                     "--output-dir", tmp_path / "out"], timeout=120))
    notes = [line for line in ran.output.splitlines() if "exact resume does not hold" in line]
    assert len(notes) == 1 and "sample 0 differs between two reads" in notes[0], ran.describe()


def test_the_example_trainer_resumes_exactly_and_says_bad_input_in_one_line(tmp_path):
    """scripts/train_signals.py, the trainer docs/adapting.md builds: stopped after step 5 of 12 and
    relaunched, bit for bit the uninterrupted run; a bad argument, one line on every rank."""
    common = [SIGNALS, "--samples", "128", "--length", "32", "--epochs", "3", "--batch-size", "16"]
    ok(horovodrun(2, [*common, "--stop-after", "5", "--output-dir", tmp_path / "parts"], timeout=240))
    ok(horovodrun(2, [*common, "--output-dir", tmp_path / "parts"], timeout=240))
    whole = ok(horovodrun(2, [*common, "--output-dir", tmp_path / "whole"], timeout=240))
    assert "val_mse" in whole.output and "results in" in whole.output, whole.describe()
    assert_same_tensors(checkpoint_at(tmp_path / "parts", 12)["model"], checkpoint_at(tmp_path / "whole", 12)["model"],
                        "stopped and resumed against uninterrupted")
    one_error_line(horovodrun(2, [*common, "--samples", "24", "--output-dir", tmp_path / "bad"], timeout=120),
                   "--samples 24 over 2 workers leave fewer than one batch of 16 each")
