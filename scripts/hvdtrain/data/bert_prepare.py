"""BERT data preparation at corpus scale: streaming, corpus-wide, balanced (no MPI here).

scripts/prepare_bert_data.py runs three passes, each rank on its share:

1. tokenize: each rank tokenizes the documents that start in its equal byte
   range of the input (the files read as one stream) into a token store (three flat files in a scratch directory beside the shards).
   Documents are then numbered across the whole corpus, in input order.
2. instances: each rank makes the instances of a contiguous range of documents;
   a "random next" segment is read from any rank's store (``TokenStore``), so it
   comes from another document of the whole corpus. The instances of document d
   in round k depend only on (seed, d, k) and the corpus. Numbered in (document,
   round, instance) order across the corpus, instance i goes to shard i mod
   num_shards: shards are within one instance of each other. Each rank appends
   its instances to one scratch file per shard as it makes them.
3. shards: shard s is the concatenation of every rank's part for s (in rank
   order, so in corpus order), shuffled with a generator seeded by (seed, s).

So the shards are a pure function of the corpus, the vocabulary and the options,
byte for byte, whatever the number of ranks, and memory holds one chunk of text
or one shard at a time, never the corpus.
"""
import bisect
import itertools
import os
from pathlib import Path

import numpy as np

from hvdtrain.data import bert_corpus as corpus

SCRATCH_DIR = ".prepare-scratch"
TOKENIZE_CHUNK = 20_000   # sentences per Rust batch call
FLUSH_ROWS = 8192         # instances buffered before they are appended to the shard parts


# ----------------------------------------------------------------------------- pass 1: token store

def store_prefix(scratch, rank):
    return Path(scratch) / f"tokens-{rank:05d}"


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 1 << 16 else np.int32


class TokenStoreWriter:
    """Appends tokenized documents to <prefix>.tokens (ids), .sentences (each sentence's
    end in tokens) and .documents (each document's end in sentences)."""

    def __init__(self, prefix, dtype):
        self.dtype = dtype
        self.handles = {part: open(f"{prefix}.{part}", "wb") for part in ("tokens", "sentences", "documents")}
        self.tokens = self.sentences = self.documents = 0

    def add(self, documents):
        """``documents``: lists of non-empty token-id lists; empty documents are skipped."""
        documents = [d for d in documents if d]
        sentences = [s for d in documents for s in d]
        if not sentences:
            return
        ids = np.fromiter(itertools.chain.from_iterable(sentences), self.dtype)
        sentence_ends = self.tokens + np.cumsum([len(s) for s in sentences], dtype=np.int64)
        document_ends = self.sentences + np.cumsum([len(d) for d in documents], dtype=np.int64)
        ids.tofile(self.handles["tokens"])
        sentence_ends.tofile(self.handles["sentences"])
        document_ends.tofile(self.handles["documents"])
        self.tokens += len(ids)
        self.sentences += len(sentences)
        self.documents += len(documents)

    def close(self):
        for handle in self.handles.values():
            handle.close()


def tokenize_sources(sources, tokenizer, writer, chunk=TOKENIZE_CHUNK):
    """Tokenize documents from ``sources`` (iterables of documents) into ``writer``, in order.

    Returns the characters of text read. Memory: one chunk of sentences.
    """
    characters, batch, sentences = 0, [], 0
    for document in itertools.chain.from_iterable(sources):
        batch.append(document)
        sentences += len(document)
        characters += sum(map(len, document))
        if sentences >= chunk:
            writer.add(corpus.tokenize_documents(tokenizer, batch))
            batch, sentences = [], 0
    if batch:
        writer.add(corpus.tokenize_documents(tokenizer, batch))
    return characters


