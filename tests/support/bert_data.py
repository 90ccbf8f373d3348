"""Small prepared BERT data sets for the tests (scripts/prepare_bert_data.py, run for real)."""
import fcntl
import json
import os
import shutil
from pathlib import Path

from .checks import succeeded
from .commands import PREPARE
from .launch import python

SESSION_DIR_ENV = "HVDTEST_SESSION_DIR"  # made by tests/conftest.py for the whole session, workers included


# A small BERT without dropout, whose masks are drawn per rank: runs that split a step's instances
# differently (n ranks against one, a resize) train the same weights (with support.weights.EXACT).
NO_DROPOUT_CONFIG = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512,
                     "max_position_embeddings": 512, "type_vocab_size": 2,
                     "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def write_no_dropout_config(path):
    """NO_DROPOUT_CONFIG as a --config file at ``path``; returned."""
    path.write_text(json.dumps(NO_DROPOUT_CONFIG))
    return path


def make_small_static_data(root, timeout=120, bin_size=None):
    """A few documents from a text file, static masking: an epoch is only a few steps.

    ``bin_size``: rows grouped in length bins (81 instances: 4 in (32, 48], 77 in (48, 64] at 16).
    The preparation is deterministic (byte-identical shards: test_prepare_digests.py), so each
    form is prepared once per test session and copied into ``root / "data"``."""
    def prepare(directory):
        from hvdtrain.data.bert_corpus import default_corpus_documents
        text = "\n\n".join("\n".join(document[:30]) for document in default_corpus_documents()[:8])
        (directory / "corpus.txt").write_text(text + "\n")
        succeeded(python([PREPARE, "--input", directory / "corpus.txt", "--output-dir", directory / "data",
                          "--max-seq-length", "64", "--vocab-size", "600", "--dupe-factor", "1", "--num-shards", "2",
                          "--masking", "static", *(["--bin-size", bin_size] if bin_size else [])],
                         timeout=timeout))

    prepared = once_per_session(f"small-static-bins-{bin_size}", prepare) / "data"
    shutil.copytree(prepared, root / "data")
    return root / "data"


def once_per_session(name, make):
    """``make(directory)``'s directory, made by the first test of the session (of any xdist
    worker) that asks, the others waiting for it; kept until the session ends."""
    directory = Path(os.environ[SESSION_DIR_ENV]) / name
    with open(directory.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (directory / "done").exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            (directory / "done").touch()
    return directory


def prepare_bert_data(output_dir, seq_length):
    """The embedded corpus at ``seq_length``, one duplicate, a 1000-token vocabulary (prepared
    once per session, copied to ``output_dir``)."""
    def prepare(directory):
        succeeded(python([PREPARE, "--output-dir", directory / "data", "--max-seq-length", seq_length,
                          "--dupe-factor", "1", "--vocab-size", "1000"], timeout=120))

    shutil.copytree(once_per_session(f"embedded-{seq_length}", prepare) / "data", output_dir)


def all_instances(directory):
    """"FILE:ROW" of every instance in a prepared directory, sorted."""
    shards = json.loads((directory / "metadata.json").read_text())["shards"]
    return sorted(f"{shard['file']}:{row}" for shard in shards for row in range(shard["instances"]))


def trained_instances(record):
    """Epoch -> the instances its steps trained, from the HVDTRAIN_RECORD_INSTANCES file.

    Each rank appends a line per step it trained ("STEP EPOCH SIZE RANK IDS"), in
    time order; a step redone after a reset appears again later, so each step
    counts its last SIZE lines (the attempt that was committed).
    """
    lines = {}
    for line in record.read_text().splitlines():
        step, epoch, size, _, ids = line.split()
        lines.setdefault(int(step), []).append((int(epoch), int(size), ids.split(",")))
    trained = {}
    for step, attempts in sorted(lines.items()):
        for epoch, _, ids in attempts[-attempts[-1][1]:]:
            trained.setdefault(epoch, []).extend(ids)
    return trained
