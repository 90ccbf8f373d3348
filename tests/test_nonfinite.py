"""A NaN or Inf loss on one rank: every rank skips the same steps, or every rank stops.

Real horovodrun launches; the non-finite loss is injected on one rank at given
steps through HVDTRAIN_INJECT_NONFINITE (hvdtrain/testhooks.py), which
multiplies that rank's loss by NaN, so its gradients turn NaN too and Horovod's
average carries them to every rank, as a real divergence would.
"""
import json
import math
import re

import pytest
import torch

from hvdtrain import testhooks
from hvdtrain.runtime import nonfinite
from hvdtrain.errors import UsageError
from support.bert_data import make_small_static_data
from support.checkpoints import checkpoint_name, checkpoint_names
from support.checks import ok, one_error_line
from support.commands import CNN, PRETRAIN, QUICK_CNN
from support.launch import REPO, horovodrun
from support.weights import checkpoint_at

pytestmark = pytest.mark.usefixtures("need_horovod")

WORKER = REPO / "tests" / "workers" / "nonfinite_steps.py"
SKIPPED = re.compile(r"non-finite loss \(NaN or Inf\) at step (\d+) on rank (\d+): step skipped on every rank")


def inject(spec):
    return {testhooks.NONFINITE_ENV: spec}


def test_every_rank_skips_the_same_steps_and_keeps_equal_finite_weights():
    """The trainers' finish_step on 2 ranks, 2 backward passes per step: the worker
    checks that a skipped step leaves weights and momentum untouched on every rank."""
    run = ok(horovodrun(2, [WORKER], timeout=120, env=inject("rank=1,steps=3,4")))
    for rank in range(2):
        assert f"rank {rank}: skipped [3, 4]; weights finite and equal on every rank" in run.rank_output(rank), \
            run.describe()


def test_cnn_skips_the_bad_steps_and_finishes(tmp_path):
    out = tmp_path / "out"
    run = ok(horovodrun(2, [CNN, *QUICK_CNN, "--epochs", "1", "--output-dir", out], timeout=240,
                        env=inject("rank=1,steps=5,6")))
    assert [(int(s), int(r)) for s, r in SKIPPED.findall(run.rank_output(0))] == [(5, 1), (6, 1)], run.describe()
    results = json.loads((out / "results.json").read_text())
    assert results["completed"] and results["skipped_steps"] == 2, results
    assert math.isfinite(results["train_loss"]), results  # the skipped steps' NaN is not in the average
    saved = checkpoint_at(out, results['steps'])
    assert saved["train_state"]["skipped_steps"] == 2
    assert all(torch.isfinite(value).all() for value in saved["model"].values())


def test_cnn_stop_mode_ends_every_rank_with_one_line_naming_step_and_rank(tmp_path, need_mpi):
    """Under MPI the launcher returns the ranks' own status: 4, the non-finite loss code."""
    out = tmp_path / "out"
    run = horovodrun(2, [CNN, *QUICK_CNN, "--epochs", "1", "--checkpoint-every", "2", "--nonfinite-loss", "stop",
                         "--output-dir", out], timeout=240, transport="mpi", env=inject("rank=1,steps=3"))
    assert run.returncode == nonfinite.NONFINITE_EXIT, run.describe()
    one_error_line(run, "non-finite loss (NaN or Inf) at step 3 on rank 1", "--nonfinite-loss stop", status=nonfinite.NONFINITE_EXIT)
    # Nothing was saved after the bad step: the last checkpoint holds finite weights.
    assert checkpoint_names(out) == [checkpoint_name(2)]


def test_too_many_skipped_steps_in_a_row_stop_every_rank(tmp_path):
    """Skips on either rank; a good step ends a streak; the 3rd bad step in a row stops."""
    run = horovodrun(2, [CNN, *QUICK_CNN, "--epochs", "1", "--max-nonfinite-steps", "3",
                         "--output-dir", tmp_path / "out"], timeout=240,
                     env=inject("rank=0,steps=2,3;rank=1,steps=5,6,7"))
    # horovodrun --gloo exits 1 and names the first rank's status; both ranks exited 4.
    assert run.returncode != 0 and re.search(r"Exit code: 4\b", run.output), run.describe()
    one_error_line(run, "at step 7 on rank 1: 3 steps in a row (--max-nonfinite-steps 3)", status=nonfinite.NONFINITE_EXIT)
    skipped = [(int(s), int(r)) for s, r in SKIPPED.findall(run.rank_output(0))]
    assert skipped == [(2, 0), (3, 0), (5, 1), (6, 1)], run.describe()


def test_adasum_cannot_skip_so_it_stops(tmp_path, need_mpi):
    """Adasum applies the update inside backward: the step is past undoing."""
    run = horovodrun(2, [CNN, *QUICK_CNN, "--use-adasum", "--epochs", "1", "--output-dir", tmp_path / "out"],
                     timeout=240, transport="mpi", env=inject("rank=1,steps=2"))
    assert run.returncode == nonfinite.NONFINITE_EXIT, run.describe()
    one_error_line(run, "at step 2 on rank 1", "cannot be skipped", status=nonfinite.NONFINITE_EXIT)


def test_bert_skips_the_bad_steps_with_accumulation(tmp_path):
    data = make_small_static_data(tmp_path)
    out = tmp_path / "out"
    run = ok(horovodrun(2, [PRETRAIN, "--data", data, "--output-dir", out, "--model", "tiny", "--batch-size", "4",
                            "--accumulation-steps", "2", "--steps", "6", "--log-every", "1"], timeout=300,
                        env=inject("rank=1,steps=2,3")))
    assert [(int(s), int(r)) for s, r in SKIPPED.findall(run.rank_output(0))] == [(2, 1), (3, 1)], run.describe()
    results = json.loads((out / "results.json").read_text())
    assert results["completed"] and results["skipped_steps"] == 2 and results["steps"] == 6, results
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    # Skipped steps add nothing to the metrics: their rows are empty averages (NaN), the others finite.
    assert all(math.isfinite(row["mlm_loss"]) for row in rows if row["step"] not in (2, 3)), rows
    saved = checkpoint_at(out, 6)
    assert all(torch.isfinite(value).all() for value in saved["model"].values())


@pytest.mark.parametrize("text", ["rank=1", "rank=x,steps=1", "node=1,steps=2", "rank=1,steps=2,a"])
def test_a_malformed_injection_is_a_usage_error(text):
    with pytest.raises(UsageError, match=testhooks.NONFINITE_ENV):
        testhooks.parse_nonfinite(text)


def test_injection_groups_per_rank():
    assert testhooks.parse_nonfinite("rank=0,steps=2,3; rank=1,steps=5") == {0: {2, 3}, 1: {5}}
    assert testhooks.parse_nonfinite("") == {}
