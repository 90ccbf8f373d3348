"""BERT pretraining shards: the on-disk format, its checks, and training batches.

Pure (no Horovod): the trainer passes rank and size in.
"""
import bisect
import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

# torch (and the samplers, which use it) only where training reads batches: prepare_bert_data.py
# imports this module for the shard format and does not load torch.
from hvdtrain.data.bert_corpus import WordPieceTokenizer, vocab_hash
from hvdtrain.errors import UsageError

FORMAT_NAME = "hvdtrain-bert-shards"
FORMAT_VERSION = 1
METADATA = "metadata.json"
TOKENIZER_DIR = "tokenizer"

SHARD_FORMAT_DOC = """\
Shard format, version 1 (a directory written by scripts/prepare_bert_data.py):

  metadata.json       format, format_version, vocab_sha256, vocab_size, lowercase,
                      special_ids, max_seq_length, max_predictions_per_seq,
                      masking ("static" or "dynamic"), masked_lm_prob,
                      short_seq_prob, dupe_factor, seed, num_instances,
                      shards: [{"file", "instances", "sha256"}], source, world_size
                      (sha256 of each shard file, checked whenever it is loaded;
                      shards listed without one are checked by value range only)
                      with --bin-size: bin_size, and each shard's "bins": rows per
                      length bin (bin b: lengths in (b*bin_size, (b+1)*bin_size]),
                      the shard's rows being grouped by bin in that order
  tokenizer/          Hugging Face tokenizer (tokenizer.json, tokenizer_config.json)
                      and vocab.txt
  shard-NNNNN.h5      HDF5, one row per instance (NVIDIA's dataset names); shards hold
                      num_instances / num_shards instances, give or take one
                      (since prepare_bert_data.py balances them; older ones may
                      differ, and training accepts any sizes, 0 included):
      input_ids             int32 [n, max_seq_length]   [CLS] A [SEP] B [SEP], 0-padded
      segment_ids           int8  [n, max_seq_length]   0 for A, 1 for B
      input_mask            int8  [n, max_seq_length]   1 on real tokens
      next_sentence_labels  int8  [n]                   1 when B is a random segment
    static masking only (input_ids already masked 80/10/10):
      masked_lm_positions   int32 [n, max_predictions]  0-padded ([CLS] is never masked)
      masked_lm_ids         int32 [n, max_predictions]  original tokens at those positions
    attribute format_version = 1
"""

ARRAYS = ("input_ids", "segment_ids", "input_mask", "next_sentence_labels")
STATIC_ARRAYS = ("masked_lm_positions", "masked_lm_ids")


def shard_name(index):
    return f"shard-{index:05d}.h5"


# ----------------------------------------------------------------------------- writing

def write_shard(path, arrays):
    """One shard, written to a temporary name and renamed (no half-written shards).

    Returns the file's sha256, recorded in the metadata.
    """
    import h5py
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as handle:
        handle.attrs["format_version"] = FORMAT_VERSION
        for name, array in arrays.items():
            handle.create_dataset(name, data=array, **storage(array))
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    return digest


CHUNK_ROWS = 1024  # rows per compressed chunk


def storage(array):
    """How a column is stored: chunks of whole rows (a piece of rows read decompresses only its own
    chunks, not every row of a column band as h5py's automatic chunks do), bytes shuffled, then gzip
    at level 1 (int32 token ids keep their high bytes apart, all zero: a quarter less to compress, 30 %
    smaller files; measured in docs/performance.md). Any HDF5 reader reads it: shuffle and gzip are
    HDF5's own filters. A column of no rows is stored plain (a chunk may not exceed the data)."""
    if not len(array):
        return {}
    return {"chunks": (min(CHUNK_ROWS, len(array)), *array.shape[1:]), "shuffle": True,
            "compression": "gzip", "compression_opts": 1}


