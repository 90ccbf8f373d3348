"""The trainers' command-line options, importable without torch or Horovod.

A trainer parses its command line before it imports torch (about 1.5 s of CPU,
on every rank) and Horovod, so `--help` and a bad argument answer in a tenth of a
second. So the options both trainers share live here, with the names and
defaults they need; what an option does lives with the code that acts on it
(runtime/run.py, nonfinite.py, stragglers.py, elastic.py, precision.py).
"""
import argparse
from pathlib import Path

from hvdtrain import cli
from hvdtrain.errors import NONFINITE_EXIT, STRAGGLER_EXIT
from hvdtrain.launch.hosts import EXCLUDED_HOSTS_VAR

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
STRAGGLER_ACTIONS = ("warn", "checkpoint-exit", "exclude")
CNN_MODELS = ("convnet", "resnet18", "resnet20", "resnet50", "resnet56")  # models/resnet.py's MODELS
CNN_DATASETS = ("digits", "cifar10", "imagefolder", "synthetic")  # data/images.py's
BERT_PRESETS = {  # Google's BERT sizes (Turc et al. 2019 for the small ones); models/bert.py builds them
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
    "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
}


def preset_or_code(presets):
    """An argparse type: one of ``presets``, or your own code, MODULE:CALLABLE (usercode.py)."""
    def parse(text):
        if text in presets or ":" in text:
            return text
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(presets)}, or name "
                                         "your own as MODULE:CALLABLE or path/to/file.py:CALLABLE)")
    parse.__name__ = "preset or MODULE:CALLABLE"
    return parse


def add_run_arguments(parser, output_dir, checkpoint_every):
    """Flags with the same name and meaning in every trainer (runtime/run.py acts on them)."""
    flag = argparse.BooleanOptionalAction
    out = parser.add_argument_group("output, checkpoints and stopping")
    out.add_argument("--output-dir", type=Path, default=Path(output_dir),
                     help="checkpoints, metrics.jsonl, results.json, tensorboard/")
    out.add_argument("--resume", action=flag, default=True,
                     help="continue from the newest checkpoint in --output-dir; --no-resume starts over "
                          "and deletes that directory's earlier checkpoints and metrics")
    out.add_argument("--checkpoint-every", type=cli.non_negative_int, default=checkpoint_every,
                     help="also checkpoint every N steps (0: only at epoch ends and the end)")
    out.add_argument("--take-over-lock", action="store_true",
                     help="use --output-dir even though its run.lock names a run that may still be alive "
                          "(stale locks are taken over without this)")
    out.add_argument("--checkpoint-write", choices=["auto", "async", "sync"], default="auto",
                     help="async: the checkpointing step pays a copy of the state in host memory and rank 0 "
                          "writes the file in the background while training goes on (one write in flight; "
                          "stops wait for it); sync: every rank waits until the file is written; auto: async "
                          "where the copy fits in half the available memory")
    out.add_argument("--keep-checkpoints", type=cli.positive_int, default=3,
                     help="newest step-*.pt kept (plus best.pt where there is one)")
    out.add_argument("--stop-after", "--max-steps", dest="stop_after", type=cli.positive_int, metavar="STEP",
                     help="checkpoint and exit 0 after this step (the schedule is unchanged); relaunch to continue")
    out.add_argument("--stop-check-every", type=cli.positive_int, default=10,
                     help="steps between the (collective) checks for SIGTERM/SIGUSR1")
    out.add_argument("--seed", type=cli.non_negative_int, default=42,
                     help="initialisation, data order, augmentation, masking")
    add_nonfinite_arguments(out)
    device = parser.add_argument_group("device and Horovod")
    device.add_argument("--accumulation-steps", "--batches-per-allreduce", dest="accumulation_steps",
                        type=cli.positive_int, default=1,
                        help="backward passes of --batch-size accumulated locally per allreduce and step")
    device.add_argument("--fp16-allreduce", action=flag, default=None,
                        help="Horovod: send gradients as fp16 (default: off, or the --horovod-profile's choice)")
    device.add_argument("--horovod-profile", type=Path, metavar="FILE",
                        help="Horovod settings from `benchmark.py tune` (fusion threshold, cycle time, "
                             "compression); also HVDTRAIN_HOROVOD_PROFILE. Variables set in the environment win")
    device.add_argument("--cpu", action="store_true", help="ignore GPUs")
    device.add_argument("--threads", type=cli.positive_int,
                        help="CPU threads per rank (default: cores / ranks on the node)")
    add_horovod_diagnostics(device)
    add_straggler_arguments(parser)
    return device


