"""benchmark.py's modes and their options, importable without torch or Horovod.

benchmark.py parses its command line before it imports the modes' code (torch,
Horovod, the trainers), so `--help` and a bad argument answer in a tenth of a
second. What each mode does: train.py, allreduce.py, scaling.py (scaling and
compare), tune.py, timeline.py, predict.py.
"""
import argparse
from pathlib import Path

from hvdtrain import cli
from hvdtrain.options import BERT_PRESETS, add_horovod_diagnostics

CNN_MODELS = {"resnet20": (32, 10), "resnet56": (32, 10), "resnet18": (224, 1000), "resnet50": (224, 1000),
              "convnet": (32, 10)}  # name -> (image size, classes)
BERT_MODELS = {f"bert-{name}": name for name in BERT_PRESETS}  # benchmark name -> models/bert.py preset
MODELS = [*CNN_MODELS, *BERT_MODELS]
NODES = [2**k for k in range(1, 10)]  # predict's node counts: 2 .. 512


def add_train_arguments(modes):
    parser = modes.add_parser("train", help="training throughput: Horovod, or --baseline ddp|none")
    parser.add_argument("--model", choices=MODELS, default="resnet20", help="what to train")
    parser.add_argument("--baseline", choices=["ddp", "none"],
                        help="instead of Horovod: DistributedDataParallel, or one process without distribution")
    parser.add_argument("--batch-size", type=cli.positive_int, default=32,
                        help="images or sequences per rank and backward pass")
    parser.add_argument("--image-size", type=cli.positive_int, help="CNN input size (default: the model's own)")
    parser.add_argument("--seq-length", type=cli.positive_int, default=128, help="BERT sequence length")
    parser.add_argument("--vocab-size", type=cli.positive_int, default=30522, help="BERT vocabulary size")
    parser.add_argument("--warmup-steps", type=cli.non_negative_int, default=5, help="untimed steps first")
    parser.add_argument("--window-steps", type=cli.positive_int, default=10, help="steps per timed window")
    parser.add_argument("--windows", type=cli.positive_int, default=5, help="timed windows")
    parser.add_argument("--seed", type=cli.non_negative_int, default=42, help="weights and synthetic data")
    parser.add_argument("--amp", action="store_true", help="CUDA: mixed precision (fp16 CNN, bf16 BERT)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                        help="autocast dtype, on any device (fp16: CUDA only); instead of --amp")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (BERT: its encoder)")
    parser.add_argument("--channels-last", action="store_true", help="CNN: channels_last memory layout")
    knobs = parser.add_argument_group("Horovod")
    knobs.add_argument("--fp16-allreduce", action="store_true", help="send gradients as fp16")
    knobs.add_argument("--accumulation-steps", type=cli.positive_int, default=1,
                       help="backward passes per allreduce (Horovod's batches per allreduce)")
    knobs.add_argument("--fusion-threshold-mb", type=cli.non_negative_int,
                       help="HOROVOD_FUSION_THRESHOLD in MiB (Horovod's default: 128)")
    knobs.add_argument("--cycle-time-ms", type=cli.positive_float,
                       help="HOROVOD_CYCLE_TIME in ms (Horovod's default: 1)")
    add_horovod_diagnostics(knobs)
    add_backend_arguments(parser)


def check_train_arguments(args):
    if args.baseline and (args.horovod_timeline or args.horovod_autotune or args.horovod_autotune_log
                          or args.fusion_threshold_mb is not None or args.cycle_time_ms is not None):
        cli.fail("Horovod's knobs and diagnostics apply to Horovod runs only (drop --baseline)")
    if args.amp and args.precision:
        cli.fail("--amp and --precision: give one of them")


