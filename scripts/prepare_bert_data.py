#!/usr/bin/env python
"""Prepare BERT pretraining shards: vocabulary, NSP sentence pairs, masking.

    python scripts/prepare_bert_data.py --output-dir data/bert            # embedded corpus
    python scripts/prepare_bert_data.py --input corpus/ --vocab-size 30522 --output-dir data/bert
    mpirun -np 8 python scripts/prepare_bert_data.py --input corpus/ --output-dir data/bert

Input: text files (or directories of *.txt) with one sentence or paragraph per
line and a blank line between documents. Without --input: the English
documentation that ships with CPython (pydoc_data.topics, ~465k characters).

Under mpirun/srun the work is split across ranks (hvdtrain/data/bert_prepare.py):
equal byte ranges of the input for tokenizing, documents for making instances,
shards for writing; the tokenizer's threads are the node's CPUs divided among
its ranks. The shards are the same, byte for byte, whatever the number of ranks.
Memory holds a chunk of text or one shard at a time. The output format is
described in hvdtrain/data/bert_data.py (SHARD_FORMAT_DOC).
"""
import atexit
import math
import shutil
import time
from pathlib import Path

from hvdtrain.data import bert_corpus as corpus
from hvdtrain.data import bert_data
from hvdtrain.data import bert_prepare as prepare
from hvdtrain.cli import ArgumentParser, fraction, non_negative_int, positive_int, run_main
from hvdtrain.errors import UsageError
from hvdtrain.launch.mpi_world import World
from hvdtrain.runtime.outdir_lock import OutputDirLock

DEFAULT_VOCAB_SIZE = 30522            # BERT's
DEFAULT_CORPUS_VOCAB_SIZE = 4000      # what 465k characters can fill
PREDICTIONS_PRESETS = {128: 20, 512: 80}  # NVIDIA's phase 1 / phase 2 settings


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0],
                            epilog=bert_data.SHARD_FORMAT_DOC)
    parser.add_argument("--input", nargs="+", metavar="PATH",
                        help="text files or directories of *.txt (default: the embedded "
                             f"{corpus.DEFAULT_CORPUS} corpus)")
    parser.add_argument("--output-dir", required=True, type=Path,
                        help="shards, metadata.json and tokenizer/ (an earlier run's files there are replaced)")
    parser.add_argument("--take-over-lock", action="store_true",
                        help="write to --output-dir even though its run.lock names a preparation that may "
                             "still be running (stale locks are taken over without this)")
    parser.add_argument("--vocab", type=Path, metavar="PATH",
                        help="reuse a vocab.txt or tokenizer directory instead of training one")
    parser.add_argument("--vocab-size", type=positive_int,
                        help=f"WordPiece vocabulary to train (default: {DEFAULT_VOCAB_SIZE}; "
                             f"{DEFAULT_CORPUS_VOCAB_SIZE} for the embedded corpus)")
    parser.add_argument("--lowercase", action="store_true", default=True,
                        help="lowercase text, uncased BERT (the default)")
    parser.add_argument("--cased", dest="lowercase", action="store_false",
                        help="keep case, cased BERT (default: lowercase)")
    parser.add_argument("--max-seq-length", type=positive_int, default=128,
                        help="tokens per instance: 128 for phase 1, 512 for phase 2")
    parser.add_argument("--masking", choices=("dynamic", "static"), default="dynamic",
                        help="dynamic: masked anew at training time (Hugging Face, RoBERTa); "
                             "static: masked here once per duplicate (Google, NVIDIA)")
    parser.add_argument("--max-predictions-per-seq", type=positive_int,
                        help="static masking: most masked tokens per instance "
                             "(default: 20 for 128 tokens, 80 for 512, else 15%%)")
    parser.add_argument("--masked-lm-prob", type=fraction, default=0.15,
                        help="static masking: fraction of tokens masked (dynamic: pretrain_bert.py --mlm-probability)")
    parser.add_argument("--short-seq-prob", type=fraction, default=0.1,
                        help="fraction of instances made shorter than --max-seq-length")
    parser.add_argument("--dupe-factor", type=positive_int, default=5,
                        help="passes over the corpus, each with different pairs (and masks)")
    parser.add_argument("--num-shards", type=positive_int, default=8,
                        help="output files; at least as many as ranks that will train on them")
    parser.add_argument("--bin-size", type=non_negative_int, default=0,
                        help="group each shard's rows by length in bins of this many tokens (NVIDIA LDDL: 64 "
                             "for phase 2) so pretrain_bert.py pads only to the bin's length; 0: off")
    parser.add_argument("--workers", type=positive_int,
                        help="processes per rank that make instances and write shards (default: the node's "
                             "CPUs divided among its ranks, as the tokenizer's threads are)")
    parser.add_argument("--seed", type=non_negative_int, default=12345,
                        help="pairs, segments and masks; the same seed gives the same examples")
    args = parser.parse_args(argv)
    if args.max_seq_length < 8:
        parser.error(f"--max-seq-length must be at least 8, got {args.max_seq_length}")
    if args.max_predictions_per_seq is None:
        args.max_predictions_per_seq = PREDICTIONS_PRESETS.get(
            args.max_seq_length, math.ceil(args.max_seq_length * args.masked_lm_prob))
    if args.vocab_size is None:
        args.vocab_size = DEFAULT_VOCAB_SIZE if args.input else DEFAULT_CORPUS_VOCAB_SIZE
    return args