def file_sha256(path):
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def write_metadata(directory, metadata):
    path = Path(directory) / METADATA
    tmp = path.with_name(f".{METADATA}.tmp")
    tmp.write_text(json.dumps(metadata, indent=2) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- checking

def read_metadata(directory):
    """The metadata of a shard directory, or a UsageError naming what is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"data directory not found: {directory} (run scripts/prepare_bert_data.py)")
    path = directory / METADATA
    if not path.is_file():
        raise UsageError(f"no shards in {directory}: {METADATA} is missing (run scripts/prepare_bert_data.py)")
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    if metadata.get("format") != FORMAT_NAME or metadata.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path}: unsupported shard format {metadata.get('format')!r} "
                         f"version {metadata.get('format_version')!r} (expected {FORMAT_NAME} v{FORMAT_VERSION})")
    if not metadata.get("shards") or not metadata.get("num_instances"):
        raise UsageError(f"no shards in {directory}: {METADATA} lists no instances")
    return metadata


def verify_checksum(path, entry):
    """The shard's bytes are those written by prepare_bert_data.py (when it recorded them)."""
    expected = entry.get("sha256")
    if expected and file_sha256(path) != expected:
        raise UsageError(f"corrupt shard {path}: its sha256 differs from the one in {METADATA} "
                         "(damaged since it was written, or a file from another preparation)")


def check_shard(directory, entry, metadata):
    """Open one shard and compare its arrays with the metadata; UsageError naming the file."""
    import h5py
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise UsageError(f"shard missing: {path}")
    verify_checksum(path, entry)
    names = ARRAYS + (STATIC_ARRAYS if metadata["masking"] == "static" else ())
    try:
        with h5py.File(path, "r") as handle:
            shapes = {name: handle[name].shape for name in names if name in handle}
            # Every value, one array at a time: a foreign shard is named now, on every rank,
            # not mid-epoch on the one rank that streams it in.
            for name in shapes:
                check_values(path, {name: handle[name][...]}, metadata)
    except UsageError:
        raise
    except Exception as error:  # h5py raises OSError, KeyError, ... for damaged files
        raise UsageError(f"corrupt shard {path}: {error.__class__.__name__}: {error}") from None
    missing = [name for name in names if name not in shapes]
    if missing and metadata_rows(entry) == 0:
        return  # an empty shard (older preparations wrote no masked-LM arrays there): nothing to read
    if missing:
        raise UsageError(f"corrupt shard {path}: missing {', '.join(missing)}")
    rows, length = metadata_rows(entry), metadata["max_seq_length"]
    if "bins" in entry and sum(entry["bins"]) != rows:
        raise UsageError(f"{METADATA} of {directory}: the length bins of {entry['file']} count "
                         f"{sum(entry['bins'])} rows, not its {rows} instances")
    if shapes["input_ids"] != (rows, length):
        raise UsageError(f"shard {path} holds input_ids of shape {shapes['input_ids']}, "
                         f"but {METADATA} says ({rows}, {length})")


def metadata_rows(entry):
    return int(entry["instances"])


def load_rows(directory, entry, start, stop, names, metadata):
    """Rows [start, stop) of ``names`` from one shard, checked; a dict of arrays.

    A damaged or foreign shard is named in a UsageError here, not met later as an
    IndexError (CPU) or a device-side assert that kills the CUDA context (GPU).
    """
    import h5py
    path = Path(directory) / entry["file"]
    verify_checksum(path, entry)
    try:
        with h5py.File(path, "r") as handle:
            arrays = {name: handle[name][start:stop] for name in names}
    except Exception as error:
        raise UsageError(f"corrupt shard {path}: {error.__class__.__name__}: {error}") from None
    check_values(path, arrays, metadata)
    return arrays


def check_values(path, arrays, metadata):
    """Every token id inside the vocabulary, every position inside the sequence, flags 0/1."""
    limits = {"input_ids": metadata["vocab_size"], "masked_lm_ids": metadata["vocab_size"],
              "masked_lm_positions": metadata["max_seq_length"], "segment_ids": 2, "input_mask": 2,
              "next_sentence_labels": 2}
    for name, array in arrays.items():
        if array.size and (array.min() < 0 or array.max() >= limits[name]):
            raise UsageError(f"corrupt shard {path}: {name} holds values in [{array.min()}, {array.max()}], "
                             f"outside [0, {limits[name] - 1}] for this data set's {METADATA}")


# ----------------------------------------------------------------------------- training data

class ShardStream:
    """One rank's rows of an epoch, read piece by piece: [(shard entry, start, stop)].

    Pieces are read in order, each shuffled (seeded by ``key`` and its index),
    the next one read ahead by ``reader`` (a one-thread executor): memory holds
    about two pieces. ``rows(position, count)`` is a pure function of the
    pieces, the key and the position, so a resumed run reads the same rows.
    """

    def __init__(self, pieces, key, load, reader, reading=contextlib.nullcontext):
        self.pieces, self.key, self.load, self.reader = pieces, key, load, reader
        self.reading = reading  # context around a read the step waits for (a watchdog phase)
        self.ends = np.cumsum([stop - start for _, start, stop in pieces]).tolist()
        self.loaded, self.prefetched = {}, None

    def _read(self, index):
        entry, start, stop = self.pieces[index]
        order = np.random.default_rng([*self.key, index]).permutation(stop - start)
        return self.load(entry, start, stop), order

    def piece(self, index):
        """Piece ``index``, read now or by the prefetch; starts reading the next one."""
        if index not in self.loaded:
            waiting, self.prefetched = self.prefetched, None
            # A slow file system makes this step slow: no hang, so inside ``reading``.
            with self.reading():
                if waiting is not None and waiting[0] == index:
                    self.loaded = {index: waiting[1].result()}
                else:
                    self.loaded = {index: self._read(index)}
            if index + 1 < len(self.pieces):
                self.prefetched = (index + 1, self.reader.submit(self._read, index + 1))
        return self.loaded[index]

    def piece_at(self, position):
        return bisect.bisect_right(self.ends, position)

    def rows(self, position, count):
        """``count`` rows from ``position`` on, across pieces: a list of dicts of arrays."""
        parts = []
        while count:
            index = self.piece_at(position)
            arrays, order = self.piece(index)
            offset = position - (self.ends[index - 1] if index else 0)
            rows = order[offset:offset + count]
            parts.append({name: array[rows] for name, array in arrays.items()})
            position, count = position + len(rows), count - len(rows)
        return parts


class PretrainingData:
    """This rank's examples, epoch by epoch, read shard by shard, in a resumable order.

    Each epoch the shards are shuffled by seed+epoch and laid end to end; rank r
    takes the r-th of ``size`` equal slices (``assign_rows``), so every instance
    belongs to exactly one rank. All ranks take the same number of steps,
    computed from the metadata without talking: the smallest share
    (num_instances // size) divided by the global batch. The remainder (fewer
    than size x (batch x accumulation + 1) instances) waits for a later epoch:
    the shard order and the orders inside the pieces change every epoch.

    A rank reads its pieces (a shard, or part of one where a slice boundary
    cuts it) one at a time (``ShardStream``): memory holds about two shards, not
    the epoch. Micro-batch ``(epoch, step, micro)`` is a pure function of those
    numbers, the seed, rank and size, which makes resuming exact.

    Sequence-length binning (``binned``, shards prepared with --bin-size): the
    same, bin by bin (each shard holds its rows sorted by bin, counts in the
    metadata); every step draws from one bin, the same on every rank (a
    seeded schedule of the bins' steps), and is cut to the bin's longest
    length, so short sequences are not padded to max_seq_length.
    """

    def __init__(self, directory, metadata, rank, size, seed, micro_batch, accumulation,
                 mlm_probability=0.15, binned=False, reading=contextlib.nullcontext):
        self.directory = Path(directory)
        self.metadata = metadata
        self.rank, self.size, self.seed = rank, size, seed
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.mlm_probability = mlm_probability
        self.static = metadata["masking"] == "static"
        self.special = metadata["special_ids"]
        self.entries = metadata["shards"]
        self.names = ARRAYS + (STATIC_ARRAYS if self.static else ())
        self.bin_size = metadata.get("bin_size") if binned else None
        self.bins = self._bins()
        self.epoch, self.streams, self.schedule = None, None, None
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
        self.reading = reading  # see ShardStream

    def _bins(self):
        """Per bin: ([rows of that bin in each shard], first row of the bin in each shard, length)."""
        if not self.bin_size:
            return [([metadata_rows(e) for e in self.entries], [0] * len(self.entries),
                     self.metadata["max_seq_length"])]
        counts = np.array([e["bins"] for e in self.entries], dtype=np.int64).reshape(len(self.entries), -1)
        firsts = np.cumsum(counts, axis=1) - counts
        return [(counts[:, b].tolist(), firsts[:, b].tolist(),
                 min(self.metadata["max_seq_length"], (b + 1) * self.bin_size)) for b in range(counts.shape[1])]

    def _bin_steps(self):
        return [sum(sizes) // self.size // (self.micro_batch * self.accumulation) for sizes, _, _ in self.bins]

    def steps_in_epoch(self, epoch):
        """Optimizer steps every rank takes in an epoch (the smallest share decides)."""
        return sum(self._bin_steps())

    def start_epoch(self, epoch, step=0):
        """Plan ``epoch`` and read the piece that optimizer step ``step`` starts in.

        Reading it here lets the caller agree on a damaged shard across ranks.
        """
        from hvdtrain.data.sampling import assign_rows  # training only (see the imports above)
        self.epoch, self.streams = epoch, []
        for b, (sizes, firsts, _) in enumerate(self.bins):
            pieces = [(self.entries[shard], firsts[shard] + start, firsts[shard] + stop)
                      for shard, start, stop in assign_rows(sizes, self.rank, self.size, self.seed, epoch)]
            self.streams.append(ShardStream(pieces, (self.seed, epoch, self.rank, b), self._load, self.reader,
                                            self.reading))
        # Step -> (bin, step within the bin): a seeded shuffle of every bin's steps, the same on every rank.
        bins = np.repeat(np.arange(len(self.bins)), self._bin_steps())
        bins = bins[np.random.default_rng([self.seed, epoch]).permutation(len(bins))]
        within = np.zeros(len(bins), dtype=np.int64)
        for b in range(len(self.bins)):
            within[bins == b] = np.arange(int((bins == b).sum()))
        self.schedule = list(zip(bins.tolist(), within.tolist()))
        if step < len(self.schedule):
            b, k = self.schedule[step]
            stream = self.streams[b]
            stream.piece(stream.piece_at(k * self.accumulation * self.micro_batch))

    def advance(self, global_step):
        """The step trained: nothing to record (a rank's share of the epoch is a function of the step)."""

    def _load(self, entry, start, stop):
        return load_rows(self.directory, entry, start, stop, self.names, self.metadata)

    def batch(self, step, micro):
        """Micro-batch ``micro`` of optimizer step ``step`` (counted within the epoch)."""
        b, k = self.schedule[step]
        parts = self.streams[b].rows((k * self.accumulation + micro) * self.micro_batch, self.micro_batch)
        rng = None if self.static else np.random.default_rng([self.seed, self.epoch, self.rank, step, micro])
        return self._tensors(parts, b, rng)

    def _tensors(self, parts, b, rng):
        """The model's tensors from rows of bin ``b`` (``rng``: dynamic masking's draws)."""
        pick = {name: np.concatenate([part[name] for part in parts]) for name in self.names}
        length = self.bins[b][2]
        for name in ("input_ids", "segment_ids", "input_mask"):  # a bin's sequences fit its length
            pick[name] = pick[name][:, :length]
        labels = static_labels(pick) if self.static else dynamic_mask(pick, self.special, self.mlm_probability, rng)
        import torch  # training only (see the imports above)
        return {
            "input_ids": torch.from_numpy(pick["input_ids"].astype(np.int64)),
            "token_type_ids": torch.from_numpy(pick["segment_ids"].astype(np.int64)),
            "attention_mask": torch.from_numpy(pick["input_mask"].astype(np.int64)),
            "labels": torch.from_numpy(labels),
            "next_sentence_label": torch.from_numpy(pick["next_sentence_labels"].astype(np.int64)),
        }


def static_labels(pick):
    """MLM labels from NVIDIA-style masked positions: -100 everywhere else."""
    labels = np.full(pick["input_ids"].shape, -100, dtype=np.int64)
    positions, ids = pick["masked_lm_positions"], pick["masked_lm_ids"]
    rows, slots = np.nonzero(positions > 0)  # position 0 ([CLS]) marks padding
    labels[rows, positions[rows, slots]] = ids[rows, slots]
    return labels


def dynamic_mask(pick, special, probability, rng):
    """Hugging Face's dynamic masking, in place on pick["input_ids"]; returns the labels.

    Each real, non-special token is chosen with ``probability``; of those 80%
    become [MASK], 10% a random token, 10% stay as they are.
    """
    ids = pick["input_ids"]
    candidates = (pick["input_mask"] == 1) & (ids != special["cls"]) & (ids != special["sep"])
    chosen = candidates & (rng.random(ids.shape) < probability)
    labels = np.where(chosen, ids, -100).astype(np.int64)
    draw = rng.random(ids.shape)
    random_tokens = rng.integers(special["first_regular"], special["vocab_size"], ids.shape)
    ids[chosen & (draw < 0.8)] = special["mask"]
    replace = chosen & (draw >= 0.8) & (draw < 0.9)
    ids[replace] = random_tokens[replace]
    return labels


def check_tokenizer(directory, metadata):
    """The shards' own tokenizer (TOKENIZER_DIR) is the vocabulary they were made with.

    With `tokenizers` alone: transformers costs every rank seconds to import, and a rank that
    builds no model (a finished run's relaunch) needs none of it."""
    path = Path(directory) / TOKENIZER_DIR
    try:
        tokenizer = WordPieceTokenizer.load(path, lowercase=True)
    except Exception as error:
        raise UsageError(f"cannot load the tokenizer in {path}: {error.__class__.__name__}") from None
    _check_vocab_hash(tokenizer, metadata, path)


def load_tokenizer(directory, metadata):
    """The shards' own tokenizer as transformers' BertTokenizerFast (the exported model's), checked."""
    from transformers import BertTokenizerFast  # imported when used: it takes seconds
    path = Path(directory) / TOKENIZER_DIR
    try:
        tokenizer = BertTokenizerFast.from_pretrained(str(path))
    except Exception as error:
        raise UsageError(f"cannot load the tokenizer in {path}: {error.__class__.__name__}") from None
    _check_vocab_hash(tokenizer, metadata, path)
    return tokenizer


def _check_vocab_hash(tokenizer, metadata, path):
    if vocab_hash(tokenizer) != metadata["vocab_sha256"]:
        raise UsageError(f"the tokenizer in {path} is not the vocabulary the shards were made with "
                         f"(vocab sha256 {vocab_hash(tokenizer)[:12]} vs {metadata['vocab_sha256'][:12]})")


def check_vocabulary(state, metadata, what):
    """A checkpoint's vocabulary must be the shards'."""
    if state.get("vocab_sha256") != metadata["vocab_sha256"]:
        raise UsageError(f"{what} was trained with a different vocabulary than the shards "
                         f"(vocab sha256 {str(state.get('vocab_sha256'))[:12]} vs {metadata['vocab_sha256'][:12]})")
