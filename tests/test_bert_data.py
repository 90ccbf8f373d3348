"""BERT data pieces in-process: instances, masking, the shard format, per-rank data."""
import collections
import os
import random

import numpy as np
import pytest

from hvdtrain.data import bert_corpus as corpus
from hvdtrain.data import bert_data
from hvdtrain.data import bert_prepare as prepare
from hvdtrain.errors import UsageError

IDS = corpus.SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=1000, first_regular=5)


def fake_documents(count=12, sentences=9, seed=0):
    rng = np.random.default_rng(seed)
    return [[list(rng.integers(5, 1000, rng.integers(3, 25))) for _ in range(sentences)] for _ in range(count)]


def from_document(documents, index, max_seq_length, rng):
    segment = lambda rng, length: corpus.segment_from(documents, index, rng, length)  # noqa: E731
    return corpus.instances_from_document(documents[index], max_seq_length, 0.1, rng, IDS, segment)


def make_instances(max_seq_length=32, documents=None, masked=False):
    documents = documents or fake_documents()
    made = []
    for index in range(len(documents)):
        rng = corpus.document_rng(7, index, 0)
        for instance in from_document(documents, index, max_seq_length, rng):
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
    a = from_document(documents, 3, 32, corpus.document_rng(7, 3, 1))
    b = from_document(documents, 3, 32, corpus.document_rng(7, 3, 1))
    c = from_document(documents, 3, 32, corpus.document_rng(7, 3, 2))
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
    arrays = corpus.records_to_arrays(corpus.instances_to_records(make_instances(64),
                                                                  corpus.record_dtype(64, 10, static=False)))
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


def write_dataset(directory, shard_sizes, length=16, masking="dynamic"):
    """Shards whose rows are marked: input_ids[1] - 5 is the shard, input_ids[7] - 5 the row."""
    shards = []
    dtype = corpus.record_dtype(length, 3, static=masking == "static")
    for index, rows in enumerate(shard_sizes):
        instances = [corpus.Instance(tokens=[2] + [index + 5] * 5 + [3, row + 5, 3],
                                     segment_ids=[0] * 7 + [1, 1], is_random_next=row % 2 == 0,
                                     masked_positions=[], masked_ids=[])
                     for row in range(rows)]
        name = bert_data.shard_name(index)
        records = corpus.instances_to_records(instances, dtype)
        digest = bert_data.write_shard(directory / name, corpus.records_to_arrays(records))
        shards.append({"file": name, "instances": rows, "sha256": digest})
    metadata = {"format": bert_data.FORMAT_NAME, "format_version": bert_data.FORMAT_VERSION,
                "vocab_sha256": "x", "vocab_size": 1000, "special_ids": IDS.__dict__,
                "max_seq_length": length, "max_predictions_per_seq": 3, "masking": masking,
                "num_instances": sum(shard_sizes), "shards": shards}
    bert_data.write_metadata(directory, metadata)
    return metadata


def epoch_rows(metadata, directory, size, epoch, first_step=0, micro_batch=5, accumulation=1):
    """(shard, row) of every instance each rank trains on in ``epoch``, from ``first_step``."""
    seen = []
    for rank in range(size):
        data = bert_data.PretrainingData(directory, metadata, rank, size, seed=5, micro_batch=micro_batch,
                                         accumulation=accumulation)
        data.start_epoch(epoch, first_step)
        ids = [data.batch(step, micro)["input_ids"] for step in range(first_step, data.steps_in_epoch(epoch))
               for micro in range(accumulation)]
        seen.append([(int(row[1]) - 5, int(row[7]) - 5) for batch in ids for row in batch])
    return seen


def test_two_ranks_see_every_instance_once_per_epoch(tmp_path):
    """3 shards on 2 ranks (issue 9: each rank used to be cut to the smallest rank's files)."""
    metadata = write_dataset(tmp_path, [7, 7, 6], masking="static")
    everything = sorted((shard, row) for shard, rows in enumerate([7, 7, 6]) for row in range(rows))
    orders = []
    for epoch in range(3):
        seen = epoch_rows(metadata, tmp_path, size=2, epoch=epoch)
        assert len(seen[0]) == len(seen[1]) == 10
        assert sorted(seen[0] + seen[1]) == everything
        orders.append(seen[0])
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch
    # A resume mid-epoch reads the same batches the uninterrupted epoch did.
    assert epoch_rows(metadata, tmp_path, size=2, epoch=1, first_step=1)[0] == orders[1][5:]


def test_a_rank_holds_one_shard_and_reads_the_next_ahead(tmp_path):
    """Issue 9: every shard of the epoch used to be loaded at its start."""
    metadata = write_dataset(tmp_path, [5] * 6, masking="static")
    data = bert_data.PretrainingData(tmp_path, metadata, 0, 1, seed=5, micro_batch=5, accumulation=1)
    data.start_epoch(0)
    stream = data.streams[0]
    assert set(stream.loaded) == {0} and stream.prefetched[0] == 1
    shards = [int(data.batch(step, 0)["input_ids"][0, 1]) - 5 for step in range(3)]
    assert set(stream.loaded) == {2} and stream.prefetched[0] == 3
    assert len(set(shards)) == 3  # a batch of 5 is one whole shard here: pieces follow each other
    data.start_epoch(0, step=4)  # a resume mid-epoch reads only the piece it needs
    assert set(data.streams[0].loaded) == {4}


