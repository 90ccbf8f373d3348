"""prepare_bert_data.py's passes 2 and 3 as the script runs them, in-process: instances kept as
spans of the memory-mapped token store (bert_instances.document_spans, bert_prepare.SpanWriter),
then each shard's rows gathered from the store straight into the arrays written
(bert_prepare.write_shards), against bert_corpus's per-token reference; the draws, the
token-balanced splits and the script's stage times.
"""
import json
import random
import re
import sys
import types

import h5py
import numpy as np
import pytest

from hvdtrain.data import bert_corpus as corpus
from hvdtrain.data import bert_instances as instances
from hvdtrain.data import bert_prepare as prepare
from support.checks import ok
from support.commands import PREPARE
from support.launch import launch, python
from support.needs import require_module

IDS = corpus.SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=1000, first_regular=5)


def test_uniform_below_draws_what_randint_and_randrange_draw():
    for seed in range(20):
        reference, mine = random.Random(f"{seed}:1:2"), random.Random(f"{seed}:1:2")
        below = instances.uniform_below(mine)
        for n in [1, 2, 3, 4, 5, 7, 8, 9, 125, 126, 127, 128, 1000, 4783, 2 ** 32 + 1, 10 ** 12]:
            assert below(n) == reference.randint(0, n - 1)
            assert 2 + below(n) == reference.randint(2, n + 1)
            assert below(n) == reference.randrange(n)
        assert mine.random() == reference.random()
    with pytest.raises(ValueError):
        below(0)


def documents_and_store(tmp_path, per_rank, seed=0):
    """Token stores of len(per_rank) ranks holding that many random documents each (a rank may
    hold none); returns (every document, in corpus order, as token-id lists; the TokenStore)."""
    rng = np.random.default_rng(seed)
    everything = []
    for rank, count in enumerate(per_rank):
        documents = [[rng.integers(2, 1000, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 12))]
                     for _ in range(count)]
        documents[::7] = [[[3, 2, *s, 2] for s in d] for d in documents[::7]]  # special ids inside text
        writer = prepare.TokenStoreWriter(prepare.store_prefix(tmp_path, rank), np.uint16)
        writer.add(documents)
        writer.close()
        everything += documents
    return everything, prepare.TokenStore(tmp_path, per_rank, np.uint16)


def test_document_sizes_and_token_balanced_splits(tmp_path):
    documents, store = documents_and_store(tmp_path, [7, 0, 13, 5])
    sizes = [sum(map(len, d)) for d in documents]
    assert store.document_sizes(range(len(documents))).tolist() == sizes
    assert store.document_sizes(range(3, 21)).tolist() == sizes[3:21]
    assert store.document_sizes(range(4, 4)).tolist() == []
    for documents_range in (range(0, 25), range(6, 19), range(5, 6)):
        for parts in (1, 2, 3, 8):
            split = prepare.split_by_tokens(store, documents_range, parts)
            assert len(split) == parts and split[0].start == documents_range.start
            assert all(a.stop == b.start for a, b in zip(split, split[1:])) and split[-1].stop == documents_range.stop
            goal = sum(sizes[i] for i in documents_range) / parts
            for part in split:  # each within one document of an equal share
                assert abs(sum(sizes[i] for i in part) - goal) <= max(sizes[i] for i in documents_range)


def reference_instances(documents, options):
    """bert_corpus's per-token reference over every document and round, in corpus order."""
    made = []
    for index in range(len(documents)):
        for round_index in range(options.dupe_factor):
            rng = corpus.document_rng(options.seed, index, round_index)
            pairs = corpus.instances_from_document(
                documents[index], options.max_seq_length, options.short_seq_prob, rng, IDS,
                lambda r, length: corpus.segment_from(documents, index, r, length))  # noqa: B023
            for instance in pairs if options.masking == "static" else ():
                corpus.mask_instance(instance, options.masked_lm_prob, options.max_predictions_per_seq, rng, IDS)
            made += pairs
    return made


