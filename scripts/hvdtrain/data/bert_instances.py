"""NSP instances as numpy records, without a Python object per token.

bert_corpus.instances_from_document and mask_instance are the reference
(Google's algorithm over lists of token ids). The functions here make the same
random draws in the same order, so they give the same instances, but a document
is one flat token array with its sentence ends: a segment is a slice (a view),
a chunk's end is found by bisection instead of a loop over sentences, and the
rows of many instances are filled by one vectorised numpy step (RecordBuilder).

The preparation's own loop goes further (``document_spans``, ``SpanBuilder``): an instance
is two spans of the token store, (source, start, stop) integers, so the loop creates no
array at all, and the rows are gathered from the store in one step per flush.
``uniform_below`` makes random.Random's integer draws (randint, randrange) without its
Python-level call chain: the same numbers from the same generator.
"""
import bisect
import itertools
import random

import numpy as np


def document_instances(tokens, ends, max_seq_length, short_seq_prob, rng, random_segment):
    """bert_corpus.instances_from_document for a document given as ``tokens`` (flat ids)
    and ``ends`` (a list: 0, then each sentence's end). Returns [(a, b, is_random_next)],
    a and b the two segments as arrays, before [CLS]/[SEP] are added.

    ``random_segment(rng, target_length)`` returns a "random next" segment (an array).
    """
    max_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    target_length = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    count, made, start = len(ends) - 1, [], 0
    while start < count:
        # The chunk: sentences from ``start`` until target_length tokens or the document's end.
        stop = min(bisect.bisect_left(ends, ends[start] + target_length, start + 1), count)
        size = stop - start
        a_end = start + (rng.randint(1, size - 1) if size >= 2 else 1)
        a = tokens[ends[start]:ends[a_end]]
        if size == 1 or rng.random() < 0.5:
            b, is_random_next = random_segment(rng, target_length - len(a)), True
            start = a_end  # the unused sentences go back into the pool
        else:
            b, is_random_next = tokens[ends[a_end]:ends[stop]], False
            start = stop
        a, b = truncate_pair(a, b, max_tokens, rng)
        if len(a) and len(b):
            made.append((a, b, is_random_next))
    return made


