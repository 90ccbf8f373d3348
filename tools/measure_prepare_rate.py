#!/usr/bin/env python
"""BERT data preparation against its tokenizer alone, on the same input, in one run.

    python tools/measure_prepare_rate.py --megabytes 12                 # the embedded corpus repeated
    python tools/measure_prepare_rate.py --input /tmp/corpus --masking static

(a) the tokenizer alone: ``encode_batch_fast`` over the lines the preparation
tokenizes, in batches of the preparation's size, with the tokenizer's own threads;
(b) prepare_bert_data.py end to end (its main(), in this process, the vocabulary
given with --vocab); (c) where (b) spends its time, from timers wrapped around the
preparation's functions (time inside a nested timed function counts once, for it).
The tokenizer's call runs in a
thread beside the preparation's own (it releases the GIL): (c) counts this
thread's time waiting for it; passes 2 and 3 in worker processes (more than one CPU per
rank) count as the time waited for them (--workers 1 splits them by function). Prints the rates by input bytes and the fraction (b)/(a). Other options are passed
to prepare_bert_data.py (default here: --dupe-factor 1).
"""
import argparse
import collections
import functools
import inspect
import os
import resource
import tempfile
import time
from pathlib import Path

import prepare_bert_data
from hvdtrain.data import bert_corpus as corpus
from hvdtrain.data import bert_data
from hvdtrain.data import bert_prepare as prepare

try:
    from hvdtrain.data import bert_instances as instances
except ImportError:  # a version without it: its functions are skipped
    instances = None

# (c): (category, object, attribute) of the functions timed; names a version lacks are skipped, so
# that the same table times earlier versions of the preparation too.
TIMED = [
    ("read and split lines", corpus, "read_documents"),
    ("read and split lines", prepare, "batches"),
    ("tokenizer (the Rust call, waited for)", prepare, "tokenize_sources"),
    ("tokenizer (the Rust call, waited for)", corpus, "tokenize_documents"),
    ("token ids to the store", prepare, "store_batch"),
    ("token ids to the store", prepare.TokenStoreWriter, "add"),
    ("token store reads", prepare.TokenStore, "document"),
    ("token store reads", prepare.TokenStore, "document_arrays"),
    ("token store reads", prepare.TokenStore, "random_segment"),
    ("token store reads", prepare.TokenStore, "random_segment_array"),
    ("instances", corpus, "instances_from_document"),
    ("instances", instances, "document_instances"),
    ("masking", corpus, "mask_instance"),
    ("masking", prepare, "mask_rows"),
    ("records to shard parts", prepare.ShardParts, "flush"),
    ("records to shard parts", prepare.ShardParts, "add_rows"),
    ("records to shard parts", getattr(instances, "RecordBuilder", None), "take"),
    ("shard shuffle", prepare, "shard_records"),
    ("shard shuffle", prepare, "sort_by_bin"),
    ("shard write (HDF5 gzip, sha256)", bert_data, "write_shard"),
    # Passes 2 and 3 in forked worker processes: the functions above run there, uncounted here.
    ("passes 2-3 in worker processes, waited for", prepare, "run_in_workers"),
]


class Breakdown:
    """Exclusive wall time per category of the wrapped functions."""

    def __init__(self):
        self.seconds, self.stack = collections.Counter(), []

    def enter(self, category):
        self.stack.append([category, time.perf_counter(), 0.0])

    def leave(self):
        category, start, inner = self.stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[category] += elapsed - inner
        if self.stack:
            self.stack[-1][2] += elapsed

    def wrap(self, owner, name, category):
        original = getattr(owner, name, None) if owner is not None else None
        if original is None:
            return
        if inspect.isgeneratorfunction(original):
            @functools.wraps(original)
            def timed(*args, **kwargs):
                iterator = original(*args, **kwargs)
                while True:
                    self.enter(category)
                    try:
                        item = next(iterator)
                    except StopIteration:
                        return
                    finally:
                        self.leave()
                    yield item
        else:
            @functools.wraps(original)
            def timed(*args, **kwargs):
                self.enter(category)
                try:
                    return original(*args, **kwargs)
                finally:
                    self.leave()
        setattr(owner, name, timed)


def repeated_corpus(directory, megabytes, files):
    """The embedded corpus written again and again into ``files`` text files until ``megabytes``."""
    text = "\n\n".join("\n".join(d) for d in corpus.default_corpus_documents()) + "\n\n"
    copies = max(1, round(megabytes * 1e6 / len(text.encode())))
    paths = []
    for index in range(files):
        paths.append(Path(directory) / f"part-{index:03d}.txt")
        share = copies // files + (index < copies % files)
        paths[-1].write_text(text * share, encoding="utf-8")
    return paths


