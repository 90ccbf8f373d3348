"""What every benchmark result carries: its statistics, the environment it was
measured in (with the exact command), and the JSON file it is written to."""
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import horovod


def summarize(values):
    """Median, spread and mean ± 1.96σ (as Horovod's synthetic benchmark reports)."""
    mean = statistics.fmean(values)
    sigma = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "mean": mean,
            "ci95": 1.96 * sigma, "values": values}


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mpi_version():
    try:
        shown = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
        return shown.stdout.strip().splitlines()[0] if shown.returncode == 0 and shown.stdout else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def horovod_settings():
    """HOROVOD_* variables that tune or trace (not the launcher's rank bookkeeping)."""
    bookkeeping = ("RANK", "SIZE", "LOCAL_", "CROSS_", "HOSTNAME", "GLOO_", "CONTROLLER", "CPU_OPERATIONS")
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith("HOROVOD_") and not name[len("HOROVOD_"):].startswith(bookkeeping)}


def command_line():
    """This process's command line, as a shell would take it."""
    return shlex.join([sys.executable, *sys.argv])


def environment(backend, knobs):
    """What a result depends on, recorded with it."""
    gpu = torch.cuda.get_device_name() if backend.device.type == "cuda" else None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "gpu": gpu,
        "python": platform.python_version(), "torch": torch.__version__, "horovod": horovod.__version__,
        "mpi": mpi_version(), "backend": backend.name, "controller": backend.controller(),
        "world_size": backend.size, "threads_per_rank": backend.threads,
        "knobs": {**knobs, **horovod_settings()},
        "command": command_line(),
    }


def write_json(result, path):
    """The result as indented JSON at ``path`` (its folder made); nothing when ``path`` is None."""
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