def add_allreduce_arguments(modes):
    parser = modes.add_parser("allreduce", help="allreduce message-size sweep: Horovod, mpi4py, torch.distributed")
    parser.add_argument("--min-bytes", type=size_in_bytes, default="1K", help="smallest message (K, M suffixes)")
    parser.add_argument("--max-bytes", type=size_in_bytes, default="256M", help="largest message")
    parser.add_argument("--factor", type=cli.positive_int, default=4, help="size step between messages")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "float16"], default=["float32", "float16"],
                        help="element types")
    parser.add_argument("--libraries", nargs="+", choices=["horovod", "mpi", "torch"],
                        default=["horovod", "mpi", "torch"],
                        help="mpi: mpi4py's Allreduce (needs an MPI launch); torch: torch.distributed (Gloo)")
    parser.add_argument("--seconds", type=cli.positive_float, default=0.5,
                        help="timed seconds per size and library, roughly (at least 5 iterations)")
    add_backend_arguments(parser)


def check_allreduce_arguments(args, parser):
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")


def size_in_bytes(text):
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        value = int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 256M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return value


def add_scaling_arguments(modes, script):
    """The scaling and compare modes; ``script``: the benchmark.py whose train mode they launch."""
    scaling = modes.add_parser("scaling", help="run train for several world sizes with horovodrun",
                               epilog="Arguments after -- go to `benchmark.py train`.")
    scaling.add_argument("--np", nargs="+", type=cli.positive_int, default=[1, 2], help="world sizes")
    add_launch_arguments(scaling)
    scaling.add_argument("--horovodrun-args", default="",
                         help="more horovodrun options, e.g. '-H a:2,b:2 --network-interface eth0'")
    scaling.add_argument("--output-dir", type=Path, default=Path("runs/scaling"),
                         help="train-np<N>.json per size, scaling.json, scaling.png")
    scaling.add_argument("--timeout", type=cli.positive_int, default=1800, help="seconds per launch")
    compare = modes.add_parser("compare", help="Horovod, DDP, one Horovod worker and no distribution, "
                                               "interleaved, with their ratios",
                               epilog="Arguments after -- go to every `benchmark.py train` run.")
    compare.add_argument("--np", type=cli.positive_int, default=2, help="workers of the Horovod and DDP runs")
    add_launch_arguments(compare)
    compare.add_argument("--repeats", type=cli.positive_int, default=3,
                         help="rounds of the four runs, one after another (drift hits all four alike)")
    compare.add_argument("--horovod-args", default="",
                         help="train options for the Horovod runs only, e.g. '--cycle-time-ms 5'")
    compare.add_argument("--horovodrun-args", default="", help="more horovodrun options")
    compare.add_argument("--output-dir", type=Path, default=Path("runs/compare"),
                         help="one JSON per run, compare.json")
    compare.add_argument("--timeout", type=cli.positive_int, default=1800, help="seconds per launch")
    for parser in (scaling, compare):
        parser.set_defaults(script=script)


def add_launch_arguments(parser):
    parser.add_argument("--controller", choices=["gloo", "mpi"], default="mpi",
                        help="horovodrun --mpi (horovodrun's own default where MPI is installed) or --gloo")


def add_tune_arguments(modes, script):
    tune = modes.add_parser("tune", help="sweep fusion threshold, cycle time and compression; write the best "
                                         "as a profile for --horovod-profile",
                            epilog="Arguments after -- go to every `benchmark.py train` run (the model, batch).")
    tune.add_argument("--np", type=cli.positive_int, default=2, help="workers of every run")
    add_launch_arguments(tune)
    tune.add_argument("--horovodrun-args", default="",
                      help="more horovodrun options, e.g. '-H a:4,b:4 --network-interface eth0'")
    tune.add_argument("--fusion-mb", nargs="+", type=cli.non_negative_int, default=[0, 16, 64, 128],
                      help="HOROVOD_FUSION_THRESHOLD values in MiB (0: no fusion)")
    tune.add_argument("--cycle-ms", nargs="+", type=cli.positive_float, default=[1, 2.5, 5, 10],
                      help="HOROVOD_CYCLE_TIME values in ms")
    tune.add_argument("--compression", nargs="+", choices=["none", "fp16"], default=["none", "fp16"],
                      help="gradient compression to try")
    tune.add_argument("--repeats", type=cli.positive_int, default=2,
                      help="rounds over every combination, interleaved")
    tune.add_argument("--output-dir", type=Path, default=Path("runs/tune"),
                      help="one JSON per run, tune.json and horovod-profile.json")
    tune.add_argument("--timeout", type=cli.positive_int, default=1800, help="seconds per launch")
    tune.set_defaults(script=script)


