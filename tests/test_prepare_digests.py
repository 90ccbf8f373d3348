"""prepare_bert_data.py writes the same shards, byte for byte, as the slower
per-token Python implementation it replaced (the one before the numpy instance
builder and the pipelined tokenizer).

The sha256 digests below were recorded by running that implementation on these
exact inputs and options (2026-11-24); the shards are a pure function of the
input, the vocabulary and the options, so any difference is a change of output.
"""
import json
import sys

import pytest

from support.checks import succeeded
from support.commands import PREPARE
from support.launch import launch, python
from support.needs import require_module

# Text that exercises reading: CRLF, blank lines of spaces, a form feed, a line
# separator, invalid UTF-8, special tokens written out, a document of one line.
ODD_TEXT = ("First line.\r\nSecond [SEP] line with [CLS] and [MASK] inside.\r\n \t \r\n\n"
            "Caf\u00e9 na\u00efve \u2028 split? No: one line.\x0cStill one.\nLast of two.\n\n\n"
            "Lonely document of one line.\n\n").encode() + b"Bad bytes \xff\xfe here.\nEnd \xe2\x82\n"


def write_inputs(directory):
    """12 files of 1 to 34 documents of the embedded corpus, and one of odd text."""
    from hvdtrain.data.bert_corpus import default_corpus_documents
    documents = default_corpus_documents()
    directory.mkdir()
    for part in range(12):
        text = "\n\n".join("\n".join(d) for d in documents[part::12][:1 + 3 * part])
        (directory / f"part{part:02d}.txt").write_text(text + "\n")
    (directory / "part12.txt").write_bytes(ODD_TEXT)
    return directory


CASES = {  # name: (options, whether --input is the 13 files above)
    "embedded dynamic": (["--max-seq-length", "64", "--vocab-size", "4000", "--dupe-factor", "2",
                          "--num-shards", "4"], False),
    "embedded static bins": (["--max-seq-length", "128", "--vocab-size", "600", "--dupe-factor", "2",
                              "--num-shards", "3", "--masking", "static", "--bin-size", "32", "--seed", "3"],
                             False),
    "files dupe 3": (["--max-seq-length", "96", "--vocab-size", "700", "--dupe-factor", "3", "--num-shards", "5",
                      "--short-seq-prob", "0.3", "--seed", "7"], True),
    "files static": (["--max-seq-length", "64", "--vocab-size", "600", "--dupe-factor", "2", "--num-shards", "4",
                      "--masking", "static", "--masked-lm-prob", "0.2"], True),
}

DIGESTS = {
    'embedded dynamic': [
        ['shard-00000.h5', 945, '4553eaf36530f21950fffd948cb7478485254130ecbae7eb55b939328bd0ad33', None],
        ['shard-00001.h5', 945, 'cda647c01d33912ba5a09a1143323d2276bf708b7a0367adb077a484c433384d', None],
        ['shard-00002.h5', 945, '9732fbc0ed3b8cf645549ef5caa495849486383614fecaeb1607ef307f03bed2', None],
        ['shard-00003.h5', 944, '47845f4b998f65796eaaaa7b9680220fe1069a5431cf427f65297bf0e19980e1', None],
    ],
    'embedded static bins': [
        ['shard-00000.h5', 977, 'a0670148b3277c09f78a71e3003bf59b368c91d9ca360676caf858e5c112c456', [3, 21, 33, 920]],
        ['shard-00001.h5', 977, '6afd81e267792ca7fd5e728c4fd5b75d1aa7195819ec89ea94a656a3c3a42030', [2, 21, 31, 923]],
        ['shard-00002.h5', 977, 'e42dd436de0e02d1b1bd9ebaebc3d30ecf47a9801fc97f292604efb76d66eca6', [4, 24, 38, 911]],
    ],
    'files dupe 3': [
        ['shard-00000.h5', 1015, 'f77bbf32c8badcc0e97fd0158855c502bf2202d82a2888cb063b484c95125df2', None],
        ['shard-00001.h5', 1015, '4d7e00317067f875e6fc3f6480c0c740e98de6d7bb47100b94e88fc608979e12', None],
        ['shard-00002.h5', 1014, 'ceca66a58bffab9dd533b4ec52d5ec9a5b116c0324c8c08be0749bdcd2ffcbce', None],
        ['shard-00003.h5', 1014, '98205beafb77fd2c763f4071ed0caa70a903e48ebea9b039d2ff19c93bb43340', None],
        ['shard-00004.h5', 1014, '1791db39d09c1b002b823f28b0abd393d7f72e2a35275797d56ab5db8d7a935a', None],
    ],
    'files static': [
        ['shard-00000.h5', 1079, 'a55d5b31987dcedc4f7bc9cd051971aa46f4ca5e7fd880f727329cde65f2eb60', None],
        ['shard-00001.h5', 1078, 'f33505746a4fb45227b5b6306d1f37d7df443355f815e8ba46ddde7ea1f98de0', None],
        ['shard-00002.h5', 1078, '24e3a6b86b6300500bb46f63479447ace0f1ae0b77662686c4be2f6c879c4f62', None],
        ['shard-00003.h5', 1078, '391ff6e8b70ab39a7382386e0e9f104e2cfedb72b7be1d4c7a11891b89652ef8', None],
    ],
}


