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

Passes 2 and 3 are pure Python and numpy on one core, while the tokenizer of
pass 1 uses its threads on every core it is given. So each rank runs them in
its share of the node's cores as local worker processes (``run_in_workers``):
worker w of rank r takes the w-th part of r's documents (and writes its own
parts, which come after worker w-1's in corpus order) and of r's shards.

So the shards are a pure function of the corpus, the vocabulary and the options,
byte for byte, whatever the number of ranks, and memory holds one chunk of text
or one shard at a time, never the corpus.
"""
import bisect
import functools
import itertools
import multiprocessing
import os
import shutil
import struct
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from hvdtrain.data import bert_corpus as corpus
from hvdtrain.data import bert_data
from hvdtrain.data import bert_instances as instances

SCRATCH_DIR = ".prepare-scratch"
TOKENIZE_BATCH = 20_000   # sentences per Rust batch call
FLUSH_TOKENS = 1 << 20    # instances buffered (in rows x max_seq_length) before they go to the shard parts


def clear_output(directory):
    """Remove what an earlier run wrote here (only our own file names)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in directory.glob("shard-*.h5"):
        path.unlink()
    shutil.rmtree(directory / SCRATCH_DIR, ignore_errors=True)
    (directory / bert_data.METADATA).unlink(missing_ok=True)
    shutil.rmtree(directory / bert_data.TOKENIZER_DIR, ignore_errors=True)


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
        """``documents``: lists of token-id lists; empty sentences and documents are skipped."""
        documents = [d for d in documents if d]
        sentences = [s for d in documents for s in d]
        ids = np.fromiter(itertools.chain.from_iterable(sentences), self.dtype)
        self.add_arrays(ids, np.array([len(s) for s in sentences], np.int64), [len(d) for d in documents])

    def add_arrays(self, ids, lengths, sentence_counts):
        """The same from ``ids`` (flat), each sentence's length and each document's sentence count."""
        kept = lengths > 0
        if not kept.any():
            return
        document_of = np.repeat(np.arange(len(sentence_counts)), sentence_counts)
        per_document = np.bincount(document_of[kept], minlength=len(sentence_counts))
        per_document = per_document[per_document > 0]
        sentence_ends = self.tokens + np.cumsum(lengths[kept], dtype=np.int64)
        document_ends = self.sentences + np.cumsum(per_document, dtype=np.int64)
        ids.astype(self.dtype, copy=False).tofile(self.handles["tokens"])
        sentence_ends.tofile(self.handles["sentences"])
        document_ends.tofile(self.handles["documents"])
        self.tokens += len(ids)
        self.sentences += len(sentence_ends)
        self.documents += len(document_ends)

    def close(self):
        for handle in self.handles.values():
            handle.close()


def cpus_per_rank(local_ranks):
    """This rank's share of the CPUs it may run on (its affinity), divided among the node's ranks; at least 1.

    The tokenizer's threads (pass 1) and the worker processes (passes 2 and 3) both take this share.
    """
    return max(1, len(os.sched_getaffinity(0)) // local_ranks)


def divide_tokenizer_threads(local_ranks):
    """Give each of this node's ranks its share of the CPUs it may run on for the tokenizer.

    The Rust tokenizer's thread pool (rayon) takes RAYON_NUM_THREADS, read once
    when the pool starts (the first batch call); by default one thread per CPU of
    the process's affinity, so N unbound ranks on a node would run N x CPUs
    threads. A value already set is kept. Returns the number of threads.
    """
    if not os.environ.get("RAYON_NUM_THREADS"):
        os.environ["RAYON_NUM_THREADS"] = str(cpus_per_rank(local_ranks))
    return int(os.environ["RAYON_NUM_THREADS"])


def run_in_workers(function, tasks, workers):
    """``function(*task)`` for every task, in up to ``workers`` forked processes; results in order.

    With one worker (or one task) it runs here, forking nothing: N ranks on N cores stay
    N processes. The children only compute and write files; they never call MPI, and they
    leave with os._exit (no atexit MPI_Finalize). TOKENIZERS_PARALLELISM, if unset, is set
    to its default ("true") first: `tokenizers` otherwise warns on fork after its threads ran.
    """
    if workers <= 1 or len(tasks) <= 1:
        return [function(*task) for task in tasks]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # A process pool that fails when a worker dies (multiprocessing.Pool would wait for it for good).
    context = multiprocessing.get_context("fork")
    try:
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context) as pool:
            return list(pool.map(function, *zip(*tasks)))
    except BrokenProcessPool:
        raise RuntimeError(f"a worker process of data preparation died while running {function.__name__} "
                           "(killed, or out of memory?); rerun with fewer --workers") from None


