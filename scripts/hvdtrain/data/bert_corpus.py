"""BERT data preparation: text -> documents -> WordPiece vocabulary -> NSP instances.

Pure Python (no Horovod, no MPI), used by scripts/prepare_bert_data.py.

Randomness is keyed per document: the instances made from document ``d`` (its
index in the whole corpus) in duplication round ``k`` depend only on (seed, d, k)
and the corpus, never on which rank makes them or in which order. That is what
lets N ranks write the same shards as one process does.
"""
import collections
import functools
import hashlib
import heapq
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
DEFAULT_CORPUS = "pydoc_data.topics"
TEXT_SUFFIXES = (".txt", ".text")

_HEADING_RULE = re.compile(r"^\s*([*=\-~^])\1{2,}\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(*])")


# ----------------------------------------------------------------------------- reading text

def input_files(paths):
    """The text files named by ``paths`` (files, or directories of *.txt), sorted.

    Sorted so that every rank numbers the files the same way.
    """
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input not found: {path}")
    return files


def read_documents(path, start=0, stop=None):
    """A text file's documents, one at a time (a file may be larger than memory).

    Blank lines separate documents; each line (ending in a newline) is a sentence
    (or paragraph). With ``start``/``stop``: only the documents whose first line
    begins at a byte offset in [start, stop), read whole even past ``stop``: ranks
    given adjacent byte ranges of one large file read every document exactly once.
    """
    with open(path, "rb") as handle:
        position = _first_line_at_or_after(handle, start)
        # A line that starts in the range but continues a document begun before it
        # belongs to an earlier range: skip lines up to the next blank one.
        inside_earlier = position > 0 and not _line_before_is_blank(handle, position)
        handle.seek(position)
        current = []
        for raw in handle:
            line_start, position = position, position + len(raw)
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                if current:
                    yield current
                    current = []
                inside_earlier = False
            elif not inside_earlier:
                if not current and stop is not None and line_start >= stop:
                    return  # the next document starts in a later range
                current.append(line)
        if current:
            yield current


def _first_line_at_or_after(handle, offset):
    """Byte offset of the first line that starts at or after ``offset``."""
    if offset <= 0:
        return 0
    handle.seek(offset - 1)
    handle.readline()  # the rest of the line holding byte offset-1 (just "\n" if it ends there)
    return handle.tell()


def _line_before_is_blank(handle, position, chunk=1 << 16):
    """Whether the line that ends just before ``position`` (a line start) is blank."""
    end, tail = position - 1, b""  # the byte before ``position`` is that line's newline
    while end > 0:
        begin = max(0, end - chunk)
        handle.seek(begin)
        tail = handle.read(end - begin) + tail
        newline = tail.rfind(b"\n")
        if newline >= 0:
            tail = tail[newline + 1:]
            break
        end = begin
    return not tail.decode("utf-8", errors="replace").strip()


def documents_in_byte_range(files, start, stop):
    """The documents of ``files`` (read as one stream, in order) whose first line
    starts in [start, stop) of that stream. A file always starts a document."""
    offset = 0
    for path in files:
        size = Path(path).stat().st_size
        if offset < stop and offset + size > start:
            yield from read_documents(path, max(0, start - offset), stop - offset)
        offset += size


def default_corpus_documents():
    """CPython's own documentation (pydoc_data.topics): one document per topic.

    The topics are hard-wrapped reStructuredText-like text; paragraphs are
    re-joined and split into sentences, so a "line" means what it does in an
    input file. About 465k characters, shipped with every Python: works offline.
    """
    from pydoc_data.topics import topics
    documents = []
    for name in sorted(topics):
        sentences = []
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            lines = [line for line in paragraph.splitlines() if not _HEADING_RULE.match(line)]
            text = " ".join(" ".join(lines).split())
            sentences.extend(s for s in _SENTENCE_END.split(text) if s)
        if sentences:
            documents.append(sentences)
    return documents


# ----------------------------------------------------------------------------- vocabulary

