"""A run resumed on another number of ranks: with --global-batch the weights of an uninterrupted run.

The model and optimizer are replicated, so what a resize must keep exact is the data position (a
prefix of the epoch's order, counted in samples), the samples per step and the LR: the run stopped at
one size and finished at another trains the weights of the run that never stopped (fp32, 1e-5).
`make test` proves it for the CNN at 2 <-> 1 ranks; `make test-scale` for both trainers at 4 <-> 2 and
BERT at 2 <-> 1. Without --global-batch the per-rank batch stays and the global batch follows the
size: tests/test_checkpoints.py's resume contract.
"""
import pytest

from support.bert_data import make_small_static_data, write_no_dropout_config
from support.checks import ok
from support.commands import CNN, PRETRAIN
from support.launch import horovodrun
from support.weights import EXACT, assert_same_weights, checkpoint_at

SIZES = [pytest.param(2, 1, id="2-1"), pytest.param(4, 2, id="4-2", marks=pytest.mark.scale)]
# BERT's global position without --elastic: 4 <-> 2 in `make test-scale` only (`make test` proves the
# same data path resized under --elastic, test_elastic_batch.py, and the CNN's resize here).
BERT_SIZES = [pytest.param(2, 1, id="2-1", marks=pytest.mark.scale), SIZES[1]]


def resized_runs_equal_the_steady_one(tmp_path, command, large, small, stop_after, last_step):
    """``command`` uninterrupted on ``small`` ranks; stopped at ``stop_after`` on one size and finished
    on the other, both ways: the three final checkpoints hold the same weights."""
    steady = tmp_path / "steady"
    ok(horovodrun(small, [*command, "--output-dir", steady], timeout=300))
    for first, then in ((large, small), (small, large)):
        out = tmp_path / f"{first}-to-{then}"
        ok(horovodrun(first, [*command, "--output-dir", out, "--stop-after", str(stop_after)], timeout=300))
        resumed = ok(horovodrun(then, [*command, "--output-dir", out], timeout=300))
        assert f"checkpoint on {then} from {out}: --global-batch" in resumed.output, resumed.describe()
        assert_same_weights(checkpoint_at(out, last_step), checkpoint_at(steady, last_step),
                            f"{first} then {then} ranks against {small} throughout")


@pytest.mark.parametrize("large, small", SIZES)
def test_a_cnn_resumed_on_another_number_of_ranks_trains_the_weights_of_an_uninterrupted_run(
        need_horovod, tmp_path, large, small):
    # 1438 digits in steps of 32: 45 steps, the last of 30; stopped mid-epoch.
    command = [CNN, "--model", "convnet", "--image-size", "8", *EXACT, "--epochs", "1", "--lr", "0.01",
               "--global-batch", "32"]
    resized_runs_equal_the_steady_one(tmp_path, command, large, small, stop_after=17, last_step=45)


@pytest.mark.parametrize("large, small", BERT_SIZES)
def test_bert_resumed_on_another_number_of_ranks_trains_the_weights_of_an_uninterrupted_run(
        need_horovod, tmp_path, large, small):
    # Bins of 4 and 77 instances: an epoch of steps of 4, 16 and 13; stopped mid-epoch, the next one crossed.
    data = make_small_static_data(tmp_path, bin_size=16)
    command = [PRETRAIN, "--data", data, "--config", write_no_dropout_config(tmp_path / "config.json"), *EXACT,
               "--global-batch", "16", "--steps", "9", "--lr", "1e-3", "--log-every", "1", "--checkpoint-every", "0"]
    resized_runs_equal_the_steady_one(tmp_path, command, large, small, stop_after=3, last_step=9)
