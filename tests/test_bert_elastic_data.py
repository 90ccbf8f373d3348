"""--elastic BERT data alone (no Horovod): the world resized mid-epoch, every instance trained once.

The ranks of each world are simulated in one process, each with its own copy
of the position (as every rank holds the committed one); the instances come
from the test-only record (HVDTRAIN_RECORD_INSTANCES) that test_elastic.py
reads from a real elastic job, checked here against the rows in the batches.
"""
import copy

import h5py
import numpy as np

from hvdtrain.data import bert_data
from hvdtrain.data.bert_elastic import BinPosition, ElasticPretrainingData
from hvdtrain.testhooks import RECORD_ENV
from support.bert_data import all_instances, make_small_static_data, trained_instances


def read_row(directory, instance):
    name, row = instance.split(":")
    with h5py.File(directory / name, "r") as handle:
        return handle["input_ids"][int(row)]


def test_a_resized_epoch_trains_every_instance_once_one_bin_a_step(tmp_path, monkeypatch):
    data = make_small_static_data(tmp_path, bin_size=16)
    metadata = bert_data.read_metadata(data)
    record = tmp_path / "record"
    monkeypatch.setenv(RECORD_ENV, str(record))
    position, epoch, in_epoch, step = BinPosition(), 0, 0, 0
    # Epoch 0 at 2 ranks for 2 steps, 3 ranks for 1, then 1 rank to its end; epoch 1 at 2 ranks.
    for size, steps in ((2, 2), (3, 1), (1, None), (2, None)):
        ranks = [ElasticPretrainingData(data, metadata, rank, size, 5, 4, 2, copy.deepcopy(position), binned=True)
                 for rank in range(size)]
        for _ in range(steps or ranks[0].steps_in_epoch(epoch) - in_epoch):
            lengths = set()
            for rank in ranks:
                if rank.epoch != epoch:
                    rank.start_epoch(epoch, in_epoch)
                micro = [rank.batch(in_epoch, m) for m in range(2)]
                assert all(len(batch["input_ids"]) >= 1 for batch in micro)
                lengths |= {batch["input_ids"].shape[1] for batch in micro}
                rank.advance(step + 1)
            assert len(lengths) == 1, lengths  # one bin a step, on every rank
            step, in_epoch = step + 1, in_epoch + 1
        position = ranks[0].position
        assert all(rank.position.state_dict() == position.state_dict() for rank in ranks)
        if in_epoch == ranks[0].steps_in_epoch(epoch):
            epoch, in_epoch = epoch + 1, 0
    assert epoch == 2
    trained, expected = trained_instances(record), all_instances(data)
    assert sorted(trained) == [0, 1] and sorted(trained[0]) == expected and sorted(trained[1]) == expected
    lines = [line.split() for line in record.read_text().splitlines()]
    # The recorded ids are the rows trained: rank 1's first micro-batch of epoch 1 against the shards.
    check = ElasticPretrainingData(data, metadata, 1, 2, 5, 4, 2, BinPosition(), binned=True)
    check.start_epoch(1)
    rows = np.concatenate([check.batch(0, micro)["input_ids"].numpy() for micro in range(2)])
    ids = [line for line in lines if line[1] == "1" and line[3] == "1"][0][4].split(",")
    assert len(rows) == len(ids) >= 2
    for row, instance in zip(rows, ids):
        np.testing.assert_array_equal(row, read_row(data, instance)[:rows.shape[1]])