@pytest.mark.parametrize("masking, bin_size", [("dynamic", 0), ("static", 0), ("static", 8)])
def test_spans_then_shards_write_the_reference_rows(tmp_path, masking, bin_size):
    """Three ranks' stores (one empty), each rank's documents split between two workers by
    tokens: the shards hold the reference's rows, instance i in shard i mod 3, shuffled by
    (seed, shard) and grouped by length bin."""
    counts = [9, 0, 14]
    documents, store = documents_and_store(tmp_path, counts, seed=1)
    options = types.SimpleNamespace(dupe_factor=3, seed=5, max_seq_length=24, short_seq_prob=0.3, masking=masking,
                                    masked_lm_prob=0.15, max_predictions_per_seq=4, num_shards=3, bin_size=bin_size,
                                    output_dir=tmp_path / "out")
    options.output_dir.mkdir()
    made = []
    for rank, share in enumerate(prepare.split_by_tokens(store, range(len(documents)), len(counts))):
        for worker, mine in enumerate(prepare.split_by_tokens(store, share, 2)):
            made.append(prepare.spans_in_worker(tmp_path, counts, np.uint16, options, IDS, rank, worker, mine))
    dtype = corpus.record_dtype(24, 4, static=masking == "static")
    written = prepare.write_shards(range(3), tmp_path, made, options, dtype, IDS, counts, np.uint16)
    expected = corpus.instances_to_records(reference_instances(documents, options), dtype)
    assert sum(count for _, _, count in made) == len(expected) > 150
    for shard, entry in enumerate(written):
        rows = expected[shard::3][prepare.shard_order(5, shard, len(expected[shard::3]))]
        if bin_size:
            rows, bins = prepare.sort_by_bin(rows, bin_size, 24)
            assert entry["bins"] == bins
        assert entry["instances"] == len(rows)
        with h5py.File(options.output_dir / entry["file"], "r") as handle:
            assert list(handle) == sorted(dtype.names)
            for name in dtype.names:
                assert handle[name][...].tobytes() == np.ascontiguousarray(rows[name]).tobytes(), name


def shard_digests(directory):
    metadata = json.loads((directory / "metadata.json").read_text())
    return [(shard["file"], shard["instances"], shard["sha256"]) for shard in metadata["shards"]]


def test_the_script_names_its_stages(tmp_path):
    """Its last line: the seconds of each stage, from the process's start, and the documents per rank."""
    from hvdtrain.data.bert_corpus import default_corpus_documents
    text = "\n\n".join("\n".join(document[:20]) for document in default_corpus_documents()[:10])
    (tmp_path / "corpus.txt").write_text(text + "\n")
    run = ok(python([PREPARE, "--input", tmp_path / "corpus.txt", "--output-dir", tmp_path / "data",
                     "--vocab-size", "500", "--dupe-factor", "1", "--num-shards", "2"], timeout=120))
    line = run.output.strip().splitlines()[-1]
    stages = re.findall(r"([a-z-]+) (\d+\.\d+) s", line[line.index("M characters"):])
    assert [name for name, _ in stages] == ["start-up", "set-up", "tokenize", "instances", "shards", "metadata"]
    total = float(re.search(r" in (\d+\.\d+) s \(", line).group(1))
    assert abs(sum(float(seconds) for _, seconds in stages) - total) < 0.1 and 0 < float(stages[0][1]) < total
    assert re.search(r"documents tokenized per rank: \d+\)$", line)
    assert not list((tmp_path / "data").glob(".prepare-scratch*"))


def test_under_mpirun_the_first_batch_is_tokenized_while_mpi_starts(tmp_path, need_mpi):
    """With --input and --vocab, each rank tokenizes its first batch before MPI_Init returns
    (bert_prepare.EarlyStart): the same shards as one process; a vocabulary that is
    not rank 0's drops the early batch."""
    require_module("mpi4py")
    from hvdtrain.data.bert_corpus import default_corpus_documents
    text = "\n\n".join("\n".join(document[:40]) for document in default_corpus_documents()[:60])
    (tmp_path / "corpus.txt").write_text(text + "\n")
    common = ["--input", tmp_path / "corpus.txt", "--dupe-factor", "2", "--num-shards", "3"]
    ok(python([PREPARE, *common, "--vocab-size", "600", "--output-dir", tmp_path / "vocab"], timeout=120))
    common += ["--vocab", tmp_path / "vocab" / "tokenizer"]
    one = ok(python([PREPARE, *common, "--output-dir", tmp_path / "one"], timeout=120))
    three = ok(launch(["mpirun", "--oversubscribe", "-np", "3", sys.executable, PREPARE, *common,
                       "--output-dir", tmp_path / "three"], timeout=180))
    assert prepare.EarlyStart.NOTE in three.output and prepare.EarlyStart.NOTE not in one.output
    assert shard_digests(tmp_path / "three") == shard_digests(tmp_path / "one")