def split_range(numbers, parts):
    """``numbers`` (a range) as ``parts`` contiguous ranges, in order, sizes within one."""
    size = len(numbers)
    return [numbers[size * part // parts:size * (part + 1) // parts] for part in range(parts)]


def tokenize_sources(sources, tokenizer, writer, batch=TOKENIZE_BATCH):
    """Tokenize documents from ``sources`` (iterables of documents) into ``writer``, in order.

    Returns the characters of text read. Memory: two batches of sentences. The
    Rust call for one batch runs in a thread (it releases the GIL and uses the
    tokenizer's own threads) while this one reads the next batch and stores the
    previous one, so reading and storing hide behind tokenizing.
    """
    backend, characters, pending = tokenizer.backend_tokenizer, 0, None
    with ThreadPoolExecutor(1) as worker:
        for documents in batches(itertools.chain.from_iterable(sources), batch):
            lines = [sentence for document in documents for sentence in document]
            characters += sum(map(len, lines))
            encoding = worker.submit(backend.encode_batch_fast, lines, add_special_tokens=False)
            if pending is not None:
                store_batch(writer, pending[0], pending[1].result())
            pending = ([len(d) for d in documents], encoding)
        if pending is not None:
            store_batch(writer, pending[0], pending[1].result())
    return characters


def batches(documents, sentences):
    """Whole documents, grouped until a group holds at least ``sentences`` sentences."""
    group, count = [], 0
    for document in documents:
        group.append(document)
        count += len(document)
        if count >= sentences:
            yield group
            group, count = [], 0
    if group:
        yield group


def store_batch(writer, sentence_counts, encodings):
    """One tokenized batch (the Rust call's Encodings, a list per sentence) into the store."""
    lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), writer.dtype, int(lengths.sum()))
    writer.add_arrays(ids, lengths, sentence_counts)


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
        if local == 0:  # struct, not numpy: two numbers read for every "random next" segment
            return fds, 0, struct.unpack("=q", os.pread(fds["documents"], 8, 0))[0]
        return fds, *struct.unpack("=2q", os.pread(fds["documents"], 16, (local - 1) * 8))

    def _tokens(self, fds, first, last):
        return np.frombuffer(os.pread(fds["tokens"], (last - first) * self.dtype.itemsize,
                                      first * self.dtype.itemsize), self.dtype)

    def document(self, index):
        """Document ``index`` as a list of token-id lists."""
        tokens, ends = self.document_arrays(index)
        tokens = tokens.tolist()
        return [tokens[a:b] for a, b in zip(ends, ends[1:])]

    def document_arrays(self, index):
        """Document ``index`` as (its token ids, a list: 0 and each sentence's end)."""
        fds, first, last = self._sentences(index)
        ends = self._ends(fds["sentences"], first - 1, last)
        return self._tokens(fds, int(ends[0]), int(ends[-1])), (ends - ends[0]).tolist()

    def random_segment(self, index, rng, target_length):
        """bert_corpus.segment_from, reading only the sentences it takes."""
        return self.random_segment_array(index, rng, target_length).tolist()

    def random_segment_array(self, index, rng, target_length):
        """random_segment as an array."""
        fds, first, last = self._sentences(corpus.other_document_index(index, self.count, rng))
        start = first + rng.randint(0, last - first - 1)
        # Sentences hold a token or more: target_length sentences reach target_length tokens.
        ends = self._ends(fds["sentences"], start - 1, min(last, start + max(target_length, 1)))
        taken = min(int(np.searchsorted(ends[1:] - ends[0], target_length)) + 1, len(ends) - 1)
        return self._tokens(fds, int(ends[0]), int(ends[taken]))

    def close(self):
        for fds in self.fds:
            for fd in fds.values():
                os.close(fd)


# ----------------------------------------------------------------------------- pass 2: instances

def part_path(scratch, rank, bucket, worker=0):
    return Path(scratch) / f"part-{rank:05d}.{worker:03d}-{bucket:05d}.bin"


