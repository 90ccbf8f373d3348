"""prepare_bert_data.py writes the same shards, byte for byte, as the slower
per-token Python implementation it replaced (the one before the numpy instance
builder and the pipelined tokenizer).

The sha256 digests below were recorded by running that implementation on these
exact inputs and options (2026-11-24); the shards are a pure function of the
input, the vocabulary and the options, so any difference is a change of output.
Re-recorded 2026-11-29 when the shards' storage changed (chunks of whole rows,
the shuffle filter: bert_data.storage), after every array and attribute of
every shard was found equal to those of the shards with the 2026-11-24 digests.
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
        ['shard-00000.h5', 945, 'bcf08156073bea1b82b7776619f3697c7e0996640ba0e3da492b5edaa61c2572', None],
        ['shard-00001.h5', 945, '89f7fcdd49c05995acca01de27439920f6cbf8c6f5949d5e9931de7a1a47863c', None],
        ['shard-00002.h5', 945, 'd6f1edf610cc3b7059221c1154b61a3cdba3b7987e752092a84e43ab22e1dfe0', None],
        ['shard-00003.h5', 944, 'bab354b7754c52e6f8e2cb70797fdebab2572ad67c4e8cd672a780a8398da3a3', None],
    ],
    'embedded static bins': [
        ['shard-00000.h5', 977, 'be1fab7196fbaac219bcbd8b046f407d4a96214646779b3a7e6f501916380141', [3, 21, 33, 920]],
        ['shard-00001.h5', 977, 'abc632d11716d5d681718cf4d07f16a64e2e024e9f8d09dc61f8a9b83910bb7f', [2, 21, 31, 923]],
        ['shard-00002.h5', 977, 'db3cafd12b1aa5fc8cc9a2475751749932d9be30726cfdab868be46466453cd6', [4, 24, 38, 911]],
    ],
    'files dupe 3': [
        ['shard-00000.h5', 1015, '0fc89d965e2214f95e3396d7dccd6dd301dea7ae60c4be70214385086174fff4', None],
        ['shard-00001.h5', 1015, 'fd5d8271902c299950c16146ab8b06efa56957858dd1d1d2ba1289ab40be3ddc', None],
        ['shard-00002.h5', 1014, '60d5fe2a7d53c942534dd460632c45c97f5cee30d3b52678cbb1f5414ff30609', None],
        ['shard-00003.h5', 1014, '7f5f6838346e0fe897246d9a21def1868432bb2768b6b71aed659d1aa31f0e37', None],
        ['shard-00004.h5', 1014, '8932d56e0783ed625393c8707c35b92538d200362e4144e818470ee568f536e9', None],
    ],
    'files static': [
        ['shard-00000.h5', 1079, '00025194857767c4e708e427d822fbadda8a8fbc3811c0bed0af6b0b5b3a2007', None],
        ['shard-00001.h5', 1078, '438304614c0acd9b73c4b4d09d3cce52eca5c62f126e7559f2e76404c227cc71', None],
        ['shard-00002.h5', 1078, '839947c724f7ec7994bf6b98454a6262b4c862c27773a911cd610bdb9e468e86', None],
        ['shard-00003.h5', 1078, '6e4bfa2f177905a8d37a4d4ce0be2859e6ffe61dec592c9d5a12d7fba8d90529', None],
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