def test_the_remainder_is_left_to_later_epochs_never_repeated(tmp_path):
    metadata = write_dataset(tmp_path, [9, 8, 0, 9], masking="static")  # 26 rows, an empty shard
    for epoch in range(2):
        seen = epoch_rows(metadata, tmp_path, size=3, epoch=epoch, micro_batch=2, accumulation=2)
        flat = seen[0] + seen[1] + seen[2]
        assert len(flat) == len(set(flat)) == 3 * 8  # 26 // 3 = 8 rows per rank: 2 steps of 2 x 2


def test_an_empty_static_shard_is_written_whole_and_accepted(tmp_path):
    metadata = write_dataset(tmp_path, [4, 0], masking="static")
    import h5py
    with h5py.File(tmp_path / metadata["shards"][1]["file"], "r+") as handle:
        assert handle["masked_lm_positions"].shape == (0, 3)
        del handle["masked_lm_positions"], handle["masked_lm_ids"]  # as preparations before issue 9 wrote it
    metadata["shards"][1].pop("sha256")
    bert_data.check_shard(tmp_path, metadata["shards"][1], metadata)
    assert sorted(sum(epoch_rows(metadata, tmp_path, size=2, epoch=0, micro_batch=2), [])) == [
        (0, row) for row in range(4)]


def test_random_next_segments_come_from_other_documents_of_the_whole_corpus(tmp_path):
    """One document per input file, stored by two ranks (issue 9: drawn from the same file)."""
    documents = [[[5 + 40 * d + s] * 6 for s in range(8)] for d in range(6)]  # document d: ids 5+40d...
    dtype = prepare.token_dtype(IDS.vocab_size)
    for rank, mine in enumerate([documents[:2], documents[2:]]):
        writer = prepare.TokenStoreWriter(prepare.store_prefix(tmp_path, rank), dtype)
        for document in mine:
            writer.add([document])
        writer.close()
    store = prepare.TokenStore(tmp_path, [2, 4], dtype)
    assert [store.document(d) for d in range(6)] == documents
    for target in (1, 6, 7, 30, 100):  # reading from the store == taking from memory
        assert (store.random_segment(2, random.Random(target), target)
                == corpus.segment_from(documents, 2, random.Random(target), target))
    options = type("Options", (), dict(dupe_factor=3, seed=1, max_seq_length=32, short_seq_prob=0.1,
                                       masking="dynamic"))
    parts = prepare.ShardParts(tmp_path, 0, 1, corpus.record_dtype(32, 5, static=False))
    made = prepare.make_instances(store, range(6), options, IDS, parts)
    records = np.fromfile(prepare.part_path(tmp_path, 0, 0), dtype=parts.dtype)
    assert len(records) == made > 30
    sources = collections.Counter()
    for record in records[records["next_sentence_labels"] == 1]:
        tokens = record["input_ids"][record["input_mask"] == 1]
        a, b = tokens[1:list(tokens).index(IDS.sep)], tokens[list(tokens).index(IDS.sep) + 1:-1]
        a_document, b_documents = (a[0] - 5) // 40, set((b - 5) // 40)
        assert b_documents != {a_document} and len(b_documents) == 1
        sources[b_documents.pop()] += 1
    assert len(sources) == 6  # from every document, on both ranks' stores


def test_byte_ranges_of_the_input_read_every_document_exactly_once(tmp_path):
    """Tokenizing is split by bytes, not files: any cut points over the files read as
    one stream give every document once, whole, in order (one big file included)."""
    texts = ["one a\none b\n\n\ntwo a\r\n  \t\r\nthree a\nthree b\nthree c\n",  # CRLF, blank with spaces
             "",  # an empty file
             "four a\n\nfive a\nfive b",  # no final newline
             "\n\nsix a\n" + "six long " * 8000 + "\n\nseven a\n"]  # a line longer than a read chunk
    files = []
    for index, text in enumerate(texts):
        files.append(tmp_path / f"part{index}.txt")
        files[-1].write_bytes(text.encode())
    everything = [d for f in files for d in corpus.read_documents(f)]
    assert [d[0] for d in everything] == ["one a", "two a", "three a", "four a", "five a", "six a", "seven a"]
    total = sum(len(t.encode()) for t in texts)
    rng = random.Random(0)
    for parts in range(1, 9):
        for _ in range(20):
            cuts = sorted([0, total, *(rng.randrange(total) for _ in range(parts - 1))])
            read = [d for start, stop in zip(cuts, cuts[1:])
                    for d in corpus.documents_in_byte_range(files, start, stop)]
            assert read == everything, cuts
    for cut in [*range(120), *range(total - 40, total + 1)]:  # every cut near the short lines
        assert [*corpus.documents_in_byte_range(files, 0, cut),
                *corpus.documents_in_byte_range(files, cut, total)] == everything, cut