def truncate_pair(a, b, max_tokens, rng):
    """bert_corpus._truncate_pair on arrays: the same lengths and draws, slices returned."""
    excess = len(a) + len(b) - max_tokens
    if excess <= 0:
        return a, b
    if excess <= abs(len(a) - len(b)):  # only the longer one shrinks
        keep = (len(a) - excess, len(b)) if len(a) > len(b) else (len(a), len(b) - excess)
    else:  # both shrink to about half, A keeping the odd token
        keep = ((max_tokens + 1) // 2, max_tokens // 2)
    kept = []
    for tokens, length in ((a, keep[0]), (b, keep[1])):
        cut = len(tokens) - length
        front = bin(rng.getrandbits(cut)).count("1") if cut else 0
        kept.append(tokens[front:front + length])
    return kept


def mask_draws(a, b, masked_lm_prob, max_predictions, rng, ids):
    """bert_corpus.mask_instance for the instance [CLS] a [SEP] b [SEP]: the same draws.

    Returns (positions, original ids there, the ids written there).
    """
    tokens = np.concatenate(([ids.cls], a, [ids.sep], b, [ids.sep]))
    candidates = np.flatnonzero((tokens != ids.cls) & (tokens != ids.sep)).tolist()
    rng.shuffle(candidates)
    count = min(max_predictions, max(1, round(len(tokens) * masked_lm_prob)))
    positions = sorted(candidates[:count])
    originals = tokens[positions].tolist()
    written = []
    for original in originals:
        draw = rng.random()
        if draw < 0.8:
            written.append(ids.mask)
        elif draw < 0.9:
            written.append(rng.randint(ids.first_regular, ids.vocab_size - 1))
        else:
            written.append(original)  # kept
    return positions, originals, written


class RecordBuilder:
    """Instances collected as segment arrays, turned into records of ``dtype`` all at once.

    The rows are those of bert_corpus.instances_to_records: [CLS] a [SEP] b [SEP],
    segment ids 0 then 1 from b on, input mask 1 over the tokens, 0-padded.
    """

    def __init__(self, dtype, ids):
        self.dtype, self.ids = dtype, ids
        self.segments, self.labels, self.masks = [], [], []

    def __len__(self):
        return len(self.labels)

    def add(self, made, masks=None):
        """``made`` from document_instances; ``masks`` from mask_draws, one per instance (static)."""
        for a, b, is_random_next in made:
            self.segments += (a, b)
            self.labels.append(is_random_next)
        self.masks.extend(masks or ())

    def take(self):
        """The records of the instances added since the last take, in order."""
        records = np.zeros(len(self.labels), dtype=self.dtype)
        if len(records):
            self._fill(records)
        self.segments, self.labels, self.masks = [], [], []
        return records

    def _fill(self, records):
        lengths = np.fromiter(map(len, self.segments), np.int64, len(self.segments))
        starts = (np.cumsum(lengths) - lengths).reshape(-1, 2, 1)
        pool = np.concatenate(self.segments)
        a_len, b_len = lengths.reshape(-1, 2, 1)[:, 0], lengths.reshape(-1, 2, 1)[:, 1]
        position = np.arange(records["input_ids"].shape[1])
        in_a = (position >= 1) & (position <= a_len)
        in_b = (position >= a_len + 2) & (position <= a_len + b_len + 1)
        source = np.where(in_a, starts[:, 0] + position - 1, starts[:, 1] + position - a_len - 2)
        ids = np.where(in_a | in_b, pool[np.where(in_a | in_b, source, 0)], 0)
        rows = np.arange(len(records))
        ids[:, 0] = self.ids.cls
        ids[rows, a_len[:, 0] + 1] = self.ids.sep
        ids[rows, a_len[:, 0] + b_len[:, 0] + 2] = self.ids.sep
        records["segment_ids"] = (position >= a_len + 2) & (position <= a_len + b_len + 2)
        records["input_mask"] = position <= a_len + b_len + 2
        records["next_sentence_labels"] = self.labels
        if self.masks:
            self._apply_masks(records, ids)
        records["input_ids"] = ids

    def _apply_masks(self, records, ids):
        apply_masks(self.masks, records, ids)


def apply_masks(masks, records, ids):
    """Static masking: the drawn ids written into the rows (``ids``, the input_ids to be), the
    positions and original ids recorded; ``masks``: mask_draws of each row."""
    counts = np.fromiter((len(positions) for positions, _, _ in masks), np.int64, len(masks))
    rows = np.repeat(np.arange(len(masks)), counts)
    slots = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.fromiter((p for m in masks for p in m[0]), np.int64, len(rows))
    records["masked_lm_positions"][rows, slots] = positions
    records["masked_lm_ids"][rows, slots] = np.fromiter((i for m in masks for i in m[1]), np.int64, len(rows))
    ids[rows, positions] = np.fromiter((i for m in masks for i in m[2]), np.int64, len(rows))


# ----------------------------------------------------------------------------- spans (the preparation's loop)

def _below_of(rng):
    """``below(n)``: rng.randrange(n), so rng.randint(a, b) == a + below(b - a + 1), from rng.getrandbits
    as random.Random._randbelow_with_getrandbits draws it (n >= 1)."""
    getrandbits = rng.getrandbits

    def below(n):
        if n <= 0:
            raise ValueError(f"empty range for randrange({n})")
        bits = n.bit_length()
        draw = getrandbits(bits)
        while draw >= n:
            draw = getrandbits(bits)
        return draw
    return below


def _randrange_of(rng):
    return rng.randrange


def _same_draws(make_below):
    """Whether ``make_below(rng)`` draws what randint and randrange draw, on this Python."""
    for seed in ("12345:0:0", "7:31:4", 3):
        reference, mine = random.Random(seed), random.Random(seed)
        below = make_below(mine)
        for n in (1, 2, 3, 5, 7, 64, 100, 125, 1000, 2 ** 31 + 11, 2 ** 40 + 3):
            if reference.randint(0, n - 1) != below(n) or reference.randrange(n) != below(n):
                return False
            if reference.random() != mine.random():
                return False
    return True


# random.Random's own methods where its algorithm ever differs from the one copied above.
uniform_below = _below_of if _same_draws(_below_of) else _randrange_of


def document_spans(source, ends, max_seq_length, short_seq_prob, rng, below, random_span):
    """document_instances on the token store's offsets: the same draws, no arrays.

    The document's sentences end at ``ends`` (a list: its first token's offset, then each
    sentence's end) in token array ``source`` of the store; ``below`` is uniform_below(rng);
    ``random_span(rng, below, target_length)`` returns a "random next" segment as
    (source, start, stop). Returns [(source, a0, a1, b source, b0, b1, is_random_next)].
    """
    max_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    random_draw = rng.random
    target_length = 2 + below(max_tokens - 1) if random_draw() < short_seq_prob else max_tokens
    count, made, start = len(ends) - 1, [], 0
    half_up, half_down = (max_tokens + 1) // 2, max_tokens // 2
    getrandbits = rng.getrandbits
    while start < count:
        a0 = ends[start]
        # The chunk: sentences from ``start`` until target_length tokens or the document's end.
        stop = bisect.bisect_left(ends, a0 + target_length, start + 1)
        if stop > count:
            stop = count
        size = stop - start
        a_end = start + (1 + below(size - 1) if size >= 2 else 1)
        a1 = ends[a_end]
        if size == 1 or random_draw() < 0.5:
            b_source, b0, b1 = random_span(rng, below, target_length - (a1 - a0))
            is_random_next = 1
            start = a_end  # the unused sentences go back into the pool
        else:
            b_source, b0, b1 = source, a1, ends[stop]
            is_random_next = 0
            start = stop
        a_length, b_length = a1 - a0, b1 - b0
        excess = a_length + b_length - max_tokens
        if excess > 0:  # truncate_pair: the same lengths, the same draws
            if excess <= abs(a_length - b_length):  # only the longer one shrinks
                if a_length > b_length:
                    keep_a, keep_b = a_length - excess, b_length
                else:
                    keep_a, keep_b = a_length, b_length - excess
            else:  # both shrink to about half, A keeping the odd token
                keep_a, keep_b = half_up, half_down
            cut = a_length - keep_a
            if cut:
                a0 += getrandbits(cut).bit_count()
            a1 = a0 + keep_a
            cut = b_length - keep_b
            if cut:
                b0 += getrandbits(cut).bit_count()
            b1 = b0 + keep_b
        if a1 > a0 and b1 > b0:
            made.append((source, a0, a1, b_source, b0, b1, is_random_next))
    return made


SPAN_FIELDS = 7  # a row of document_spans: source, a0, a1, b source, b0, b1, is_random_next


def flat_masks(masks):
    """mask_draws' results, one per instance, as flat arrays: (counts, positions, originals, written)."""
    counts = np.fromiter((len(positions) for positions, _, _ in masks), np.int64, len(masks))
    total = int(counts.sum())
    return (counts, *(np.fromiter((value for m in masks for value in m[part]), np.int64, total)
                      for part in range(3)))


def fill_rows(spans, sources, ids, columns, masks=None):
    """The shard rows of instances ``spans`` (an int64 array, a document_spans row each) written
    into ``columns``: arrays (or views) by the shard format's names, one row per instance. The
    tokens are gathered from the store's token arrays ``sources`` (by an instance's source
    numbers), a whole row's width at once (windows). ``masks``: static masking's flat_masks.

    The rows are those of bert_corpus.instances_to_records: [CLS] a [SEP] b [SEP], segment
    ids 0 then 1 from b on, input mask 1 over the tokens, 0-padded.
    """
    input_ids = columns["input_ids"]
    count, width = input_ids.shape
    a_length, b_length = spans[:, 2] - spans[:, 1], spans[:, 5] - spans[:, 4]
    b_first = a_length + 2  # b's first position in the row
    total = b_first + b_length + 1
    # Position p of row r holds a's token a0 + p - 1 (1 <= p <= a_length), or b's b0 + p - b_first.
    from_a = windows_at(sources, spans[:, 0], spans[:, 1] - 1, width)
    from_b = windows_at(sources, spans[:, 3], spans[:, 4] - b_first, width)
    position = np.arange(width)
    in_a = (position >= 1) & (position <= a_length[:, None])
    in_b = (position >= b_first[:, None]) & (position < (total - 1)[:, None])
    input_ids[...] = np.where(in_a, from_a, np.where(in_b, from_b, 0))
    rows = np.arange(count)
    input_ids[rows, 0] = ids.cls
    input_ids[rows, a_length + 1] = ids.sep
    input_ids[rows, total - 1] = ids.sep
    mask = position < total[:, None]
    columns["segment_ids"][...] = mask & (position >= b_first[:, None])
    columns["input_mask"][...] = mask
    columns["next_sentence_labels"][...] = spans[:, 6]
    if masks is not None:
        apply_flat_masks(*masks, columns, input_ids)


def windows_at(sources, origins, offsets, width):
    """Row r: ``width`` tokens of token array ``sources[origins[r]]`` from ``offsets[r]`` on, as
    one (rows, width) array; a position outside the array holds 0 (the caller masks it). Rows
    whose window lies inside their array are copied from a strided view (no index per token);
    the few near an array's ends, token by token."""
    dtype = sources[0].dtype if len(sources) else np.int32
    out = np.zeros((len(origins), width), dtype)
    for origin in np.unique(origins):
        tokens = sources[int(origin)]
        rows = np.flatnonzero(origins == origin)
        starts = offsets[rows]
        inside = (starts >= 0) & (starts <= len(tokens) - width)
        if inside.any():
            out[rows[inside]] = np.lib.stride_tricks.sliding_window_view(tokens, width)[starts[inside]]
        for row, start in zip(rows[~inside], starts[~inside]):
            index = start + np.arange(width)
            held = (index >= 0) & (index < len(tokens))
            out[row, held] = tokens[index[held]]
    return out


def apply_flat_masks(counts, positions, originals, written, columns, input_ids):
    """Static masking (flat_masks) into ``columns``: the drawn ids written into ``input_ids``, the
    positions and original ids recorded (0-padded)."""
    rows = np.repeat(np.arange(len(counts)), counts)
    slots = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    for name, values in (("masked_lm_positions", positions), ("masked_lm_ids", originals)):
        columns[name][...] = 0
        columns[name][rows, slots] = values
    input_ids[rows, positions] = written


class SpanBuilder:
    """RecordBuilder for document_spans' instances: the rows gathered from the store's token
    arrays ``sources`` (indexed by an instance's source numbers) once per take (fill_rows)."""

    def __init__(self, dtype, ids, sources):
        self.dtype, self.ids, self.sources = dtype, ids, sources
        self.spans, self.masks = [], []

    def __len__(self):
        return len(self.spans)

    def add(self, made, masks=None):
        """``made`` from document_spans; ``masks`` from mask_draws, one per instance (static)."""
        self.spans += made
        if masks:
            self.masks += masks

    def take(self):
        """The records of the instances added since the last take, in order."""
        records = np.zeros(len(self.spans), dtype=self.dtype)
        if len(records):
            spans = np.fromiter(itertools.chain.from_iterable(self.spans), np.int64, SPAN_FIELDS * len(records))
            fill_rows(spans.reshape(-1, SPAN_FIELDS), self.sources, self.ids,
                      {name: records[name] for name in self.dtype.names},
                      flat_masks(self.masks) if self.masks else None)
        self.spans, self.masks = [], []
        return records


def span_segments(sources, span):
    """The two segments of one document_spans instance, as arrays (views of the store)."""
    source, a0, a1, b_source, b0, b1, _ = span
    return sources[source][a0:a1], sources[b_source][b0:b1]
