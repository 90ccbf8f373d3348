"""NSP instances as numpy records, without a Python object per token.

bert_corpus.instances_from_document and mask_instance are the reference
(Google's algorithm over lists of token ids). The functions here make the same
random draws in the same order, so they give the same instances, but a document
is one flat token array with its sentence ends: a segment is a slice (a view),
a chunk's end is found by bisection instead of a loop over sentences, and the
rows of many instances are filled by one vectorised numpy step (RecordBuilder).
"""
import bisect

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
        """Static masking: the drawn ids written into the rows, positions and originals recorded."""
        counts = np.fromiter((len(positions) for positions, _, _ in self.masks), np.int64, len(self.masks))
        rows = np.repeat(np.arange(len(self.masks)), counts)
        slots = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.fromiter((p for m in self.masks for p in m[0]), np.int64, len(rows))
        records["masked_lm_positions"][rows, slots] = positions
        records["masked_lm_ids"][rows, slots] = np.fromiter((i for m in self.masks for i in m[1]), np.int64, len(rows))
        ids[rows, positions] = np.fromiter((i for m in self.masks for i in m[2]), np.int64, len(rows))
