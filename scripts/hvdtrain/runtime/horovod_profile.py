"""A Horovod tuning profile: the settings `benchmark.py tune` found fastest on a cluster, read by the trainers.

    {"format": "hvdtrain-horovod-profile/1",
     "environment": {"HOROVOD_FUSION_THRESHOLD": "16777216", "HOROVOD_CYCLE_TIME": "2.5"},
     "fp16_allreduce": false,
     "tuned_on": {"np": 8, "controller": "mpi", "train_args": "--model resnet50", "rate": 812.3, ...}}

``--horovod-profile FILE`` (or HVDTRAIN_HOROVOD_PROFILE) applies it before
hvd.init() reads the variables. A variable already set in the environment wins
(it was set on purpose, for this launch), and so does an explicit
``--fp16-allreduce`` / ``--no-fp16-allreduce``. Every rank reads the file, so
it must be on a file system they share (or copied to each node).
"""
import json
import os
from dataclasses import dataclass

from hvdtrain.errors import UsageError

FORMAT = "hvdtrain-horovod-profile/1"
PROFILE_ENV = "HVDTRAIN_HOROVOD_PROFILE"
VARIABLES = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME")  # what a profile may set
MIB = 2 ** 20
# The gradients' fixed buckets (dist.fixed_gradient_buckets), each fused on its own: DDP's default size.
BUCKET_BYTES = 25 * MIB


def packed(sizes, limit):
    """Positions of ``sizes`` in order, in groups of at most ``limit`` bytes (a larger one alone;
    0: each alone): the gradients' buckets (dist.fixed_gradient_buckets) and the fusion buffers
    within them (bench/predict.py)."""
    groups, total = [], 0
    for position, size in enumerate(sizes):
        if not groups or limit <= 0 or total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(position)
        total += size
    return groups


@dataclass(frozen=True)
class Profile:
    path: str
    environment: dict  # HOROVOD_* variable -> value (strings, as the environment holds them)
    fp16_allreduce: bool
    tuned_on: dict


def write(path, fusion_mb, cycle_ms, fp16_allreduce, tuned_on):
    """A profile file from tune's best row (None: Horovod's own default for that variable)."""
    environment = {}
    if fusion_mb is not None:
        environment["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_mb * MIB))
    if cycle_ms is not None:
        environment["HOROVOD_CYCLE_TIME"] = f"{cycle_ms:g}"
    path.write_text(json.dumps({"format": FORMAT, "environment": environment, "fp16_allreduce": fp16_allreduce,
                                "tuned_on": tuned_on}, indent=1) + "\n")
    return path


def load(path):
    """The profile at ``path``; one line naming the problem when it is not one."""
    try:
        data = json.loads(open(path).read())
    except OSError as error:
        raise UsageError(f"--horovod-profile {path}: cannot read it ({error.strerror})") from None
    except ValueError as error:
        raise UsageError(f"--horovod-profile {path}: not JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"--horovod-profile {path}: not a Horovod profile (expected \"format\": \"{FORMAT}\"; "
                         "write one with `benchmark.py tune`)")
    environment = data.get("environment", {})
    unknown = sorted(set(environment) - set(VARIABLES)) if isinstance(environment, dict) else ["?"]
    if unknown or not all(_number(value) for value in environment.values()):
        raise UsageError(f"--horovod-profile {path}: \"environment\" may set {', '.join(VARIABLES)} to numbers; "
                         f"found {environment!r}")
    if not isinstance(data.get("fp16_allreduce", False), bool):
        raise UsageError(f"--horovod-profile {path}: \"fp16_allreduce\" must be true or false")
    return Profile(str(path), dict(environment), data.get("fp16_allreduce", False), data.get("tuned_on", {}))


def apply(args):
    """Before hvd.init(): the profile's variables where the environment has none, and
    ``args.fp16_allreduce`` resolved (the flag, else the profile, else off). Returns
    the line that says what was used, or None without a profile."""
    path = args.horovod_profile or os.environ.get(PROFILE_ENV) or None
    if path is None:
        args.fp16_allreduce = bool(args.fp16_allreduce)
        return None
    profile = load(path)
    args.horovod_profile = profile.path
    used, kept = [], []
    for name, value in profile.environment.items():
        if name in os.environ and os.environ[name] != str(value):
            kept.append(f"{name}={os.environ[name]} (set in the environment)")
        else:
            os.environ[name] = str(value)
            used.append(f"{name}={value}")
    if args.fp16_allreduce is None:
        args.fp16_allreduce = profile.fp16_allreduce
        used.append(f"fp16 allreduce {'on' if profile.fp16_allreduce else 'off'}")
    else:
        kept.append(f"fp16 allreduce {'on' if args.fp16_allreduce else 'off'} (the flag)")
    tuned = profile.tuned_on
    origin = (f" (tuned on {tuned['np']} ranks, {tuned.get('controller', '?')} controller, "
              f"{tuned.get('train_args') or 'default model'})" if "np" in tuned else "")
    return (f"Horovod profile {profile.path}{origin}: {', '.join(used) or 'nothing'}"
            + (f"; kept {', '.join(kept)}" if kept else ""))


def _number(value):
    try:
        return float(value) >= 0
    except (TypeError, ValueError):
        return False