class ShardParts:
    """Appends a worker's instances, in order, to one scratch file per bucket (local index mod shards).

    Its local instance l is global instance offset + l (offset: the instances of
    the workers before it, in corpus order), so bucket b becomes shard
    (b + offset) mod shards once the offsets are known.
    """

    def __init__(self, scratch, rank, shards, dtype, worker=0):
        self.scratch, self.rank, self.worker, self.shards, self.dtype = scratch, rank, worker, shards, dtype
        self.count = 0

    def add_rows(self, records):
        """Append ``records`` (the next instances of this rank, in order) to their buckets."""
        for bucket in range(self.shards):
            rows = records[(bucket - self.count) % self.shards::self.shards]
            if len(rows):
                with open(part_path(self.scratch, self.rank, bucket, self.worker), "ab") as handle:
                    rows.tofile(handle)
        self.count += len(records)


def instances_in_worker(scratch, counts, token_dtype, options, dtype, ids, rank, worker, documents):
    """One worker's pass 2 (see run_in_workers): the instances of ``documents`` (a range of the
    corpus) into its own shard parts. Returns (rank, worker, instances made)."""
    store = TokenStore(scratch, counts, token_dtype)
    try:
        parts = ShardParts(scratch, rank, options.num_shards, dtype, worker)
        return rank, worker, make_instances(store, documents, options, ids, parts)
    finally:
        store.close()


def make_instances(store, documents, options, ids, parts):
    """Instances of corpus documents ``documents`` (a range) into ``parts``; returns their count.

    Document d's rounds draw from their own generators (bert_corpus.document_rng),
    static masks right after the round's pairs, as bert_corpus's reference does.
    """
    builder = instances.RecordBuilder(parts.dtype, ids)
    flush_rows = max(1, FLUSH_TOKENS // options.max_seq_length)
    for index in documents:
        tokens, ends = store.document_arrays(index)
        random_segment = functools.partial(store.random_segment_array, index)
        for round_index in range(options.dupe_factor):
            rng = corpus.document_rng(options.seed, index, round_index)
            made = instances.document_instances(tokens, ends, options.max_seq_length, options.short_seq_prob,
                                                rng, random_segment)
            builder.add(made, mask_rows(made, options, rng, ids))
        if len(builder) >= flush_rows:
            parts.add_rows(builder.take())
    parts.add_rows(builder.take())
    return parts.count


def mask_rows(made, options, rng, ids):
    """Static masking's draws for one round's instances (None: dynamic masking)."""
    if options.masking != "static":
        return None
    return [instances.mask_draws(a, b, options.masked_lm_prob, options.max_predictions_per_seq, rng, ids)
            for a, b, _ in made]


# ----------------------------------------------------------------------------- pass 3: shards

def shard_records(scratch, shard, made, shards, dtype, seed):
    """Shard ``shard``: every worker's part for it in corpus order, then shuffled.

    ``made``: (rank, worker, instances made) of every worker of every rank, in corpus order.
    """
    pieces, offset = [], 0
    for rank, worker, count in made:
        path = part_path(scratch, rank, (shard - offset) % shards, worker)
        offset += count
        if path.exists():
            pieces.append(np.fromfile(path, dtype=dtype))
    records = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    return records[np.random.default_rng([seed, shard]).permutation(len(records))]


def write_shards(shards, scratch, made, options, dtype):
    """One worker's pass 3: shards ``shards`` into options.output_dir.

    Returns [{"file", "instances", "sha256"(, "bins")}] for the metadata.
    """
    written = []
    for shard in shards:
        records = shard_records(scratch, shard, made, options.num_shards, dtype, options.seed)
        entry = {"file": bert_data.shard_name(shard), "instances": len(records)}
        if options.bin_size:
            records, entry["bins"] = sort_by_bin(records, options.bin_size, options.max_seq_length)
        entry["sha256"] = bert_data.write_shard(options.output_dir / entry["file"], corpus.records_to_arrays(records))
        written.append(entry)
    return written


def sort_by_bin(records, bin_size, max_seq_length):
    """Rows grouped by length bin (NVIDIA LDDL's binning), shuffled order kept inside a bin.

    Bin b holds lengths in (b*bin_size, (b+1)*bin_size]. Returns (records, rows per bin).
    """
    bins = (records["input_mask"].sum(axis=1, dtype=np.int64) - 1) // bin_size
    order = np.argsort(bins, kind="stable")
    return records[order], np.bincount(bins, minlength=-(-max_seq_length // bin_size)).tolist()