def test_length_bins_give_every_rank_the_same_bin_at_each_step(tmp_path):
    rng = np.random.default_rng(0)
    shards, dtype = [], corpus.record_dtype(32, 3, static=True)
    for index, rows in enumerate([40, 39, 40]):
        lengths = rng.integers(5, 33, rows)  # row r of shard s: [CLS] s r ... [SEP], `length` tokens
        instances = [corpus.Instance(tokens=[2, index + 5, row + 5] + [9] * (n - 4) + [3],
                                     segment_ids=[0] * n, is_random_next=False, masked_positions=[], masked_ids=[])
                     for row, n in enumerate(lengths)]
        records, bins = prepare.sort_by_bin(corpus.instances_to_records(instances, dtype), 8, 32)
        name = bert_data.shard_name(index)
        bert_data.write_shard(tmp_path / name, corpus.records_to_arrays(records))
        shards.append({"file": name, "instances": rows, "bins": bins})
    metadata = {"vocab_size": 1000, "special_ids": IDS.__dict__, "max_seq_length": 32, "masking": "static",
                "bin_size": 8, "num_instances": 119, "shards": shards}
    ranks = [bert_data.PretrainingData(tmp_path, metadata, r, 2, seed=3, micro_batch=4, accumulation=1,
                                       binned=True) for r in range(2)]
    steps = ranks[0].steps_in_epoch(0)
    assert 4 * 2 * steps <= 119 and steps >= 12
    seen = []
    for data in ranks:
        data.start_epoch(0)
    for step in range(steps):
        batches = [data.batch(step, 0) for data in ranks]
        widths = {batch["input_ids"].shape[1] for batch in batches}
        assert len(widths) == 1, widths  # every rank draws from the same bin
        width = widths.pop()
        for batch in batches:
            lengths = batch["attention_mask"].sum(1)
            assert ((lengths > width - 8) & (lengths <= width)).all()
            seen.extend((int(row[1]), int(row[2])) for row in batch["input_ids"])
    assert len(seen) == len(set(seen)) == 8 * steps
    assert len({data.schedule[0][0] for data in ranks}) == 1


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


def test_worker_processes_return_in_order_and_a_dead_worker_fails_instead_of_waiting():
    """bert_prepare.run_in_workers: results in task order; a worker that dies (os._exit, as
    an out-of-memory kill would) raises at once, where multiprocessing.Pool waits for good."""
    assert prepare.run_in_workers(divmod, [(7, 2), (9, 4), (5, 5)], 2) == [(3, 1), (2, 1), (1, 0)]
    assert prepare.run_in_workers(divmod, [(7, 2)], 1) == [(3, 1)]
    with pytest.raises(RuntimeError, match="a worker process of data preparation died while running _exit"):
        prepare.run_in_workers(os._exit, [(3,), (3,)], 2)


@pytest.mark.parametrize("lowercase", [True, False])
def test_the_preparations_tokenizer_is_the_one_transformers_builds_and_loads(tmp_path, lowercase):
    """bert_corpus.WordPieceTokenizer (`tokenizers` alone) against transformers' BertTokenizerFast
    over the same vocabulary: the same tokenizer.json and tokenizer_config.json, byte for byte,
    and transformers loads the saved directory and encodes as its own tokenizer does."""
    from transformers import BertTokenizerFast
    vocab = corpus.train_wordpiece(["Hello world, hello WORLD.", "The quick brown fox; the lazy dog!"] * 3, 80, lowercase)
    ours = corpus.WordPieceTokenizer.from_vocab(vocab, lowercase)
    theirs = BertTokenizerFast(vocab=dict(vocab), do_lower_case=lowercase)
    corpus.save_tokenizer(ours, tmp_path / "ours")
    theirs.save_pretrained(str(tmp_path / "theirs"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    loaded = BertTokenizerFast.from_pretrained(str(tmp_path / "ours"))
    text = "Hello quick [MASK] fox, the Lazy world"
    assert loaded(text)["input_ids"] == theirs(text)["input_ids"]
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert corpus.SpecialIds.of(ours) == corpus.SpecialIds.of(theirs)
    again = corpus.WordPieceTokenizer.load(tmp_path / "ours", not lowercase)  # the case comes from the directory
    assert again.do_lower_case == lowercase and again.get_vocab() == ours.get_vocab()


def test_a_preparation_loads_neither_torch_nor_transformers(tmp_path):
    """The tokenizers library does the work: no rank of a preparation pays for importing torch
    (about 1.5 s of CPU) or transformers (about 4.5 s)."""
    from support.checks import ok
    from support.commands import PREPARE, with_heavy_modules
    text = "\n\n".join("\n".join(f"Sentence {d} {s} of a small document." for s in range(6)) for d in range(6))
    (tmp_path / "corpus.txt").write_text(text + "\n")
    ran, loaded = with_heavy_modules([PREPARE, "--input", tmp_path / "corpus.txt", "--output-dir", tmp_path / "data",
                                      "--vocab-size", "120", "--dupe-factor", "1"], timeout=120)
    ok(ran)
    assert loaded == [], ran.describe()
    assert (tmp_path / "data" / "tokenizer" / "tokenizer.json").is_file()