def add_horovod_diagnostics(group):
    """--horovod-timeline, --horovod-autotune, --horovod-autotune-log (see dist.request_diagnostics).

    Not --timeline/--autotune: horovodrun's own parser reads option-like words
    after the command too, and "--timeline" is an ambiguous prefix of its
    --timeline-filename/--timeline-mark-cycles (an error before anything runs).
    """
    group.add_argument("--horovod-timeline", type=Path, metavar="FILE",
                       help="Horovod: write a timeline of every allreduce (Chrome trace JSON) from rank 0")
    group.add_argument("--horovod-autotune", action="store_true",
                       help="Horovod: tune fusion threshold, cycle time and caching while running")
    group.add_argument("--horovod-autotune-log", type=Path, metavar="FILE",
                       help="Horovod: CSV of the autotuner's trials (implies --horovod-autotune)")


def add_nonfinite_arguments(group):
    """runtime/nonfinite.py: what a NaN or Inf loss does."""
    group.add_argument("--nonfinite-loss", choices=("skip", "stop"), default="skip",
                       help="when a rank's loss is NaN or Inf: skip: no update on any rank, the step "
                            f"counted in results.json; stop: end the run (exit status {NONFINITE_EXIT})")
    group.add_argument("--max-nonfinite-steps", type=cli.non_negative_int, default=10, metavar="N",
                       help=f"with skip: stop (exit status {NONFINITE_EXIT}) after N skipped steps in a row "
                            "(0: never)")


def add_straggler_arguments(parser):
    """runtime/stragglers.py: finding the slow rank and what to do about it."""
    group = parser.add_argument_group("stragglers (docs/stragglers.md)")
    group.add_argument("--straggler-interval", type=cli.non_negative_int, default=100, metavar="STEPS",
                       help="steps between the per-rank timing reports (0: off)")
    group.add_argument("--straggler-threshold", type=cli.fraction, default=0.8,
                       help="a rank whose relative score stays below this is a straggler")
    group.add_argument("--straggler-patience", type=cli.positive_int, default=3, metavar="INTERVALS",
                       help="intervals in a row below the threshold before acting")
    group.add_argument("--straggler-action", choices=STRAGGLER_ACTIONS, default="warn",
                       help="warn: one line naming the rank and host; checkpoint-exit: also checkpoint and "
                            f"exit with status {STRAGGLER_EXIT}, so a requeue can leave that host out; exclude "
                            f"(--elastic): the host leaves the job (added to ${EXCLUDED_HOSTS_VAR}, which "
                            "discover_hosts.py reads) and training goes on without it")


def add_elastic_arguments(group, commit_every):
    """runtime/elastic.py: Horovod's elastic mode."""
    group.add_argument("--elastic", action="store_true",
                       help="Horovod elastic: survive lost workers and admit new ones (launch with horovodrun "
                            "--min-np/--max-np --host-discovery-script)")
    group.add_argument("--elastic-commit-every", type=cli.positive_int, default=commit_every, metavar="N",
                       help="--elastic: commit the state in memory every N steps (and at epoch ends); a lost "
                            "worker costs at most the steps since the last commit")


def add_precision_arguments(group, cuda_auto, amp_alias=False):
    """--precision (runtime/precision.py; for train_cnn.py also the old --amp/--no-amp, now
    spellings of fp16/fp32)."""
    group.add_argument("--precision", choices=PRECISIONS, default="auto",
                       help=f"autocast dtype; auto: {cuda_auto} on CUDA, bf16 on a CPU with native bf16 "
                            "(AMX or AVX512-BF16), else fp32")
    if amp_alias:
        group.add_argument("--amp", "--no-amp", action=AmpAlias, dest="precision",
                           help="older spellings: --amp is --precision fp16, --no-amp is --precision fp32")


class AmpAlias(argparse.Action):
    """--amp / --no-amp set --precision to fp16 / fp32 (the later flag wins, as for any repeated option)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, "fp32" if option_string == "--no-amp" else "fp16")
