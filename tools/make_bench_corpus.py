#!/usr/bin/env python
"""Build an offline text corpus of a given size for measuring prepare_bert_data.py.

    python tools/make_bench_corpus.py --megabytes 200 --files 16 --output /tmp/bench-corpus

Text: the embedded corpus (CPython's pydoc_data.topics) plus the README, METADATA,
*.md, *.rst and *.txt files the installed packages ship (site-packages and
/usr/share/doc), ~20 MB here. It is repeated until the size is reached, each copy
with its documents and the sentences inside them shuffled (seeded), so copies
are not identical byte runs. Output: --files text files, one sentence per line,
a blank line between documents.
"""
import argparse
import random
import re
import site
from pathlib import Path

from hvdtrain.data.bert_corpus import default_corpus_documents

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
SUFFIXES = {".md", ".rst", ".txt"}


def package_documents():
    """Each shipped text file's paragraphs become one document of sentences."""
    roots = [Path(p) for p in site.getsitepackages()] + [Path("/usr/share/doc")]
    for root in roots:
        for path in sorted(root.rglob("*")):
            if not (path.suffix in SUFFIXES or path.name == "METADATA") or not path.is_file():
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            sentences = []
            for paragraph in re.split(r"\n\s*\n", text):
                flat = " ".join(paragraph.split())
                if len(flat) > 20 and sum(c.isalpha() for c in flat) > 0.6 * len(flat):
                    sentences.extend(s for s in SENTENCE_END.split(flat) if s)
            if len(sentences) >= 2:
                yield sentences


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=200)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    documents = default_corpus_documents() + list(package_documents())
    base = sum(len(s) + 1 for d in documents for s in d)
    print(f"{len(documents)} documents, {base / 1e6:.1f} MB of distinct text")
    args.output.mkdir(parents=True, exist_ok=True)
    handles = [open(args.output / f"part-{i:03d}.txt", "w", encoding="utf-8") for i in range(args.files)]
    written, copy = 0, 0
    while written < args.megabytes * 1e6:
        rng = random.Random(f"{args.seed}:{copy}")
        order = list(range(len(documents)))
        rng.shuffle(order)
        for number, index in enumerate(order):
            sentences = list(documents[index])
            rng.shuffle(sentences)
            text = "\n".join(sentences) + "\n\n"
            handles[(copy * len(order) + number) % args.files].write(text)
            written += len(text.encode("utf-8"))
            if written >= args.megabytes * 1e6:
                break
        copy += 1
    for handle in handles:
        handle.close()
    print(f"wrote {written / 1e6:.1f} MB in {args.files} files to {args.output}")


if __name__ == "__main__":
    main()