def check_inputs(args, size):
    """Checks every rank makes before any work (``size`` ranks); returns the input files (None: embedded corpus)."""
    if args.num_shards < size:
        raise UsageError(f"--num-shards {args.num_shards} is less than the {size} ranks")
    if args.vocab is not None and not args.vocab.exists():
        raise UsageError(f"--vocab not found: {args.vocab}")
    if not args.input:
        return None
    try:
        files = corpus.input_files(args.input)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    output = args.output_dir.resolve()
    files = [f for f in files if output not in f.resolve().parents]  # not our own vocab.txt
    if not files:
        raise UsageError(f"no text files (*.txt) in {' '.join(args.input)}")
    return files


def load_documents(files, file_index):
    """The documents of one input, streamed (``files`` None: the embedded corpus)."""
    if files is None:
        return corpus.default_corpus_documents()
    return corpus.read_documents(files[file_index])


def build_vocabulary(args, files):
    """Rank 0: reuse or train the vocabulary. Returns (vocab dict, lowercase).

    Our own trainer (pure Python), not the `tokenizers` one: that one breaks ties
    by hash-map order and so trains another vocabulary on each run (see
    bert_corpus.train_wordpiece). Use --vocab to skip this step on big corpora.
    """
    if args.vocab is not None:
        try:
            tokenizer = corpus.WordPieceTokenizer.load(args.vocab, args.lowercase)
        except Exception as error:
            raise UsageError(f"cannot load vocabulary {args.vocab}: {error}") from None
        return tokenizer.get_vocab(), bool(getattr(tokenizer, "do_lower_case", args.lowercase))
    count = 1 if files is None else len(files)
    texts = (sentence for index in range(count) for document in load_documents(files, index)
             for sentence in document)
    return corpus.train_wordpiece(texts, args.vocab_size, args.lowercase), args.lowercase


def tokenize_my_files(args, files, world, tokenizer, scratch, early=None):
    """Pass 1: this rank's share of the input into its token store.

    Shares are equal byte ranges of the input files read as one stream (a rank
    takes the documents that start in its range), so one 20 GB file is tokenized
    by every rank, not by one. ``early``: an EarlyStart whose first batch is taken
    over. Returns (documents stored, characters read).
    """
    writer = prepare.TokenStoreWriter(prepare.store_prefix(scratch, world.rank),
                                      prepare.token_dtype(len(tokenizer)))
    if early is not None:
        characters = prepare.tokenize_sources([early.documents], tokenizer, writer, started=early.first)
    else:
        characters = prepare.tokenize_sources([prepare.documents_of_rank(files, world.rank, world.size)],
                                              tokenizer, writer)
    writer.close()
    return writer.documents, characters


def check_document_count(total):
    if total < 2:
        raise UsageError(f"the input holds {total} non-empty document(s); next-sentence prediction needs "
                         "at least 2 (separate documents with a blank line)")


def make_my_instances(args, world, tokenizer, scratch, counts, workers):
    """Pass 2: instances of this rank's contiguous range of the corpus's documents, the range
    split among its worker processes, both by tokens (the work), written as spans of the token
    store. Returns [(rank, worker, instances made)] in corpus order."""
    dtype = prepare.token_dtype(len(tokenizer))
    store = prepare.TokenStore(scratch, counts, dtype)
    mine = prepare.split_by_tokens(store, range(sum(counts)), world.size)[world.rank]
    shares = prepare.split_by_tokens(store, mine, workers)
    del store
    tasks = [(scratch, counts, dtype, args, corpus.SpecialIds.of(tokenizer), world.rank, worker, documents)
             for worker, documents in enumerate(shares)]
    return prepare.run_in_workers(prepare.spans_in_worker, tasks, workers)


def record_dtype(args):
    return corpus.record_dtype(args.max_seq_length, args.max_predictions_per_seq, args.masking == "static")


def write_my_shards(args, world, tokenizer, scratch, counts, made, workers):
    """Pass 3: shards rank, rank+size, ..., one task each, taken by this rank's worker processes as
    they come free; ``made`` is every worker's instance count. Returns the shards' metadata entries."""
    tasks = [([shard], scratch, made, args, record_dtype(args), corpus.SpecialIds.of(tokenizer), counts,
              prepare.token_dtype(len(tokenizer))) for shard in range(world.rank, args.num_shards, world.size)]
    return [entry for part in prepare.run_in_workers(prepare.write_shards, tasks, workers) for entry in part]


