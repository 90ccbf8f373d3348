#!/usr/bin/env python
"""Measure Horovod against DDP and raw MPI, on your machines, with the collection's own code.

    horovodrun -np 2 python scripts/benchmark.py train --model resnet20                 # Horovod
    horovodrun -np 2 python scripts/benchmark.py train --model resnet20 --baseline ddp  # the same under DDP
    python scripts/benchmark.py train --model resnet20 --baseline none                  # no distribution
    mpirun -np 2 python scripts/benchmark.py allreduce          # hvd.allreduce vs mpi4py vs torch.distributed
    python scripts/benchmark.py scaling --np 1 2 --output-dir runs/scaling -- --model resnet20
    python scripts/benchmark.py compare --np 2 --repeats 3 -- --model bert-mini   # side by side, with ratios
    python scripts/benchmark.py tune --np 2 -- --model resnet20   # the fastest Horovod settings: a profile
    python scripts/benchmark.py timeline runs/timeline.json   # where the time went (--horovod-timeline)
    python scripts/benchmark.py predict --model resnet50 --compute-ms 100 --link-gbit 100   # 2-512 nodes

train: synthetic data through the trainers' own models and training steps
(hvdtrain.training.cnn and .bert Trainer: forward_backward, step); warm-up steps are
left out, then each timed window gives a rate; reported as the median, the
spread and mean ± 1.96σ over windows, per worker and in total.
allreduce: a message-size sweep with time, algorithm bandwidth and bus
bandwidth (algbw x 2(n-1)/n) side by side, as nccl-tests reports them.
scaling: launches `horovodrun -np N ... train` for each N and writes a table,
scaling.json and scaling.png (throughput and efficiency T(N) / (N T(1))).
compare: Horovod and DDP on N workers, Horovod on one, the plain loop and N
plain loops at once (the machine's own weak-scaling ceiling), interleaved for
--repeats rounds; medians and their ratios in compare.json.
tune: every combination of fusion threshold, cycle time and compression (and
Horovod's defaults) launched in interleaved rounds; the fastest is written as
a profile the trainers read (--horovod-profile).
timeline: totals per activity (negotiation, allreduce, fusion-buffer copies)
and the number of collectives in a Horovod timeline.
predict: a model, nothing runs: step time and efficiency on 2 to 512 nodes
from one worker's compute time, the gradient bytes and a link (ring allreduce,
tensor fusion, overlap with backward, fp16 compression); --validate checks it
and each cell's bound against a tools/link_study.py study.json.
Every result file records the environment and the exact command.

Each mode lives in hvdtrain/bench/: train.py, allreduce.py, scaling.py (scaling
and compare), tune.py, timeline.py, predict.py and bounds.py (predict --validate); backends.py (Horovod, DDP, one process),
workloads.py (the trainers' steps) and record.py (statistics, environment, JSON); options.py their command lines.
"""
import sys
from pathlib import Path

from hvdtrain import cli
from hvdtrain.bench import options


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE",
                                  parser_class=cli.ArgumentParser)
    options.add_train_arguments(modes)
    options.add_allreduce_arguments(modes)
    script = Path(__file__).resolve()  # scaling, compare and tune launch this script's train mode
    options.add_scaling_arguments(modes, script=script)
    options.add_tune_arguments(modes, script=script)
    options.add_timeline_arguments(modes)
    options.add_predict_arguments(modes)
    argv = sys.argv[1:] if argv is None else argv
    passed = argv[argv.index("--") + 1:] if "--" in argv else []  # after --: for every launched train
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.train_args = passed
    if args.mode == "train":
        options.check_train_arguments(args)
    if args.mode == "allreduce":
        options.check_allreduce_arguments(args, parser)
    return args


if __name__ == "__main__":
    # --help and a bad argument answer here, before the modes' code (torch, Horovod) loads.
    cli.run_main(parse_args)

from hvdtrain.bench import allreduce, bounds, predict, scaling, timeline, train, tune  # noqa: E402


def run_predict(args):
    """predict's table, or with --validate every link-study cell against its bound (bench/bounds.py)."""
    return bounds.validate(args) if args.validate else predict.run(args)


MODES = {"train": train.run, "allreduce": allreduce.run, "scaling": scaling.run_scaling,
         "compare": scaling.run_compare, "tune": tune.run, "timeline": timeline.run, "predict": run_predict}


def main():
    args = parse_args()
    MODES[args.mode](args)


if __name__ == "__main__":
    cli.run_main(main)