def make_vocabulary(directory, vocab_size):
    """The script's own trainer over the embedded corpus, saved as a tokenizer directory."""
    sentences = (s for d in corpus.default_corpus_documents() for s in d)
    tokenizer = corpus.WordPieceTokenizer.from_vocab(corpus.train_wordpiece(sentences, vocab_size, True), True)
    corpus.save_tokenizer(tokenizer, Path(directory) / "tokenizer")
    return Path(directory) / "tokenizer", tokenizer


def tokenizer_alone(paths, tokenizer, batch):
    """Seconds of encode_batch_fast alone over every line of ``paths`` (read beforehand)."""
    lines = [s for path in paths for d in corpus.read_documents(path) for s in d]
    backend, seconds = tokenizer.backend_tokenizer, 0.0
    for first in range(0, len(lines), batch):
        start = time.perf_counter()
        backend.encode_batch_fast(lines[first:first + batch], add_special_tokens=False)
        seconds += time.perf_counter() - start
    return seconds


def timed_preparation(breakdown, command):
    """Seconds of prepare_bert_data.py's main() on ``command``, its functions timed into ``breakdown``."""
    originals = [(owner, name, getattr(owner, name)) for _, owner, name in TIMED
                 if owner is not None and hasattr(owner, name)]
    for category, owner, name in TIMED:
        breakdown.wrap(owner, name, category)
    start = time.perf_counter()
    try:
        prepare_bert_data.main(command)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, help="text files (default: the embedded corpus repeated)")
    parser.add_argument("--megabytes", type=float, default=12, help="size of the repeated embedded corpus")
    parser.add_argument("--files", type=int, default=1, help="files the repeated corpus is written to")
    parser.add_argument("--vocab-size", type=int, default=4000, help="vocabulary trained on the embedded corpus")
    parser.add_argument("--repeat", type=int, default=3, help="runs of (a) and (b), alternated; the best is shown")
    args, passed = parser.parse_known_args()
    if "--dupe-factor" not in passed:
        passed += ["--dupe-factor", "1"]
    work = Path(tempfile.mkdtemp(prefix="prepare-rate-"))
    paths = corpus.input_files(args.input) if args.input else repeated_corpus(work, args.megabytes, args.files)
    size = sum(p.stat().st_size for p in paths) / 1e6
    vocab, tokenizer = make_vocabulary(work, args.vocab_size)
    batch = getattr(prepare, "TOKENIZE_BATCH", getattr(prepare, "TOKENIZE_CHUNK", 20_000))
    threads = os.environ.get("RAYON_NUM_THREADS", f"rayon default, {os.cpu_count()} CPUs")
    print(f"input: {size:.1f} MB in {len(paths)} file(s); vocabulary {len(tokenizer)}; "
          f"tokenizer threads: {threads}; load average {os.getloadavg()[0]:.1f}", flush=True)

    breakdowns, command = [], ["--input", *map(str, paths), "--vocab", str(vocab), *passed]
    alone, whole = [], []
    for repeat in range(args.repeat):  # alternated, so that both see the same load
        alone.append(tokenizer_alone(paths, tokenizer, batch))
        breakdowns.append(Breakdown())
        whole.append(timed_preparation(breakdowns[-1], [*command, "--output-dir", str(work / f"out{repeat}")]))
    pairs = sorted(a / b for a, b in zip(alone, whole))  # each (a) with the (b) run right after it
    best = min(range(args.repeat), key=whole.__getitem__)
    alone, whole, breakdown = min(alone), whole[best], breakdowns[best]
    print(f"(a) tokenizer alone: {alone:.2f} s, {size / alone:.2f} MB/s (batches of {batch} lines; "
          f"the best of {args.repeat})")
    print(f"(b) whole preparation: {whole:.2f} s, {size / whole:.2f} MB/s (the best of {args.repeat}: "
          f"prepare_bert_data.py {' '.join(command)} --output-dir OUT)")
    print("(c) where it goes:")
    other = whole - sum(breakdown.seconds.values())
    for category, seconds in [*breakdown.seconds.most_common(), ("other (vocabulary, metadata, glue)", other)]:
        print(f"    {category:48s} {seconds:6.2f} s  {100 * seconds / whole:5.1f}%")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    worker = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest worker process
    print(f"fraction (b)/(a): {alone / whole:.2f} by the best times; run by run "
          f"{' '.join(f'{pair:.2f}' for pair in pairs)}, median {pairs[len(pairs) // 2]:.2f}")
    print(f"peak RSS of this process {peak:.0f} MiB, of its largest worker process {worker:.0f} MiB; "
          f"load average {os.getloadavg()[0]:.1f}; input, vocabulary and shards in {work}")


if __name__ == "__main__":
    main()
