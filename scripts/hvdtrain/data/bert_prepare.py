"""BERT data preparation at corpus scale: streaming, corpus-wide, balanced (no MPI here).

scripts/prepare_bert_data.py runs three passes, each rank on its share:

1. tokenize: each rank tokenizes the documents that start in its equal byte
   range of the input (the files read as one stream) into a token store (three
   flat files in a scratch directory beside the shards). Documents are then
   numbered across the whole corpus, in input order.
2. instances: each rank makes the instances of a contiguous range of documents
   (ranges of about equal tokens); a "random next" segment is read from any
   rank's store (``TokenStore``, memory-mapped), so it comes from another document
   of the whole corpus. The instances of document d in round k depend only on
   (seed, d, k) and the corpus. An instance is written as two spans of the store
   (``SpanWriter``: 56 bytes, not its 769-byte row). Numbered in (document, round,
   instance) order across the corpus, instance i goes to shard i mod num_shards:
   shards are within one instance of each other.
3. shards: shard s's instances are taken from every rank's span files (in rank
   order, so in corpus order), shuffled with a generator seeded by (seed, s),
   and their rows gathered from the token store straight into the arrays written.

Passes 2 and 3 are pure Python and numpy on one core, while the tokenizer of
pass 1 uses its threads on every core it is given. So each rank runs them in
its share of the node's cores as local worker processes (``run_in_workers``):
worker w of rank r takes the w-th part of r's documents (and writes its own
span file, which comes after worker w-1's in corpus order), and r's shards are
taken one at a time by whichever worker is free.

So the shards are a pure function of the corpus, the vocabulary and the options,
byte for byte, whatever the number of ranks and workers, and memory holds one
chunk of text or one shard at a time, never the corpus (the token store is
mapped: the kernel keeps what is read of it in the page cache).
"""
import bisect
import itertools
import mmap
import multiprocessing
import operator
import os
import shutil
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from hvdtrain.data import bert_corpus as corpus
from hvdtrain.data import bert_data
from hvdtrain.data import bert_instances as instances
from hvdtrain.launch.mpi_world import launched_size

SCRATCH_DIR = ".prepare-scratch"
TOKENIZE_BATCH = 20_000   # sentences per Rust batch call
FLUSH_TOKENS = 1 << 18    # instances (in rows x max_seq_length) buffered before they are written, and
                          # rows filled in one numpy step (whose arrays then fit in the caches)


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


