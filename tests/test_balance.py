"""--balance: each rank's share of a fixed global batch follows its measured speed.

The gradient stays the mean over the global batch (per-rank sums, summed by
Horovod), so a balanced 2-rank run with a throttled rank trains the same
weights as one worker with the whole batch. BERT likewise, each loss divided by
the step's masked tokens and sequences on every rank.
"""
import json
import re
import sys

import pytest
import torch

from support.bert_data import all_instances, make_small_static_data, trained_instances
from support.checks import ok
from support.commands import CNN, PRETRAIN
from support.launch import horovodrun, launch, wait_then
from support.ranks import cpu_share, rank_pids, require_cpu_cgroup
from support.weights import EXACT, assert_same_weights, checkpoint_at

from hvdtrain.data.bert_elastic import cut
from hvdtrain.testhooks import RECORD_ENV
from hvdtrain.data.sampling import BalancedSampler
from hvdtrain.training.balance import Shares, split

SHARES_LINE = re.compile(r"--balance: samples per rank now \[(\d+), (\d+)\] \(step (\d+)\)")


def interval(*compute_seconds):
    return {"ranks": [{"compute_s": s, "data_s": 0.0} for s in compute_seconds]}


def test_split_is_proportional_whole_and_keeps_a_minimum():
    assert split(32, [1, 1], 1) == [16, 16]
    assert split(32, [3, 1], 1) == [24, 8]
    assert sum(split(33, [1, 1, 1, 0.001], 2)) == 33 and min(split(33, [1, 1, 1, 0.001], 2)) == 2
    assert cut(16, [12, 4], 1) == [12, 4] and cut(4, [12, 4], 1) == [2, 2] and cut(13, [12, 4], 2) == [8, 5]


def test_shares_follow_the_time_per_sample_and_ignore_small_gains():
    shares = Shares(size=2, step_batch=16, minimum=1)
    assert not shares.rebalance(interval(0.0100, 0.0101))  # within the noise: no change
    assert shares.rebalance(interval(0.010, 0.030))  # rank 1 takes 3x as long per sample
    assert shares.shares == [24, 8]
    restored = Shares(size=2, step_batch=16, minimum=1)
    restored.load_state_dict(shares.state_dict())
    assert restored.shares == [24, 8]
    other_world = Shares(size=4, step_batch=8, minimum=1)
    other_world.load_state_dict(shares.state_dict())  # another world size starts equal
    assert other_world.shares == [8, 8, 8, 8]


def test_balanced_sampler_trains_every_used_sample_once_at_changing_shares():
    shares = [16, 16]
    samplers = [BalancedSampler(100, rank, shares, seed=1) for rank in (0, 1)]
    seen = []
    for start, new in ((0, [16, 16]), (1, [20, 12]), (2, [5, 27])):
        shares[:] = new
        for sampler in samplers:
            sampler.set_epoch(0, start * 32)  # after `start` steps of 32
            steps = list(sampler)
            assert [len(s) for s in steps] == [new[sampler.rank]] * (3 - start)
            seen.extend(steps[0])
    assert sorted(seen) == sorted(torch.randperm(100, generator=torch.Generator().manual_seed(100_003))[:96].tolist())


def test_a_throttled_rank_gets_a_smaller_share_and_the_weights_equal_one_worker(tmp_path, need_horovod, need_mpi):
    """mpirun, 2 ranks x 16 with rank 1 at a fraction of a core and --balance, against 1 rank x 32 (convnet,
    no BatchNorm): the same weights at steps 30 and 60, though rank 1 trained fewer samples per step."""
    require_cpu_cgroup()
    common = ["--model", "convnet", "--image-size", "8", *EXACT, "--threads", "1", "--max-steps", "60",
              "--checkpoint-every", "30", "--straggler-interval", "10"]
    balanced, alone = tmp_path / "balanced", tmp_path / "alone"
    with cpu_share(0.1) as share:
        wait_then(lambda: (balanced / "run.lock").exists() and rank_pids(str(balanced), rank=1),
                  lambda: [share.add(pid) for pid in rank_pids(str(balanced), rank=1)], timeout=240)
        run = launch(["mpirun", "-np", "2", "--bind-to", "none", sys.executable, CNN, *common, "--batch-size", "16",
                      "--lr", "0.05", "--balance", "--output-dir", balanced], timeout=300)
    ok(run)
    changes = [tuple(map(int, m.groups())) for m in SHARES_LINE.finditer(run.output)]
    assert changes and changes[-1][1] < changes[-1][0], run.describe()
    ok(horovodrun(1, [CNN, *common, "--batch-size", "32", "--lr", "0.1", "--output-dir", alone], timeout=240))
    for step in (30, 60):
        assert_same_weights(checkpoint_at(balanced, step), checkpoint_at(alone, step), f"step {step}")
    assert checkpoint_at(balanced, 60)["balance"]["shares"] == list(changes[-1][:2])