def lock_output_dir(args, world):
    """Rank 0 holds --output-dir's lock until it exits: two preparations never mix shards."""
    if world.is_main:
        lock = OutputDirLock(args.output_dir).acquire(args.take_over_lock)
        atexit.register(lock.release)


def metadata(args, files, tokenizer, shards, world):
    ids = corpus.SpecialIds.of(tokenizer)
    return {
        "format": bert_data.FORMAT_NAME,
        "format_version": bert_data.FORMAT_VERSION,
        "vocab_sha256": corpus.vocab_hash(tokenizer),
        "vocab_size": len(tokenizer),
        "lowercase": bool(tokenizer.do_lower_case),
        "special_ids": ids.__dict__,
        "max_seq_length": args.max_seq_length,
        "max_predictions_per_seq": args.max_predictions_per_seq,
        "masking": args.masking,
        "masked_lm_prob": args.masked_lm_prob,
        "short_seq_prob": args.short_seq_prob,
        "dupe_factor": args.dupe_factor,
        "seed": args.seed,
        **({"bin_size": args.bin_size} if args.bin_size else {}),
        "num_instances": sum(shard["instances"] for shard in shards),
        "shards": sorted(shards, key=lambda shard: shard["file"]),
        "source": corpus.DEFAULT_CORPUS if files is None else [str(f) for f in files],
        "world_size": world.size,
    }


def main(argv=None):
    args = parse_args(argv)
    early = prepare.EarlyStart.begin(lambda size: check_inputs(args, size), args.vocab, args.lowercase)
    world = World()
    timer = prepare.PhaseTimer(world.size)
    threads = prepare.divide_tokenizer_threads(world.local_size())  # before the tokenizer's first call
    workers = args.workers or prepare.cpus_per_rank(world.local_size())  # processes for passes 2 and 3
    files = world.agree_on_errors(check_inputs, args, world.size)
    world.agree_on_errors(lock_output_dir, args, world)

    def rank0_vocabulary():
        try:
            if not world.is_main:
                return None
            prepare.clear_output(args.output_dir)
            return early.vocab if early is not None else build_vocabulary(args, files)
        finally:
            settle(world)  # the other ranks wait without spinning while rank 0 trains or loads it

    # The vocabulary is made once, on rank 0, and sent to every rank.
    vocab, lowercase = world.broadcast(world.agree_on_errors(rank0_vocabulary))
    early = early and early.taken(world, files, (vocab, lowercase))
    tokenizer = early.tokenizer if early is not None else corpus.WordPieceTokenizer.from_vocab(vocab, lowercase)
    if world.is_main:
        corpus.save_tokenizer(tokenizer, args.output_dir / bert_data.TOKENIZER_DIR)
        world.print0(f"vocabulary: {len(tokenizer)} tokens ({'uncased' if lowercase else 'cased'}); "
                     f"tokenizer threads per rank: {threads}{early.NOTE if early is not None else ''}; "
                     f"processes per rank for instances and shards: {workers}")

    scratch = args.output_dir / prepare.SCRATCH_DIR
    if world.is_main:
        scratch.mkdir()
    world.barrier()
    timer.done("set-up")
    mine = tokenize_my_files(args, files, world, tokenizer, scratch, early)
    settle(world)
    stored = world.allgather(mine)
    counts = [documents for documents, _ in stored]
    world.agree_on_errors(check_document_count, sum(counts))
    timer.done("tokenize", sum(characters for _, characters in stored))
    mine = make_my_instances(args, world, tokenizer, scratch, counts, workers)
    settle(world)
    made = [m for part in world.allgather(mine) for m in part]
    timer.done("instances")
    mine = write_my_shards(args, world, tokenizer, scratch, counts, made, workers)
    settle(world)
    shards = [s for part in world.allgather(mine) for s in part]
    timer.done("shards")
    if world.is_main:
        shutil.rmtree(scratch)
        info = metadata(args, files, tokenizer, shards, world)
        bert_data.write_metadata(args.output_dir, info)
        timer.done("metadata")
        print(f"wrote {info['num_instances']} instances (seq {args.max_seq_length}, {args.masking} masking) "
              f"in {len(shards)} shards to {args.output_dir} on {world.size} rank(s) "
              f"in {timer.total():.2f} s ({timer.summary()}; documents tokenized per rank: "
              f"{' '.join(map(str, counts))})", flush=True)
    settle(world)


def settle(world, interval=0.002):
    """A barrier that waits without spinning: Open MPI's blocking collectives poll, and a
    rank done early would take a core from the ranks still working on a node whose cores
    they share. Called before each collective that follows unequal work."""
    if world.comm is not None:
        request = world.comm.Ibarrier()
        while not request.Test():
            time.sleep(interval)


if __name__ == "__main__":
    run_main(main)
