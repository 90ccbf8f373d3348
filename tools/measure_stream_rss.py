#!/usr/bin/env python
"""Peak RSS of one rank's training data path (no model): STEPS batches of 64 as rank 0 of 2.

    python tools/measure_stream_rss.py DATA_DIR STEPS
"""
import argparse
import resource
import time

from hvdtrain.data import bert_data


def main(directory, steps):
    metadata = bert_data.read_metadata(directory)
    data = bert_data.PretrainingData(directory, metadata, rank=0, size=2, seed=12345, micro_batch=64,
                                     accumulation=1)
    start = time.time()
    data.start_epoch(0)
    for step in range(steps):
        data.batch(step, 0)
    share = sum(stop - first for _, first, stop in data.streams[0].pieces)
    shards = steps * 64 / metadata["shards"][0]["instances"]
    gib = share * metadata["max_seq_length"] * 6 / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"read {steps * 64} rows ({shards:.1f} shards) of this rank's {share} ({gib:.1f} GiB as arrays): "
          f"peak RSS {peak:.0f} MiB in {time.time() - start:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", help="prepared BERT data (shards and metadata.json)")
    parser.add_argument("steps", type=int, help="batches of 64 to read")
    args = parser.parse_args()
    main(args.data_dir, args.steps)
