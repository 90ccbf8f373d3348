"""BERT data pieces in-process: instances, masking, the shard format, per-rank data."""
import collections
import json

import numpy as np
import pytest

from hvdtrain import bert_corpus as corpus
from hvdtrain import bert_data
from hvdtrain.cli import UsageError

IDS = corpus.SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=1000, first_regular=5)


def fake_documents(count=12, sentences=9, seed=0):
    rng = np.random.default_rng(seed)
    return [[list(rng.integers(5, 1000, rng.integers(3, 25))) for _ in range(sentences)] for _ in range(count)]


def make_instances(max_seq_length=32, documents=None, masked=False):
    documents = documents or fake_documents()
    made = []
    for index in range(len(documents)):
        rng = corpus.document_rng(7, 0, index, 0)
        for instance in corpus.instances_from_document(documents, index, max_seq_length, 0.1, rng, IDS):
            if masked:
                corpus.mask_instance(instance, 0.15, 5, rng, IDS)
            made.append(instance)
    return made


def test_instances_are_well_formed_sentence_pairs():
    instances = make_instances(max_seq_length=32)
    assert len(instances) > 20
    for instance in instances:
        tokens, segments = instance.tokens, instance.segment_ids
        assert len(tokens) == len(segments) <= 32
        assert tokens[0] == IDS.cls and tokens[-1] == IDS.sep and tokens.count(IDS.sep) == 2
        first_b = segments.index(1)
        assert tokens[first_b - 1] == IDS.sep and all(s == 1 for s in segments[first_b:])
    random_share = np.mean([i.is_random_next for i in instances])
    assert 0.3 < random_share < 0.8


def test_instances_depend_only_on_the_document_key():
    documents = fake_documents()
    a = corpus.instances_from_document(documents, 3, 32, 0.1, corpus.document_rng(7, 0, 3, 1), IDS)
    b = corpus.instances_from_document(documents, 3, 32, 0.1, corpus.document_rng(7, 0, 3, 1), IDS)
    c = corpus.instances_from_document(documents, 3, 32, 0.1, corpus.document_rng(7, 0, 3, 2), IDS)
    assert [i.tokens for i in a] == [i.tokens for i in b]
    assert [i.tokens for i in a] != [i.tokens for i in c]


def test_static_masking_is_15_percent_with_80_10_10():
    documents = fake_documents(count=40, sentences=12)
    plain = sorted(tuple(i.tokens) for i in make_instances(128, documents))
    masked = make_instances(128, documents, masked=True)
    kinds = collections.Counter()
    for instance in masked:
        assert instance.masked_positions == sorted(instance.masked_positions)
        assert 1 <= len(instance.masked_positions) <= 5
        for position, original in zip(instance.masked_positions, instance.masked_ids):
            assert position > 0 and original not in (IDS.cls, IDS.sep)
            now = instance.tokens[position]
            kinds["mask" if now == IDS.mask else "kept" if now == original else "random"] += 1
    total = sum(kinds.values())
    assert abs(kinds["mask"] / total - 0.8) < 0.05
    assert abs(kinds["kept"] / total - 0.1) < 0.04 and abs(kinds["random"] / total - 0.1) < 0.04
    # Undoing the masks gives back the unmasked instances: masking draws come after the pairs'.
    restored = []
    for instance in masked:
        tokens = list(instance.tokens)
        for position, original in zip(instance.masked_positions, instance.masked_ids):
            tokens[position] = original
        restored.append(tuple(tokens))
    assert sorted(restored) == plain


def test_dynamic_masking_rate_specials_and_determinism():
    arrays = corpus.instances_to_arrays(make_instances(64), 64, 10)
    special = {**IDS.__dict__}

    def masked(seed):
        pick = {k: v.copy() for k, v in arrays.items()}
        labels = bert_data.dynamic_mask(pick, special, 0.15, np.random.default_rng(seed))
        return pick["input_ids"], labels

    ids, labels = masked(1)
    chosen = labels != -100
    real = (arrays["input_mask"] == 1) & (arrays["input_ids"] != IDS.cls) & (arrays["input_ids"] != IDS.sep)
    assert not (chosen & ~real).any()
    assert abs(chosen.sum() / real.sum() - 0.15) < 0.02
    assert (labels[chosen] == arrays["input_ids"][chosen]).all()
    assert abs((ids[chosen] == IDS.mask).mean() - 0.8) < 0.06
    assert (ids[~chosen] == arrays["input_ids"][~chosen]).all()
    again_ids, again_labels = masked(1)
    assert (again_ids == ids).all() and (again_labels == labels).all()
    assert (masked(2)[1] != labels).any()


def write_dataset(directory, shard_sizes, length=16):
    shards = []
    for index, rows in enumerate(shard_sizes):
        instances = [corpus.Instance(tokens=[2] + [index + 5] * 5 + [3, row + 5, 3],
                                     segment_ids=[0] * 7 + [1, 1], is_random_next=row % 2 == 0)
                     for row in range(rows)]
        name = bert_data.shard_name(index)
        bert_data.write_shard(directory / name, corpus.instances_to_arrays(instances, length, 3))
        shards.append({"file": name, "instances": rows})
    metadata = {"format": bert_data.FORMAT_NAME, "format_version": bert_data.FORMAT_VERSION,
                "vocab_sha256": "x", "vocab_size": 1000, "special_ids": IDS.__dict__,
                "max_seq_length": length, "masking": "dynamic", "num_instances": sum(shard_sizes),
                "shards": shards}
    bert_data.write_metadata(directory, metadata)
    return metadata


def test_ranks_read_disjoint_files_and_take_equal_steps(tmp_path):
    metadata = write_dataset(tmp_path, [10, 12, 9, 11])
    assert bert_data.read_metadata(tmp_path) == json.loads(json.dumps(metadata))
    ranks = [bert_data.PretrainingData(tmp_path, metadata, r, 2, seed=5, micro_batch=3, accumulation=1)
             for r in range(2)]
    steps = ranks[0].steps_in_epoch(0)
    assert steps == ranks[1].steps_in_epoch(0) >= 6
    seen = []
    for data in ranks:
        data.start_epoch(0)
        shard_marks = {int(row[1]) for row in data.arrays["input_ids"]}
        seen.append(shard_marks)
        first = data.batch(0, 0)["input_ids"]
        data.start_epoch(0)
        assert (data.batch(0, 0)["input_ids"] == first).all()  # a batch is a pure function of its position
    assert seen[0].isdisjoint(seen[1]) and len(seen[0] | seen[1]) == 4


def test_fewer_files_than_ranks_stride_samples(tmp_path):
    metadata = write_dataset(tmp_path, [20])
    rows = []
    for rank in range(3):
        data = bert_data.PretrainingData(tmp_path, metadata, rank, 3, seed=1, micro_batch=2, accumulation=1)
        data.start_epoch(0)
        rows.append({int(r[7]) for r in data.arrays["input_ids"]})
    assert sum(map(len, rows)) == 20 and len(set.union(*rows)) == 20


def test_bad_shard_directories_are_named(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        bert_data.read_metadata(tmp_path / "absent")
    with pytest.raises(UsageError, match="no shards"):
        bert_data.read_metadata(tmp_path)
    metadata = write_dataset(tmp_path, [10, 10])
    path = tmp_path / metadata["shards"][1]["file"]
    path.write_bytes(path.read_bytes()[:300])
    bert_data.check_shard(tmp_path, metadata["shards"][0], metadata)
    with pytest.raises(UsageError, match=f"corrupt shard {path}"):
        bert_data.check_shard(tmp_path, metadata["shards"][1], metadata)