def case_command(name, tmp_path):
    options, files = CASES[name]
    if files:
        options = [*options, "--input", write_inputs(tmp_path / "text")]
    return [PREPARE, "--output-dir", tmp_path / "data", *options]


def shard_digests(directory):
    metadata = json.loads((directory / "metadata.json").read_text())
    return [[s["file"], s["instances"], s["sha256"], s.get("bins")] for s in metadata["shards"]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_process_writes_the_recorded_shards(name, tmp_path):
    succeeded(python(case_command(name, tmp_path), timeout=300))
    assert shard_digests(tmp_path / "data") == DIGESTS[name]


@pytest.mark.parametrize("name", ["embedded static bins", "files dupe 3"])
def test_three_ranks_write_the_recorded_shards(name, tmp_path, need_mpi):
    require_module("mpi4py")
    command = ["mpirun", "--oversubscribe", "-np", "3", sys.executable, *case_command(name, tmp_path)]
    succeeded(launch(command, timeout=300))
    assert shard_digests(tmp_path / "data") == DIGESTS[name]


@pytest.mark.parametrize("ranks, workers", [(1, 3), (2, 2)])
def test_worker_processes_write_the_recorded_shards(ranks, workers, tmp_path, need_mpi):
    """Passes 2 and 3 in forked worker processes (--workers; by default the node's CPUs per rank):
    3 workers dealing 5 shards unevenly in one process, and 2 per rank under mpirun."""
    name = "files dupe 3"
    command = [sys.executable, *case_command(name, tmp_path), "--workers", str(workers)]
    if ranks > 1:
        require_module("mpi4py")
        command = ["mpirun", "--oversubscribe", "-np", str(ranks), *command]
    run = succeeded(launch(command, timeout=300))
    assert f"processes per rank for instances and shards: {workers}" in run.output
    assert "fork" not in run.output  # neither the tokenizers' nor Open MPI's fork warning
    assert shard_digests(tmp_path / "data") == DIGESTS[name]
    assert not list((tmp_path / "data").glob(".prepare-scratch*"))


@pytest.mark.parametrize("masking", ["dynamic", "static"])
def test_the_numpy_builder_gives_the_reference_records(masking, tmp_path):
    """bert_instances (arrays, one vectorised fill) against bert_corpus's per-token reference,
    in process: documents with special ids inside, one-sentence documents, short sequences."""
    import numpy as np

    from hvdtrain.data import bert_corpus as corpus
    from hvdtrain.data import bert_prepare as prepare
    ids = corpus.SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=1000, first_regular=5)
    rng = np.random.default_rng(1)
    documents = [[rng.integers(2, 1000, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 12))]
                 for _ in range(30)]
    writer = prepare.TokenStoreWriter(prepare.store_prefix(tmp_path, 0), np.uint16)
    writer.add(documents)
    writer.close()
    store = prepare.TokenStore(tmp_path, [len(documents)], np.uint16)
    options = type("Options", (), dict(dupe_factor=3, seed=5, max_seq_length=24, short_seq_prob=0.3,
                                       masking=masking, masked_lm_prob=0.15, max_predictions_per_seq=4))
    dtype = corpus.record_dtype(24, 4, static=masking == "static")
    parts = prepare.ShardParts(tmp_path, 0, 1, dtype)
    made = prepare.make_instances(store, range(len(documents)), options, ids, parts)
    expected = []
    for index in range(len(documents)):
        for round_index in range(3):
            draws = corpus.document_rng(5, index, round_index)
            instances = corpus.instances_from_document(
                documents[index], 24, 0.3, draws, ids,
                lambda r, length: corpus.segment_from(documents, index, r, length))  # noqa: B023
            for instance in instances if masking == "static" else ():
                corpus.mask_instance(instance, 0.15, 4, draws, ids)
            expected += instances
    records = np.fromfile(prepare.part_path(tmp_path, 0, 0), dtype=dtype)
    assert made == len(expected) > 100
    assert records.tobytes() == corpus.instances_to_records(expected, dtype).tobytes()
