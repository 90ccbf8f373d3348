"""The scripts the tests launch, and the small argument sets several test modules share."""
import re

from .launch import SCRIPTS, horovodrun, python

CNN = SCRIPTS / "train_cnn.py"
QUICK_CNN = ["--model", "convnet", "--image-size", "8", "--batch-size", "16"]
PREPARE = SCRIPTS / "prepare_bert_data.py"
PRETRAIN = SCRIPTS / "pretrain_bert.py"
MAKE_HOSTFILE = SCRIPTS / "make_hostfile.py"
DISCOVER = SCRIPTS / "discover_hosts.py"

# A rank held to SLOW_SHARE of a core (support/ranks.py cpu_share) is named within a
# few intervals; the threshold is 0.5, not the default 0.8: the throttled rank runs
# at ~0.1 of the fastest, while a healthy rank beside four busy test workers dipped
# to 0.71 and 0.72 in two CI runs here and was named (and excluded) first.
SLOW_SHARE = 0.05
SLOW_RANK_WATCH = ["--straggler-interval", "10", "--straggler-patience", "2", "--straggler-threshold", "0.5"]

# Run the host tools as if outside any batch system, whatever the test runner is in.
NO_ALLOCATION = {name: "" for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_TASKS_PER_NODE",
                                       "SLURM_NTASKS_PER_NODE", "PBS_NODEFILE", "LSB_HOSTS",
                                       "LSB_MCPU_HOSTS", "HVD_DISCOVERY_HOSTFILE")}


# Runs a script as `python SCRIPT ARGS` would, then names the heavy modules it loaded, whatever the exit.
_LOADED_PROBE = """
import runpy, sys
script, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    print("loaded:", sorted({m.split(".")[0] for m in sys.modules} & {"torch", "horovod", "transformers"}))
"""


def with_heavy_modules(script_args, timeout, env=None, np=None):
    """(the finished run of ``python SCRIPT ARGS``, the heavy modules it loaded: torch, horovod,
    transformers); ``np``: under ``horovodrun -np NP``, the modules any rank loaded."""
    args = ["-c", _LOADED_PROBE, *script_args]
    ran = horovodrun(np, args, timeout=timeout, env=env) if np else python(args, timeout=timeout, env=env)
    found = re.findall(r"loaded: \[(.*)\]$", ran.output, re.M)
    assert found and (not np or len(found) == np), ran.describe()
    return ran, sorted({name.strip("' ") for names in found for name in names.split(",") if name.strip()})


def make_hostfile(args, env=None):
    """``python scripts/make_hostfile.py ARGS`` outside any allocation (``env`` added)."""
    return python([MAKE_HOSTFILE, *args], timeout=30, env={**NO_ALLOCATION, **(env or {})})
