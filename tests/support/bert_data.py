"""Small prepared BERT data sets for the tests (scripts/prepare_bert_data.py, run for real)."""
from .checks import succeeded
from .commands import PREPARE
from .launch import python


def make_small_static_data(root, timeout=120):
    """A few documents from a text file, static masking: an epoch is only a few steps."""
    from hvdtrain.data.bert_corpus import default_corpus_documents
    text = "\n\n".join("\n".join(document[:30]) for document in default_corpus_documents()[:8])
    (root / "corpus.txt").write_text(text + "\n")
    succeeded(python([PREPARE, "--input", root / "corpus.txt", "--output-dir", root / "data", "--max-seq-length",
                      "64", "--vocab-size", "600", "--dupe-factor", "1", "--num-shards", "2", "--masking", "static"],
                     timeout=timeout))
    return root / "data"


def prepare_bert_data(output_dir, seq_length):
    """The embedded corpus at ``seq_length``, one duplicate, a 1000-token vocabulary."""
    args = [PREPARE, "--output-dir", output_dir, "--max-seq-length", seq_length,
            "--dupe-factor", "1", "--vocab-size", "1000"]
    prepared = python(args, timeout=120)
    assert prepared.returncode == 0, prepared.describe()