def split_by_tokens(store, documents, parts):
    """``documents`` (a range of the corpus) as ``parts`` contiguous ranges, in order, holding
    about as many tokens each (a document's instances take time in proportion to its tokens)."""
    ends = np.cumsum(store.document_sizes(documents))
    total = int(ends[-1]) if len(ends) else 0
    cuts = [documents.start, *(documents.start + int(np.searchsorted(ends, total * part // parts, side="right"))
                               for part in range(1, parts)), documents.stop]
    return [range(low, max(low, high)) for low, high in zip(cuts, cuts[1:])]


def tokenize_sources(sources, tokenizer, writer, batch=TOKENIZE_BATCH, started=None):
    """Tokenize documents from ``sources`` (iterables of documents) into ``writer``, in order.

    Returns the characters of text read. Memory: two batches of sentences. The
    Rust call for one batch runs in a thread (it releases the GIL and uses the
    tokenizer's own threads) while this one reads the next batch and stores the
    previous one, so reading and storing hide behind tokenizing. ``started``: the
    future of a batch read and submitted before (Batch.encoded), stored first.
    """
    characters, pending = 0, started
    with ThreadPoolExecutor(1) as worker:
        for documents in batches(itertools.chain.from_iterable(sources), batch):
            encoding = worker.submit(Batch(documents, tokenizer).encoded)
            if pending is not None:
                characters += store_encoded(writer, pending.result())
            pending = encoding
        if pending is not None:
            characters += store_encoded(writer, pending.result())
    return characters


class Batch:
    """Whole documents' sentences, one batch for the tokenizer, as its inputs: each run of up to
    GROUP_LINES sentences one text joined by SEPARATOR (its [SEP] ids then mark where each
    sentence's ids end). Fewer, longer inputs cost the tokenizer less than one per sentence
    (an Encoding each, made in Rust, then in Python, then freed), and the ids are those of
    the sentences one by one: the tokenizer splits its input at [SEP] before anything else,
    and the separator's spaces are dropped as any whitespace between words is. A run in which
    some sentence holds "[SEP]" itself is given sentence by sentence. Runs do not mix plain
    sentences (printable ASCII) and others: a plain input goes to the tokenizer's faster twin
    (WordPieceTokenizer.encode_batch)."""

    def __init__(self, documents, tokenizer, group=None):
        self.counts = [len(document) for document in documents]
        self.lines = lines = [sentence for document in documents for sentence in document]
        self.characters, self.tokenizer = sum(map(len, lines)), tokenizer
        self.separator_id = tokenizer.sep_token_id
        group = 1 if self.separator_id is None else GROUP_LINES if group is None else group  # no [SEP]: one by one
        self.inputs, self.lines_per_input, self.plain = [], [], []
        for run, plain in same_kind_runs(lines, group):
            joined = SEPARATOR.join(run)
            if len(run) > 1 and joined.count("[SEP]") == len(run) - 1:
                self.inputs.append(joined)
                self.lines_per_input.append(len(run))
                self.plain.append(plain)
            else:
                self.inputs += run
                self.lines_per_input += [1] * len(run)
                self.plain += [plain] * len(run)

    def encoded(self):
        """(this batch, the Rust call's Encodings of its inputs), for store_encoded."""
        return self, self.tokenizer.encode_batch(self.inputs, self.plain)

    def ids(self, encodings, dtype):
        """The ids of every sentence, end to end, and each sentence's length, from ``encodings`` (of
        the inputs); a joined input is cut at its [SEP] ids, which are left out (split_joined). Where
        they are not where they should be (never seen), the sentences are tokenized again one by one."""
        try:
            return split_joined(encodings, self.lines_per_input, self.separator_id, dtype)
        except ValueError:
            return split_joined(self.tokenizer.encode_batch(self.lines), [1] * len(self.lines), self.separator_id, dtype)


def same_kind_runs(lines, group):
    """(run, plain): consecutive ``lines`` in runs of up to ``group``, each all plain text or all not."""
    for plain, lines_of_kind in itertools.groupby(lines, corpus.is_plain):
        lines_of_kind = list(lines_of_kind)
        for first in range(0, len(lines_of_kind), group):
            yield lines_of_kind[first:first + group], plain


GROUP_LINES = 32  # sentences per tokenizer input (an input of a 20,000-line batch each for ~600 inputs)
SEPARATOR = " [SEP] "


def first_batch(documents, tokenizer, batch=TOKENIZE_BATCH):
    """The Batch tokenize_sources would make first from ``documents`` (an iterator, left at the next one)."""
    return Batch(next(batches(documents, batch), []), tokenizer)


def store_encoded(writer, encoded):
    """One Batch.encoded into the store; returns its characters."""
    batch, encodings = encoded
    writer.add_arrays(*batch.ids(encodings, writer.dtype), batch.counts)
    return batch.characters


def split_joined(encodings, lines_per_input, separator_id, dtype):
    """The ids of every sentence of Batch's inputs, end to end, and each sentence's length:
    an input of n > 1 sentences is cut at its n - 1 [SEP] ids, which are left out."""
    sizes = np.fromiter(map(len, encodings), np.int64, len(encodings))
    flat = np.fromiter(itertools.chain.from_iterable(map(_IDS, encodings)), dtype, int(sizes.sum()))
    lines = np.asarray(lines_per_input, np.int64)
    if not (lines > 1).any():
        return flat, sizes
    input_of = np.repeat(np.arange(len(sizes)), sizes)
    cut = (flat == separator_id) & (lines > 1)[input_of]
    cuts = np.bincount(input_of[cut], minlength=len(sizes))
    if not np.array_equal(cuts, lines - 1):
        raise ValueError("not one [SEP] between joined sentences")
    before = np.cumsum(cut) - cut  # cuts before each token, the whole batch over
    sentence = (np.cumsum(lines) - lines)[input_of] + before - (np.cumsum(cuts) - cuts)[input_of]
    return flat[~cut], np.bincount(sentence[~cut], minlength=int(lines.sum()))


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


_IDS = operator.attrgetter("ids")


def documents_of_rank(files, rank, size):
    """Rank ``rank``'s contiguous share of the corpus's documents (of ``size`` ranks), in corpus
    order: the documents that start in its equal byte range of ``files`` read as one stream
    (``files`` None: the embedded corpus, small and in memory, split by documents)."""
    if files is None:
        documents = corpus.default_corpus_documents()
        return documents[rank * len(documents) // size:(rank + 1) * len(documents) // size]
    total = sum(f.stat().st_size for f in files)
    start, stop = (total * r // size for r in (rank, rank + 1))
    return corpus.documents_in_byte_range(files, start, stop)


class EarlyStart:
    """Under mpirun (Open MPI or MPICH) with --input and --vocab: this rank's first batch of
    text tokenized while MPI starts (MPI_Init holds the GIL for about half a second, mostly
    waiting; the Rust tokenizer needs no GIL). Rank, size and ranks per node come from the
    launcher's environment; the batch is used only if they, the input files and the
    vocabulary (rank 0's, sent to every rank) turn out to be those of the run, else dropped.
    """

    RANK_VARS, LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    NOTE = " (the first batch tokenized while MPI started)"

    @classmethod
    def begin(cls, input_files, vocab, lowercase):
        """The started batch, or None (not launched so, no --vocab, or anything unexpected: the
        script checks and says). ``input_files(size)``: the script's checked input files."""
        size, rank, local = launched_size(), cls._number(cls.RANK_VARS), cls._number(cls.LOCAL_SIZE_VARS)
        if size <= 1 or rank is None or not local or vocab is None:
            return None
        try:
            return cls(input_files(size), vocab, lowercase, rank, size, local)
        except Exception:
            return None

    @staticmethod
    def _number(names):
        return next((int(os.environ[name]) for name in names if os.environ.get(name, "").isdigit()), None)

    def __init__(self, files, vocab, lowercase, rank, size, local):
        if files is None:
            raise ValueError("the embedded corpus is tokenized after MPI starts")
        self.rank, self.size, self.files = rank, size, files
        divide_tokenizer_threads(local)  # before the tokenizer's first call, as the script would
        loaded = corpus.WordPieceTokenizer.load(vocab, lowercase)
        self.vocab = loaded.get_vocab(), bool(getattr(loaded, "do_lower_case", lowercase))
        self.tokenizer = corpus.WordPieceTokenizer.from_vocab(*self.vocab)
        self.documents = documents_of_rank(files, rank, size)
        self.worker, submitted = ThreadPoolExecutor(1), threading.Event()
        self.first = self.worker.submit(self._first_batch, submitted)
        submitted.wait(60)  # the batch is in the tokenizer's hands (and the GIL free) before MPI starts

    def _first_batch(self, submitted):
        batch = first_batch(self.documents, self.tokenizer)
        submitted.set()
        return batch.encoded()

    def taken(self, world, files, vocab):
        """This start, if it is the run's (else None, its batch dropped); the worker thread goes either way."""
        self.worker.shutdown(wait=False)
        if (self.rank, self.size, self.files, self.vocab) != (world.rank, world.size, files, vocab):
            self.first.cancel()
            return None
        return self


class TokenStore:
    """Every rank's token store, memory-mapped: document ``d`` of the whole corpus on demand.

    ``counts[r]`` is the number of documents rank r stored; documents are
    numbered rank by rank, which is corpus order since ranks took contiguous byte ranges.
    The files are mapped, not read: what a worker touches stays in the page cache
    (shared by every worker of the node, and given back by the kernel under pressure),
    and a "random next" segment costs no system call. ``tokens[r]`` is rank r's token
    array; sentence and document ends are read as Python ints (memoryviews).
    """

    def __init__(self, scratch, counts, dtype):
        self.dtype = np.dtype(dtype)
        self.starts = [0, *itertools.accumulate(counts)]
        self.count = self.starts[-1]
        self.tokens, self.sentences, self.documents = [], [], []
        for rank in range(len(counts)):
            prefix = store_prefix(scratch, rank)
            self.tokens.append(np.frombuffer(_mapped(f"{prefix}.tokens"), self.dtype))
            self.sentences.append(memoryview(_mapped(f"{prefix}.sentences")).cast("q"))
            self.documents.append(memoryview(_mapped(f"{prefix}.documents")).cast("q"))

    def _locate(self, index):
        """(rank, first sentence, end sentence) of document ``index``."""
        rank = bisect.bisect_right(self.starts, index) - 1
        local, documents = index - self.starts[rank], self.documents[rank]
        return rank, (documents[local - 1] if local else 0), documents[local]

    def document_ends(self, index):
        """Document ``index`` as (its rank's token array number, [its first token's offset there,
        then each sentence's end])."""
        rank, first, last = self._locate(index)
        sentences = self.sentences[rank]
        return rank, (sentences[first - 1:last].tolist() if first else [0, *sentences[:last].tolist()])

    def random_span(self, index, rng, below, target_length):
        """bert_corpus.segment_from from the store: a segment of a document other than ``index``,
        as (token array number, start, stop); ``below`` is bert_instances.uniform_below(rng)."""
        return self.random_spans(index)(rng, below, target_length)

    def random_spans(self, index):
        """random_span for document ``index`` as a function of (rng, below, target_length), its
        lookups bound once (it makes about half of all instances)."""
        starts, count, sentences, documents = self.starts, self.count, self.sentences, self.documents
        one = len(starts) == 2  # one rank's store: no rank to look up
        bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right

        def random_span(rng, below, target_length):
            other = below(count - 1)  # corpus.other_document_index
            if other >= index:
                other += 1
            rank = 0 if one else bisect_right(starts, other) - 1
            local, ends, documents_of = other - starts[rank], sentences[rank], documents[rank]
            first, last = (documents_of[local - 1] if local else 0), documents_of[local]
            start = first + below(last - first)  # rng.randint(0, last - first - 1)
            begin = ends[start - 1] if start else 0
            # Sentences hold a token or more: target_length sentences reach target_length tokens.
            stop = start + target_length if target_length > 1 else start + 1
            if stop > last:
                stop = last
            end = bisect_left(ends, begin + target_length, start, stop)
            return rank, begin, ends[end if end < stop else stop - 1]
        return random_span

    def document_sizes(self, documents):
        """The number of tokens of each document of ``documents`` (a range of the corpus), an array."""
        sizes = []
        for rank in range(len(self.starts) - 1):
            low, high = max(documents.start, self.starts[rank]), min(documents.stop, self.starts[rank + 1])
            if low >= high:
                continue
            local = np.arange(low, high) - self.starts[rank]
            document_ends = np.asarray(self.documents[rank])  # in sentences
            token_ends = np.asarray(self.sentences[rank])[document_ends[local] - 1]
            first = np.where(local > 0, document_ends[np.maximum(local - 1, 0)], 0)  # first sentence
            token_starts = np.where(first > 0, np.asarray(self.sentences[rank])[np.maximum(first - 1, 0)], 0)
            sizes.append(token_ends - token_starts)
        return np.concatenate(sizes) if sizes else np.zeros(0, np.int64)

    def document(self, index):
        """Document ``index`` as a list of token-id lists."""
        tokens, ends = self.document_arrays(index)
        tokens = tokens.tolist()
        return [tokens[a:b] for a, b in zip(ends, ends[1:])]

    def document_arrays(self, index):
        """Document ``index`` as (its token ids, a list: 0 and each sentence's end)."""
        rank, ends = self.document_ends(index)
        return self.tokens[rank][ends[0]:ends[-1]], [end - ends[0] for end in ends]

    def random_segment(self, index, rng, target_length):
        """bert_corpus.segment_from, reading only the sentences it takes."""
        return self.random_segment_array(index, rng, target_length).tolist()

    def random_segment_array(self, index, rng, target_length):
        """random_segment as an array."""
        rank, start, stop = self.random_span(index, rng, instances.uniform_below(rng), target_length)
        return self.tokens[rank][start:stop]

    def close(self):
        """Nothing to do: the maps close when the last array or view of them goes."""


def _mapped(path):
    """A file's bytes, mapped read-only (an empty file: empty bytes, which cannot be mapped)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)


# ----------------------------------------------------------------------------- pass 2: instances

def span_dtype(max_predictions, static):
    """A row of pass 2: an instance's document_spans (int64s) and, with static masking, its mask
    draws (how many, then their positions, original ids and written ids, 0-padded)."""
    fields = [("span", np.int64, (instances.SPAN_FIELDS,))]
    if static:
        fields += [("masks", np.int32), *((name, np.int32, (max_predictions,))
                                          for name in ("positions", "originals", "written"))]
    return np.dtype(fields)


class SpanWriter:
    """A worker's instances as span_dtype rows, in order, into ShardParts (one file per bucket):
    an instance is 56 bytes there, not its 769-byte shard row, which pass 3 gathers from the
    token store straight into the arrays it writes."""

    def __init__(self, scratch, rank, worker, shards, dtype):
        self.parts = ShardParts(scratch, rank, shards, dtype, worker, SPANS)
        self.static, self.spans, self.masks = "masks" in dtype.names, [], []

    def __len__(self):
        return len(self.spans)

    @property
    def count(self):
        return self.parts.count

    def add(self, made, masks=None):
        self.spans += made
        if masks:
            self.masks += masks

    def flush(self):
        rows = np.zeros(len(self.spans), self.parts.dtype)
        rows["span"] = np.fromiter(itertools.chain.from_iterable(self.spans), np.int64,
                                   instances.SPAN_FIELDS * len(rows)).reshape(-1, instances.SPAN_FIELDS)
        if self.static and len(rows):
            counts, *flat = instances.flat_masks(self.masks)
            rows["masks"] = counts
            held = np.arange(rows["positions"].shape[1]) < counts[:, None]
            for name, values in zip(("positions", "originals", "written"), flat):
                rows[name][held] = values
        self.parts.add_rows(rows)
        self.spans, self.masks = [], []


SPANS = "spans"  # pass 2's ShardParts files (make_instances' rows: "part")


def spans_in_worker(scratch, counts, token_dtype, options, ids, rank, worker, documents):
    """One worker's pass 2 (see run_in_workers): the instances of ``documents`` (a range of the
    corpus) as spans of the token store, into its own span files. Returns (rank, worker, instances made)."""
    store = TokenStore(scratch, counts, token_dtype)
    writer = SpanWriter(scratch, rank, worker, options.num_shards,
                        span_dtype(options.max_predictions_per_seq, options.masking == "static"))
    flush = max(1, FLUSH_TOKENS // options.max_seq_length)
    for made, masks in document_rounds(store, documents, options, ids):
        writer.add(made, masks)
        if len(writer) >= flush:
            writer.flush()
    writer.flush()
    return rank, worker, writer.count


def document_rounds(store, documents, options, ids):
    """(document_spans, mask_draws or None) of each round of each document of ``documents``,
    in order. Document d's rounds draw from their own generators (bert_corpus.document_rng),
    static masks right after the round's pairs, as bert_corpus's reference does."""
    static = options.masking == "static"
    seed, rounds, document_rng = options.seed, range(options.dupe_factor), corpus.document_rng
    length, short, spans, below = options.max_seq_length, options.short_seq_prob, instances.document_spans, \
        instances.uniform_below
    for index in documents:
        source, ends = store.document_ends(index)
        random_span = store.random_spans(index)
        for round_index in rounds:
            rng = document_rng(seed, index, round_index)
            made = spans(source, ends, length, short, rng, below(rng), random_span)
            yield made, ([instances.mask_draws(*instances.span_segments(store.tokens, span), options.masked_lm_prob,
                                               options.max_predictions_per_seq, rng, ids) for span in made]
                         if static else None)


def part_path(scratch, rank, bucket, worker=0, prefix="part"):
    return Path(scratch) / f"{prefix}-{rank:05d}.{worker:03d}-{bucket:05d}.bin"


class ShardParts:
    """Appends a worker's instances as rows, in order, to one file per bucket (local index mod shards).

    Its local instance l is global instance offset + l (offset: the instances of
    the workers before it, in corpus order), so bucket b becomes shard
    (b + offset) mod shards once the offsets are known. Pass 2 writes its span rows so
    (SpanWriter); make_instances the shard rows themselves.
    """

    def __init__(self, scratch, rank, shards, dtype, worker=0, prefix="part"):
        self.scratch, self.rank, self.worker, self.shards, self.dtype = scratch, rank, worker, shards, dtype
        self.prefix, self.count = prefix, 0

    def add_rows(self, records):
        """Append ``records`` (the next instances of this rank, in order) to their buckets."""
        for bucket in range(self.shards):
            rows = records[(bucket - self.count) % self.shards::self.shards]
            if len(rows):
                with open(part_path(self.scratch, self.rank, bucket, self.worker, self.prefix), "ab") as handle:
                    rows.tofile(handle)
        self.count += len(records)


def make_instances(store, documents, options, ids, parts):
    """Instances of corpus documents ``documents`` (a range) as rows into ``parts`` (ShardParts);
    returns their count. Pass 2's loop (document_rounds) with pass 3's fill (fill_rows)."""
    builder = instances.SpanBuilder(parts.dtype, ids, store.tokens)
    flush_rows = max(1, FLUSH_TOKENS // options.max_seq_length)
    for made, masks in document_rounds(store, documents, options, ids):
        builder.add(made, masks)
        if len(builder) >= flush_rows:
            parts.add_rows(builder.take())
    parts.add_rows(builder.take())
    return parts.count


# ----------------------------------------------------------------------------- pass 3: shards

def shard_parts(scratch, shard, made, shards, dtype, prefix="part", remove=False):
    """Shard ``shard``'s rows (ShardParts') before the shuffle: every worker's part for it in
    corpus order, read into one array; ``remove``: each part removed once read.

    ``made``: (rank, worker, instances made) of every worker of every rank, in corpus order;
    global instance i goes to shard i mod ``shards``.
    """
    paths, offset = [], 0
    for rank, worker, count in made:
        path = part_path(scratch, rank, (shard - offset) % shards, worker, prefix)
        offset += count
        try:
            paths.append((path, os.stat(path).st_size))
        except FileNotFoundError:
            pass
    rows = np.empty(sum(size for _, size in paths) // dtype.itemsize, dtype=dtype)
    buffer, position = memoryview(rows.view(np.uint8)), 0
    for path, size in paths:
        with open(path, "rb", buffering=0) as handle:
            while size:
                read = handle.readinto(buffer[position:position + size])
                if not read:
                    raise RuntimeError(f"{path} ended early (changed while being read?)")
                position, size = position + read, size - read
        if remove:
            path.unlink()
    return rows


def shard_order(seed, shard, count):
    """The shuffle of shard ``shard``'s rows (seeded by (seed, shard))."""
    return np.random.default_rng([seed, shard]).permutation(count)


def write_shards(shards, scratch, made, options, dtype, ids, counts, token_dtype):
    """One worker's pass 3: shards ``shards`` into options.output_dir.

    A shard's instances (pass 2's span rows for it) are shuffled, grouped by length bin
    (--bin-size), and their rows gathered from the token store straight into the arrays
    written, a block of rows at a time. ``dtype``: the rows' record_dtype; ``ids``: SpecialIds;
    ``counts``: documents per rank (the token store's). Returns [{"file", "instances",
    "sha256"(, "bins")}] for the metadata.
    """
    static = options.masking == "static"
    store, spans_dtype, written = TokenStore(scratch, counts, token_dtype), \
        span_dtype(options.max_predictions_per_seq, static), []
    block = max(1, FLUSH_TOKENS // options.max_seq_length)
    for shard in shards:
        rows = shard_parts(scratch, shard, made, options.num_shards, spans_dtype, SPANS, remove=True)
        order = shard_order(options.seed, shard, len(rows))
        entry = {"file": bert_data.shard_name(shard), "instances": len(rows)}
        if options.bin_size:
            spans = rows["span"]
            lengths = (spans[:, 2] - spans[:, 1] + spans[:, 5] - spans[:, 4] + 3)[order]
            within, entry["bins"] = bin_order(lengths, options.bin_size, options.max_seq_length)
            order = order[within]
        rows = rows[order]
        columns = {name: np.empty((len(rows), *dtype[name].shape), dtype[name].base) for name in dtype.names}
        for first in range(0, len(rows), block):
            these = rows[first:first + block]
            instances.fill_rows(these["span"], store.tokens, ids,
                                {name: column[first:first + block] for name, column in columns.items()},
                                span_masks(these) if static else None)
        entry["sha256"] = bert_data.write_shard(options.output_dir / entry["file"], columns)
        written.append(entry)
    return written


def span_masks(rows):
    """The mask draws of span_dtype rows as flat_masks."""
    counts = rows["masks"].astype(np.int64)
    held = np.arange(rows["positions"].shape[1]) < counts[:, None]
    return (counts, *(rows[name][held] for name in ("positions", "originals", "written")))


def bin_order(lengths, bin_size, max_seq_length):
    """sort_by_bin's order of rows of these lengths, and its rows per bin."""
    bins = (lengths - 1) // bin_size
    return np.argsort(bins, kind="stable"), np.bincount(bins, minlength=-(-max_seq_length // bin_size)).tolist()


def sort_by_bin(records, bin_size, max_seq_length):
    """Rows grouped by length bin (NVIDIA LDDL's binning), shuffled order kept inside a bin.

    Bin b holds lengths in (b*bin_size, (b+1)*bin_size]. Returns (records, rows per bin).
    """
    order, counts = bin_order(records["input_mask"].sum(axis=1, dtype=np.int64), bin_size, max_seq_length)
    return records[order], counts


def process_age():
    """Seconds since this process started (Linux; 0 elsewhere): its interpreter's start-up and imports."""
    try:
        with open("/proc/self/stat") as handle:
            started = int(handle.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class PhaseTimer:
    """Seconds per stage (rank 0's clock, from its process's start) and the input rate: the figures
    the README quotes. Not collective: the script marks each pass after an allgather, which no rank
    leaves before every rank has finished the pass."""

    def __init__(self, size):
        self.size, self.last, self.characters = size, time.time(), 0
        self.seconds = {"start-up": process_age()}

    def done(self, phase, characters=None):
        now = time.time()
        self.seconds[phase], self.last = now - self.last, now
        if characters is not None:
            self.characters = characters

    def total(self):
        return sum(self.seconds.values())

    def summary(self):
        megabytes = self.characters / 1e6
        passes = sum(self.seconds.get(name, 0.0) for name in ("tokenize", "instances", "shards"))
        phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items())
        return (f"{megabytes:.1f} M characters; {phases}; "
                f"{megabytes / passes / self.size:.2f} MB/s per rank after the vocabulary")