def train_wordpiece(texts, vocab_size, lowercase, min_frequency=2, limit_alphabet=1000):
    """A WordPiece vocabulary (dict token -> id), the same on every run.

    The algorithm of the `tokenizers` WordPiece trainer (BPE merges over words
    split by BERT's pre-tokenizer, "##" marking word-inner pieces), with ties
    broken by the pieces' text. The `tokenizers` trainer breaks ties by hash-map
    order and so trains a different vocabulary on each run
    (huggingface/tokenizers#1794); prepared data must not depend on luck.
    """
    from tokenizers import normalizers, pre_tokenizers
    normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    splitter = pre_tokenizers.BertPreTokenizer()
    word_counts = collections.Counter()
    for text in texts:
        word_counts.update(w for w, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text)))
    alphabet = _alphabet(word_counts, limit_alphabet)
    vocab = list(SPECIAL_TOKENS) + sorted(alphabet) + sorted(f"##{c}" for c in alphabet)
    words = [(["##" + c if i else c for i, c in enumerate(word)], count)
             for word, count in sorted(word_counts.items()) if set(word) <= alphabet]
    _merge_pairs(words, vocab, vocab_size, min_frequency)
    return {token: index for index, token in enumerate(vocab)}


def _alphabet(word_counts, limit):
    """The ``limit`` most frequent characters (ties by character)."""
    counts = collections.Counter()
    for word, count in word_counts.items():
        for char in word:
            counts[char] += count
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return {char for char, _ in ranked[:limit]}


def _merge_pairs(words, vocab, vocab_size, min_frequency):
    """Append merged pieces to ``vocab`` until it has ``vocab_size`` tokens.

    Pair counts are kept incrementally; a heap yields the most frequent pair,
    ties broken by text. Stale heap entries are skipped when popped.
    """
    pair_counts, pair_words = collections.Counter(), collections.defaultdict(set)
    for index, (symbols, count) in enumerate(words):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += count
            pair_words[pair].add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    known = set(vocab)
    while len(vocab) < vocab_size and heap:
        negative, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative:
            continue  # stale entry
        if -negative < min_frequency:
            break
        merged = pair[0] + pair[1][2:]
        if merged not in known:
            vocab.append(merged)
            known.add(merged)
        touched = set()
        for index in sorted(pair_words.pop(pair, ())):
            symbols, count = words[index]
            for old in zip(symbols, symbols[1:]):
                pair_counts[old] -= count
                touched.add(old)
            symbols = _merge_word(symbols, pair, merged)
            words[index] = (symbols, count)
            for new in zip(symbols, symbols[1:]):
                pair_counts[new] += count
                pair_words[new].add(index)
                touched.add(new)
        for changed in touched:
            if pair_counts[changed] > 0:
                heapq.heappush(heap, (-pair_counts[changed], changed))
            else:
                pair_counts.pop(changed, None)


def _merge_word(symbols, pair, merged):
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def is_plain(text):
    """Printable ASCII only (no tab, no control character): text WordPieceTokenizer.plain_backend takes."""
    return text.isascii() and text.isprintable()