@pytest.mark.parametrize("extra", [["--elastic"], ["--use-adasum"], ["--straggler-interval", "0"]])
def test_balance_refuses_what_it_cannot_combine_with(tmp_path, extra, need_horovod):
    run = launch([sys.executable, CNN, "--balance", *extra, "--output-dir", tmp_path], timeout=120)
    assert run.returncode == 2, run.describe()
    assert "--balance needs the ranks' timings" in run.output, run.describe()


BERT_SHARES = re.compile(r"--balance: instances per rank now \[(\d+), (\d+)\] \(step (\d+)\)")
NO_DROPOUT = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512,
              "max_position_embeddings": 512, "type_vocab_size": 2,
              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # dropout masks are per rank


def test_bert_throttled_rank_gets_fewer_instances_and_the_weights_equal_one_worker(tmp_path, need_horovod):
    """pretrain_bert.py --balance, 2 ranks x 8 with rank 1 at a fraction of a core, against 1 rank x 16
    (length bins, static masking, no dropout): the same weights at steps 15 and 30, every instance once
    per epoch (the recorded ids), the shares in the checkpoint."""
    require_cpu_cgroup()
    data = make_small_static_data(tmp_path, bin_size=16)  # 6 steps per epoch: 4, 4 x 16 and 13 instances
    (tmp_path / "config.json").write_text(json.dumps(NO_DROPOUT))
    common = [PRETRAIN, "--data", data, "--config", tmp_path / "config.json", *EXACT, "--balance", "--steps", "30",
              "--lr", "1e-3", "--threads", "1", "--log-every", "1", "--checkpoint-every", "15",
              "--straggler-interval", "5"]
    balanced, alone, record = tmp_path / "balanced", tmp_path / "alone", tmp_path / "record"
    with cpu_share(0.1) as share:
        wait_then(lambda: (balanced / "run.lock").exists() and rank_pids(str(balanced), rank=1),
                  lambda: [share.add(pid) for pid in rank_pids(str(balanced), rank=1)], timeout=240)
        run = horovodrun(2, [*common, "--batch-size", "8", "--output-dir", balanced], timeout=400,
                         env={RECORD_ENV: str(record)})
    ok(run)
    changes = [tuple(map(int, m.groups())) for m in BERT_SHARES.finditer(run.output)]
    assert changes and changes[-1][1] < changes[-1][0], run.describe()
    ok(horovodrun(1, [*common, "--batch-size", "16", "--output-dir", alone], timeout=300))
    for step in (15, 30):
        assert_same_weights(checkpoint_at(balanced, step), checkpoint_at(alone, step), f"step {step}")
    assert checkpoint_at(balanced, 30)["balance"]["shares"] == list(changes[-1][:2])
    trained = trained_instances(record)
    assert [sorted(trained[epoch]) for epoch in range(4)] == [all_instances(data)] * 4


@pytest.mark.parametrize("extra", [["--elastic"], ["--straggler-interval", "0"]])
def test_bert_balance_refuses_what_it_cannot_combine_with(tmp_path, extra, need_horovod):
    run = launch([sys.executable, PRETRAIN, "--data", tmp_path, "--balance", *extra, "--output-dir", tmp_path / "out"],
                 timeout=120)
    assert run.returncode == 2 and "--balance needs the ranks' timings" in run.output, run.describe()