def add_timeline_arguments(modes):
    parser = modes.add_parser("timeline", help="where the time went in a Horovod timeline "
                                               "(--horovod-timeline): totals per activity")
    parser.add_argument("file", type=Path, help="the timeline JSON (a run still writing it is fine)")
    parser.add_argument("--output", type=Path, metavar="FILE", help="also write the summary as JSON here")


def add_predict_arguments(modes):
    parser = modes.add_parser("predict", help="predicted step time and efficiency on 2-512 nodes (a model)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--model", choices=MODELS, metavar="MODEL",
                      help="gradients of this model of hvdtrain.models, as benchmark.py train has them "
                           "(resnet50, bert-large, ...)")
    what.add_argument("--gradient-bytes", type=float, help="fp32 gradient bytes per step instead of --model")
    parser.add_argument("--tensors", type=cli.positive_int, default=100,
                        help="with --gradient-bytes: that many equal gradient tensors")
    compute = parser.add_mutually_exclusive_group()
    compute.add_argument("--compute-ms", type=cli.positive_float,
                         help="one worker's compute per step (forward, backward, update; every backward pass "
                              "of a step with accumulation), ms")
    compute.add_argument("--compute-from", type=Path, metavar="TRAIN_JSON",
                         help="a `benchmark.py train --baseline none` JSON: its step time")
    link = parser.add_mutually_exclusive_group()
    link.add_argument("--link-gbit", type=cli.positive_float,
                      help="link rate, Gbit/s, taken as the busbw (default: 100 without the other two)")
    link.add_argument("--busbw-gbps", type=cli.positive_float, help="measured allreduce bus bandwidth, GB/s")
    link.add_argument("--sweep", type=Path, metavar="SWEEP_JSON",
                      help="a `benchmark.py allreduce` JSON: busbw of its largest message, latency of its smallest")
    parser.add_argument("--library", choices=["horovod", "mpi", "torch"], default="horovod",
                        help="the sweep's rows to read")
    parser.add_argument("--latency-us", type=cli.positive_float,
                        help="latency per ring step, microseconds (default: the sweep's, else 10)")
    parser.add_argument("--fusion-mb", type=float, default=128,
                        help="HOROVOD_FUSION_THRESHOLD in MiB (0: no fusion)")
    parser.add_argument("--overlap", type=cli.fraction, default=1.0,
                        help="share of the backward pass that can hide communication")
    parser.add_argument("--backward-share", type=cli.fraction, default=0.67,
                        help="backward's share of the compute time")
    parser.add_argument("--cast-gbps", type=cli.positive_float,
                        help="fp32 -> fp16 cast throughput, GB/s of fp32 (default: measured here)")
    parser.add_argument("--nodes", type=cli.positive_int, nargs="+", default=NODES,
                        help="node counts, one worker each (default: 2 4 8 ... 512)")
    parser.add_argument("--validate", type=Path, metavar="STUDY_JSON",
                        help="a tools/link_study.py study.json: each cell against its bound and the prediction")
    parser.add_argument("--vocab-size", type=cli.positive_int, default=30522, help="BERT models' vocabulary")


def add_backend_arguments(parser):
    """The options of the modes that start a backend (train, allreduce)."""
    parser.add_argument("--output", type=Path, metavar="FILE", help="also write the results as JSON here")
    parser.add_argument("--cpu", action="store_true", help="ignore GPUs")
    parser.add_argument("--threads", type=cli.positive_int, help="CPU threads per rank; unset: cores / ranks")