class WordPieceTokenizer:
    """BERT's WordPiece tokenizer on the `tokenizers` library alone.

    The tokenizer transformers' ``BertTokenizerFast(vocab=..., do_lower_case=...)`` builds, part
    for part (its tokenizer.json is the same: tests/test_bert_data.py), with the few of its
    methods the preparation uses, and saved as transformers saves it (tokenizer.json and
    tokenizer_config.json; ``save_tokenizer`` adds vocab.txt) so that pretrain_bert.py and the
    exported model load it with ``from_pretrained``. Without transformers, whose import costs
    every rank of a preparation about 4.5 s of CPU before any text is read.
    """

    def __init__(self, backend, lowercase):
        self.backend_tokenizer = backend  # a tokenizers.Tokenizer
        self.do_lower_case = lowercase

    @classmethod
    def from_vocab(cls, vocab, lowercase):
        """Over ``vocab`` (dict token -> id, SPECIAL_TOKENS among them)."""
        from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
        from tokenizers.models import WordPiece
        backend = Tokenizer(WordPiece(dict(vocab), unk_token="[UNK]"))
        backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                        strip_accents=None, lowercase=lowercase)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece(prefix="##")
        backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in SPECIAL_TOKENS])
        cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
        return cls(backend, lowercase)

    @classmethod
    def load(cls, path, lowercase):
        """A saved tokenizer directory (tokenizer.json, its tokenizer_config.json's case), or a
        vocab.txt file or a directory with only one."""
        from tokenizers import Tokenizer
        path = Path(path)
        if (path / TOKENIZER_JSON).is_file():
            config = path / TOKENIZER_CONFIG
            if config.is_file():
                lowercase = json.loads(config.read_text()).get("do_lower_case", lowercase)
            return cls(Tokenizer.from_file(str(path / TOKENIZER_JSON)), lowercase)
        vocab = {}
        with open(path / "vocab.txt" if path.is_dir() else path, encoding="utf-8") as handle:
            for index, line in enumerate(handle):
                vocab[line.rstrip("\n")] = index
        return cls.from_vocab(vocab, lowercase)

    @functools.cached_property
    def plain_backend(self):
        """A twin of the backend for plain text (is_plain), or None: the same ids in about 0.7 of the
        time. On printable ASCII, BertNormalizer's steps other than lowercasing change nothing (no
        control characters or other whitespace to clean, nothing to decompose or strip of accents,
        no CJK characters to space): the twin's normalizer only lowercases (uncased) or is left out
        (cased). None where the normalizer is not a BertNormalizer."""
        from tokenizers import Tokenizer, normalizers
        state = json.loads(self.backend_tokenizer.to_str())
        settings = state.get("normalizer") or {}
        if settings.get("type") != "BertNormalizer":
            return None
        twin = Tokenizer.from_str(json.dumps(state))
        twin.normalizer = normalizers.Lowercase() if settings.get("lowercase", True) else None
        return twin

    def encode_batch(self, texts, plain=None):
        """The backend's Encodings of ``texts`` (no special tokens added), in order; where ``plain[i]``
        is true, texts[i] is plain text (is_plain) and goes to plain_backend."""
        twin = self.plain_backend if plain is not None and any(plain) else None
        if twin is None:
            return self.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        if all(plain):
            return twin.encode_batch_fast(texts, add_special_tokens=False)
        fast = iter(twin.encode_batch_fast([t for t, p in zip(texts, plain) if p], add_special_tokens=False))
        slow = iter(self.backend_tokenizer.encode_batch_fast([t for t, p in zip(texts, plain) if not p],
                                                             add_special_tokens=False))
        return [next(fast) if p else next(slow) for p in plain]

    def __len__(self):
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self):
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token):
        return self.backend_tokenizer.token_to_id(token)

    @property
    def cls_token_id(self):
        return self.convert_tokens_to_ids("[CLS]")

    @property
    def sep_token_id(self):
        return self.convert_tokens_to_ids("[SEP]")

    @property
    def mask_token_id(self):
        return self.convert_tokens_to_ids("[MASK]")

    @property
    def pad_token_id(self):
        return self.convert_tokens_to_ids("[PAD]")

    def save_pretrained(self, directory):
        """tokenizer.json and tokenizer_config.json, as transformers writes them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend_tokenizer.save(str(directory / TOKENIZER_JSON))
        config = {"backend": "tokenizers", "cls_token": "[CLS]", "do_lower_case": self.do_lower_case,
                  "mask_token": "[MASK]", "model_max_length": 1000000000000000019884624838656, "pad_token": "[PAD]",
                  "sep_token": "[SEP]", "strip_accents": None, "tokenize_chinese_chars": True,
                  "tokenizer_class": "BertTokenizer", "unk_token": "[UNK]"}
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


def save_tokenizer(tokenizer, directory):
    """Hugging Face format (tokenizer.json + config) plus the classic vocab.txt."""
    directory = Path(directory)
    tokenizer.save_pretrained(str(directory))
    (directory / "vocab.txt").write_text("\n".join(vocab_tokens(tokenizer)) + "\n", encoding="utf-8")


def vocab_tokens(tokenizer):
    """Tokens in id order."""
    vocab = tokenizer.get_vocab()
    return sorted(vocab, key=vocab.get)


def vocab_hash(tokenizer):
    """sha256 of the tokens in id order: identifies a vocabulary whatever file holds it."""
    return hashlib.sha256("\n".join(vocab_tokens(tokenizer)).encode("utf-8")).hexdigest()


def tokenize_documents(tokenizer, documents):
    """Each document as a list of token-id lists (one per sentence); empty sentences dropped.

    One Rust batch call for all sentences (``encode_batch_fast``: no offsets);
    the result does not depend on the batch size or on TOKENIZERS_PARALLELISM.
    """
    flat = [sentence for document in documents for sentence in document]
    backend = tokenizer.backend_tokenizer
    ids = [e.ids for e in backend.encode_batch_fast(flat, add_special_tokens=False)] if flat else []
    tokenized, position = [], 0
    for document in documents:
        tokenized.append([s for s in ids[position:position + len(document)] if s])
        position += len(document)
    return tokenized


# ----------------------------------------------------------------------------- instances

@dataclass
class SpecialIds:
    cls: int
    sep: int
    mask: int
    pad: int
    vocab_size: int
    first_regular: int  # random replacement tokens are drawn from [first_regular, vocab_size)

    @classmethod
    def of(cls, tokenizer):
        special = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
        return cls(cls=tokenizer.cls_token_id, sep=tokenizer.sep_token_id,
                   mask=tokenizer.mask_token_id, pad=tokenizer.pad_token_id,
                   vocab_size=len(tokenizer), first_regular=max(special) + 1)


@dataclass
class Instance:
    """One sentence pair: [CLS] A [SEP] B [SEP], and whether B was a random segment."""
    tokens: list
    segment_ids: list
    is_random_next: bool
    masked_positions: list = None
    masked_ids: list = None


def document_rng(seed, document_index, round_index):
    """The random generator of one document (its index in the corpus) in one duplication round."""
    return random.Random(f"{seed}:{document_index}:{round_index}")  # str seeds hash with sha512


def other_document_index(index, count, rng):
    """A document of the corpus other than ``index``, uniformly (Google's reference draws
    from the whole corpus; unlike it, never the same document, so the label is true)."""
    other = rng.randrange(count - 1)
    return other + 1 if other >= index else other


def instances_from_document(document, max_seq_length, short_seq_prob, rng, ids, random_segment):
    """Google BERT's create_instances_from_document: NSP pairs from one document.

    ``random_segment(rng, target_length)`` returns the tokens of a "random next"
    segment from another document of the corpus (see ``segment_from``).
    """
    max_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    # Mostly fill the sequence; sometimes train on short ones to match fine-tuning inputs.
    target_length = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    instances, chunk, chunk_length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target_length:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for segment in chunk[:a_end] for t in segment]
            tokens_b, is_random_next = [], False
            if len(chunk) == 1 or rng.random() < 0.5:
                is_random_next = True
                tokens_b = random_segment(rng, target_length - len(tokens_a))
                i -= len(chunk) - a_end  # the unused segments go back into the pool
            else:
                tokens_b = [t for segment in chunk[a_end:] for t in segment]
            _truncate_pair(tokens_a, tokens_b, max_tokens, rng)
            if tokens_a and tokens_b:
                instances.append(Instance(
                    tokens=[ids.cls, *tokens_a, ids.sep, *tokens_b, ids.sep],
                    segment_ids=[0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1),
                    is_random_next=is_random_next))
            chunk, chunk_length = [], 0
        i += 1
    return instances


def segment_from(documents, index, rng, target_length):
    """A random segment from a document of ``documents`` (in memory) other than ``index``."""
    document = documents[other_document_index(index, len(documents), rng)]
    return sentences_from(document, rng.randint(0, len(document) - 1), target_length)


def sentences_from(document, start, target_length):
    """Consecutive sentences of ``document`` from ``start`` until ``target_length`` tokens."""
    tokens = []
    for segment in document[start:]:
        tokens.extend(segment)
        if len(tokens) >= target_length:
            break
    return tokens


def _truncate_pair(tokens_a, tokens_b, max_tokens, rng):
    """Trim the longer segment until both fit, each token from the front or the back at random.

    Google's reference pops one token at a time from the longer segment (B on a
    tie) with a coin flip each; the same lengths in closed form, and the same
    front/back distribution with one draw per segment (a sum of fair bits).
    """
    excess = len(tokens_a) + len(tokens_b) - max_tokens
    if excess <= 0:
        return
    if excess <= abs(len(tokens_a) - len(tokens_b)):  # only the longer one shrinks
        keep = ((len(tokens_a) - excess, len(tokens_b)) if len(tokens_a) > len(tokens_b)
                else (len(tokens_a), len(tokens_b) - excess))
    else:  # both shrink to about half, A keeping the odd token
        keep = ((max_tokens + 1) // 2, max_tokens // 2)
    for tokens, length in ((tokens_a, keep[0]), (tokens_b, keep[1])):
        cut = len(tokens) - length
        if cut:
            front = bin(rng.getrandbits(cut)).count("1")
            tokens[:] = tokens[front:front + length]


def mask_instance(instance, masked_lm_prob, max_predictions, rng, ids):
    """Static masking (BERT): ~15% of the tokens, of which 80% [MASK], 10% random, 10% kept."""
    candidates = [i for i, t in enumerate(instance.tokens) if t not in (ids.cls, ids.sep)]
    rng.shuffle(candidates)
    count = min(max_predictions, max(1, round(len(instance.tokens) * masked_lm_prob)))
    positions = sorted(candidates[:count])
    instance.masked_positions = positions
    instance.masked_ids = [instance.tokens[p] for p in positions]
    for position in positions:
        draw = rng.random()
        if draw < 0.8:
            instance.tokens[position] = ids.mask
        elif draw < 0.9:
            instance.tokens[position] = rng.randint(ids.first_regular, ids.vocab_size - 1)
        # else: keep the original token


def record_dtype(max_seq_length, max_predictions, static):
    """One instance as one fixed-size record: the shard format's row (bert_data.SHARD_FORMAT_DOC)."""
    fields = [("input_ids", np.int32, (max_seq_length,)), ("segment_ids", np.int8, (max_seq_length,)),
              ("input_mask", np.int8, (max_seq_length,)), ("next_sentence_labels", np.int8)]
    if static:
        fields += [("masked_lm_positions", np.int32, (max_predictions,)),
                   ("masked_lm_ids", np.int32, (max_predictions,))]
    return np.dtype(fields)


def instances_to_records(instances, dtype):
    """Instances as a record array of ``dtype`` (see record_dtype), 0-padded."""
    records = np.zeros(len(instances), dtype=dtype)
    static = "masked_lm_ids" in dtype.names
    for row, instance in enumerate(instances):
        record, length = records[row], len(instance.tokens)
        record["input_ids"][:length] = instance.tokens
        record["segment_ids"][:length] = instance.segment_ids
        record["input_mask"][:length] = 1
        record["next_sentence_labels"] = int(instance.is_random_next)
        if static:
            count = len(instance.masked_positions)
            record["masked_lm_positions"][:count] = instance.masked_positions
            record["masked_lm_ids"][:count] = instance.masked_ids
    return records


def records_to_arrays(records):
    """Columns of a record array, by name (every column present even with 0 rows)."""
    return {name: np.ascontiguousarray(records[name]) for name in records.dtype.names}