def test_an_early_batch_is_taken_only_by_its_own_run(tmp_path, monkeypatch):
    import prepare_bert_data
    from hvdtrain.data.bert_corpus import default_corpus_documents
    (tmp_path / "corpus.txt").write_text("\n\n".join("\n".join(d) for d in default_corpus_documents()[:30]) + "\n")
    vocab = corpus.train_wordpiece((s for d in default_corpus_documents()[:30] for s in d), 500, True)
    corpus.save_tokenizer(corpus.WordPieceTokenizer.from_vocab(vocab, True), tmp_path / "tokenizer")
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    for name in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.setenv(name, "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    args = prepare_bert_data.parse_args(["--input", str(tmp_path / "corpus.txt"), "--output-dir", str(tmp_path / "out"),
                                         "--vocab", str(tmp_path / "tokenizer")])
    files = prepare_bert_data.check_inputs(args, 2)

    def begin():
        return prepare.EarlyStart.begin(lambda size: prepare_bert_data.check_inputs(args, size), args.vocab, True)

    for rank, expected in ((1, True), (0, False)):
        world = types.SimpleNamespace(rank=rank, size=2)
        early = begin()
        taken = early.taken(world, files, (vocab, True))
        assert (taken is early) == expected
        if expected:  # the first batch of rank 1's byte range, as tokenize_sources would make it
            batch, encodings = early.first.result()
            first = prepare.first_batch(prepare.documents_of_rank(files, rank, 2), early.tokenizer)
            assert (batch.counts, batch.characters, batch.inputs) == (first.counts, first.characters, first.inputs)
            assert len(encodings) == len(first.inputs)
    assert begin().taken(types.SimpleNamespace(rank=1, size=2), files, ({**vocab, "extra": len(vocab)}, True)) is None
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert begin() is None  # one process: MPI is never started


ODD_LINES = ["First line.", "Second [SEP] line with [CLS] and [MASK] inside.", "\x01\x02", "Café naïve \u2028 split?",
             "Still one.\x0cx", "日本語のテキスト、漢字。", "[SEP]", "a" * 300, "...", "[sep] lower", "x [SEP", "SEP] y",
             "Bad bytes \ufffd\ufffd here.", "End \ufffd", "ends with [SEP]", "\u200b", "mixed CASE Words"]


@pytest.mark.parametrize("group", [2, 5, 32])
def test_joined_sentences_give_each_sentence_its_own_ids(group):
    """bert_prepare.Batch joins runs of sentences with " [SEP] " into one tokenizer input: the ids
    are those of each sentence tokenized alone (empty ones included), a run holding "[SEP]" itself
    goes sentence by sentence, and misplaced separators fall back to one input per sentence."""
    from hvdtrain.data.bert_corpus import default_corpus_documents
    documents = default_corpus_documents()[:6]
    sentences = [s for d in documents for s in d]
    vocab = corpus.train_wordpiece(sentences, 700, True)
    documents = [*documents[:3], ODD_LINES, *documents[3:], ODD_LINES[::-1]]
    lines = [s for d in documents for s in d]
    for lowercase in (True, False):
        tokenizer = corpus.WordPieceTokenizer.from_vocab(vocab, lowercase)
        alone = tokenizer.backend_tokenizer.encode_batch_fast(lines, add_special_tokens=False)
        batch = prepare.Batch(documents, tokenizer, group=group)
        assert len(batch.inputs) < len(lines) and max(batch.lines_per_input) == group
        assert 1 in batch.lines_per_input  # the runs with a "[SEP]" of their own
        assert True in batch.plain and False in batch.plain  # plain inputs went to the twin, the rest not
        ids, lengths = batch.ids(batch.encoded()[1], np.int32)
        assert lengths.tolist() == [len(e.ids) for e in alone] and 0 in lengths
        assert ids.tolist() == [i for e in alone for i in e.ids]
        batch.lines_per_input[0] += 1  # a separator short: tokenized again, one input per sentence
        ids, lengths = batch.ids(batch.encoded()[1], np.int32)
        assert lengths.tolist() == [len(e.ids) for e in alone] and ids.tolist() == [i for e in alone for i in e.ids]