class TokenStore:
    """Every rank's token store, read with pread: document ``d`` of the whole corpus on demand.

    ``counts[r]`` is the number of documents rank r stored; documents are
    numbered rank by rank, which is corpus order since ranks took contiguous byte ranges.
    Reading by pread keeps only the documents asked for in memory.
    """

    def __init__(self, scratch, counts, dtype):
        self.dtype = np.dtype(dtype)
        self.starts = [0, *itertools.accumulate(counts)]
        self.count = self.starts[-1]
        self.fds = [{part: os.open(f"{store_prefix(scratch, r)}.{part}", os.O_RDONLY)
                     for part in ("tokens", "sentences", "documents")} for r in range(len(counts))]

    def _ends(self, fd, first, last, itemsize=8):
        """int64 entries [first, last) of an ends file; entry -1 is 0."""
        start = max(first, 0)
        ends = np.frombuffer(os.pread(fd, (last - start) * itemsize, start * itemsize), np.int64)
        return np.concatenate([[0], ends]) if first < 0 else ends

    def _sentences(self, index):
        """(rank's files, first and last sentence) of document ``index``."""
        rank = bisect.bisect_right(self.starts, index) - 1
        fds, local = self.fds[rank], index - self.starts[rank]
        first, last = self._ends(fds["documents"], local - 1, local + 1)
        return fds, int(first), int(last)

    def _tokens(self, fds, first, last):
        return np.frombuffer(os.pread(fds["tokens"], (last - first) * self.dtype.itemsize,
                                      first * self.dtype.itemsize), self.dtype).tolist()

    def document(self, index):
        """Document ``index`` as a list of token-id lists."""
        fds, first, last = self._sentences(index)
        ends = self._ends(fds["sentences"], first - 1, last).tolist()
        tokens = self._tokens(fds, ends[0], ends[-1])
        return [tokens[a - ends[0]:b - ends[0]] for a, b in zip(ends, ends[1:])]

    def random_segment(self, index, rng, target_length):
        """bert_corpus.segment_from, reading only the sentences it takes."""
        fds, first, last = self._sentences(corpus.other_document_index(index, self.count, rng))
        start = first + rng.randint(0, last - first - 1)
        ends = self._ends(fds["sentences"], start - 1, last)
        taken = min(int(np.searchsorted(ends[1:] - ends[0], target_length)) + 1, len(ends) - 1)
        return self._tokens(fds, int(ends[0]), int(ends[taken]))

    def close(self):
        for fds in self.fds:
            for fd in fds.values():
                os.close(fd)


# ----------------------------------------------------------------------------- pass 2: instances

def part_path(scratch, rank, bucket):
    return Path(scratch) / f"part-{rank:05d}-{bucket:05d}.bin"


class ShardParts:
    """Appends this rank's instances, in order, to one scratch file per bucket (local index mod shards).

    Rank r's local instance l is global instance offset_r + l, so its bucket b
    becomes shard (b + offset_r) mod shards once the offsets are known.
    """

    def __init__(self, scratch, rank, shards, dtype):
        self.scratch, self.rank, self.shards, self.dtype = scratch, rank, shards, dtype
        self.pending, self.count = [], 0

    def add(self, instances):
        self.pending.extend(instances)
        if len(self.pending) >= FLUSH_ROWS:
            self.flush()

    def flush(self):
        records = corpus.instances_to_records(self.pending, self.dtype)
        for bucket in range(self.shards):
            rows = records[(bucket - self.count) % self.shards::self.shards]
            if len(rows):
                with open(part_path(self.scratch, self.rank, bucket), "ab") as handle:
                    rows.tofile(handle)
        self.count += len(records)
        self.pending = []


def make_instances(store, documents, options, ids, parts):
    """Instances of corpus documents ``documents`` (a range) into ``parts``; returns their count."""
    for index in documents:
        document = store.document(index)
        for round_index in range(options.dupe_factor):
            rng = corpus.document_rng(options.seed, index, round_index)
            made = corpus.instances_from_document(
                document, options.max_seq_length, options.short_seq_prob, rng, ids,
                lambda rng, length: store.random_segment(index, rng, length))
            if options.masking == "static":
                for instance in made:
                    corpus.mask_instance(instance, options.masked_lm_prob, options.max_predictions_per_seq,
                                         rng, ids)
            parts.add(made)
    parts.flush()
    return parts.count


# ----------------------------------------------------------------------------- pass 3: shards

def shard_records(scratch, shard, offsets, shards, dtype, seed):
    """Shard ``shard``: every rank's part for it in rank (= corpus) order, then shuffled.

    ``offsets[r]`` is the number of instances made by ranks before r.
    """
    pieces = []
    for rank, offset in enumerate(offsets):
        path = part_path(scratch, rank, (shard - offset) % shards)
        if path.exists():
            pieces.append(np.fromfile(path, dtype=dtype))
    records = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    return records[np.random.default_rng([seed, shard]).permutation(len(records))]


def sort_by_bin(records, bin_size, max_seq_length):
    """Rows grouped by length bin (NVIDIA LDDL's binning), shuffled order kept inside a bin.

    Bin b holds lengths in (b*bin_size, (b+1)*bin_size]. Returns (records, rows per bin).
    """
    bins = (records["input_mask"].sum(axis=1, dtype=np.int64) - 1) // bin_size
    order = np.argsort(bins, kind="stable")
    return records[order], np.bincount(bins, minlength=-(-max_seq_length // bin_size)).tolist()
