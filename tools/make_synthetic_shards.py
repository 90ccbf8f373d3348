#!/usr/bin/env python
"""Write a large synthetic BERT shard set quickly, for measuring the training data path's memory.

    python tools/make_synthetic_shards.py --tokenizer data/bert128/tokenizer --shards 8000 \\
        --rows 1000 --max-seq-length 512 --output /tmp/big-shards

Rows are random sentence pairs of 16 to 128 tokens drawn from a few hundred ids,
padded to --max-seq-length: they compress well (small on disk) but take their
full size in memory once loaded (input_ids int32 + two int8 arrays per token),
which is what a rank that loaded its whole share would hold. The format is the
one prepare_bert_data.py writes (dynamic masking), checksums included.
"""
import argparse
import shutil
from pathlib import Path

import numpy as np

from hvdtrain.data import bert_corpus as corpus
from hvdtrain.data import bert_data


def shard_arrays(rng, rows, length, ids):
    lengths = rng.integers(16, 129, rows)
    input_ids = np.zeros((rows, length), np.int32)
    segment_ids = np.zeros((rows, length), np.int8)
    real = np.arange(length) < lengths[:, None]
    input_ids[:, :128] = rng.integers(ids.first_regular, ids.first_regular + 300, (rows, 128), dtype=np.int32)
    input_ids[~real] = 0
    first_b = lengths // 2
    input_ids[:, 0] = ids.cls
    input_ids[np.arange(rows), first_b - 1] = ids.sep
    input_ids[np.arange(rows), lengths - 1] = ids.sep
    segment_ids[(np.arange(length) >= first_b[:, None]) & real] = 1
    return {"input_ids": input_ids, "segment_ids": segment_ids, "input_mask": real.astype(np.int8),
            "next_sentence_labels": rng.integers(0, 2, rows, dtype=np.int8)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a prepared data set's tokenizer/ directory")
    parser.add_argument("--shards", type=int, default=8000)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--max-seq-length", type=int, default=512)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    tokenizer = corpus.WordPieceTokenizer.load(args.tokenizer, True)
    ids = corpus.SpecialIds.of(tokenizer)
    args.output.mkdir(parents=True, exist_ok=True)
    shutil.copytree(args.tokenizer, args.output / bert_data.TOKENIZER_DIR, dirs_exist_ok=True)
    rng = np.random.default_rng(0)
    shards = []
    for index in range(args.shards):
        name = bert_data.shard_name(index)
        digest = bert_data.write_shard(args.output / name, shard_arrays(rng, args.rows, args.max_seq_length, ids))
        shards.append({"file": name, "instances": args.rows, "sha256": digest})
    bert_data.write_metadata(args.output, {
        "format": bert_data.FORMAT_NAME, "format_version": bert_data.FORMAT_VERSION,
        "vocab_sha256": corpus.vocab_hash(tokenizer), "vocab_size": len(tokenizer), "lowercase": True,
        "special_ids": ids.__dict__, "max_seq_length": args.max_seq_length, "max_predictions_per_seq": 0,
        "masking": "dynamic", "num_instances": args.shards * args.rows, "shards": shards,
        "source": "tools/make_synthetic_shards.py", "world_size": 1})
    in_memory = args.shards * args.rows * args.max_seq_length * 6 / 2**30
    print(f"wrote {args.shards} shards of {args.rows} rows to {args.output}: {in_memory:.1f} GiB as arrays")


if __name__ == "__main__":
    main()