def test_the_plain_text_twin_gives_the_tokenizers_ids():
    """WordPieceTokenizer.plain_backend leaves out the normalizing steps that cannot change printable
    ASCII: the ids of such sentences (case, punctuation, digits, specials) are the full tokenizer's,
    cased and uncased; tabs, control characters and non-ASCII text are not plain; a tokenizer whose
    normalizer is not BERT's has no twin."""
    from tokenizers import Tokenizer, normalizers
    sentences = [s for d in corpus.default_corpus_documents()[:6] for s in d]
    vocab = corpus.train_wordpiece(sentences, 700, True)
    assert not any(map(corpus.is_plain, ["Tab\there", "\x01", "\x7f", "Café", "日本"]))
    lines = [line for line in ODD_LINES + sentences[:200] if corpus.is_plain(line)] + ["A.B,C;D ~x~ `q` {}|\\"]
    assert len(lines) > 150
    for lowercase in (True, False):
        tokenizer = corpus.WordPieceTokenizer.from_vocab(vocab, lowercase)
        full = tokenizer.backend_tokenizer.encode_batch_fast(lines, add_special_tokens=False)
        twin = tokenizer.encode_batch(lines, [True] * len(lines))
        assert [e.ids for e in twin] == [e.ids for e in full]
    other = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    other.normalizer = normalizers.Lowercase()
    assert corpus.WordPieceTokenizer(other, True).plain_backend is None


def test_a_vocabulary_without_sep_is_tokenized_sentence_by_sentence():
    """Without a [SEP] token the joined runs could not be cut apart: every sentence is its own input."""
    import json
    from tokenizers import Tokenizer
    documents = corpus.default_corpus_documents()[:4]
    vocab = corpus.train_wordpiece([s for d in documents for s in d], 700, True)
    state = json.loads(corpus.WordPieceTokenizer.from_vocab(vocab, True).backend_tokenizer.to_str())
    state["added_tokens"] = [t for t in state["added_tokens"] if t["content"] != "[SEP]"]
    del state["model"]["vocab"]["[SEP]"]
    state["post_processor"] = None
    tokenizer = corpus.WordPieceTokenizer(Tokenizer.from_str(json.dumps(state)), True)
    assert tokenizer.sep_token_id is None
    batch = prepare.Batch(documents, tokenizer)
    lines = [s for d in documents for s in d]
    assert batch.lines_per_input == [1] * len(lines)
    ids, lengths = batch.ids(batch.encoded()[1], np.int32)
    alone = tokenizer.backend_tokenizer.encode_batch_fast(lines, add_special_tokens=False)
    assert ids.tolist() == [i for e in alone for i in e.ids]


def test_windows_near_and_past_a_token_arrays_ends_hold_its_tokens_and_zeros():
    sources = [np.arange(1, 11, dtype=np.uint16), np.zeros(0, np.uint16), np.arange(100, 103, dtype=np.uint16)]
    origins = np.array([0, 0, 0, 0, 1, 2, 2])
    offsets = np.array([0, -2, 4, 8, 0, -1, 1])
    windows = instances.windows_at(sources, origins, offsets, 4)
    assert windows.tolist() == [[1, 2, 3, 4], [0, 0, 1, 2], [5, 6, 7, 8], [9, 10, 0, 0], [0, 0, 0, 0],
                                [0, 100, 101, 102], [101, 102, 0, 0]]
