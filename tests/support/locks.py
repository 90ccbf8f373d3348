"""run.lock files as another run would have written them (hvdtrain's output-directory lock)."""
import json
import os
import socket


def lock_of(holder_pid, **fields):
    """A run.lock as a holder on this host would have written it."""
    stat = open(f"/proc/{holder_pid}/stat").read() if os.path.exists(f"/proc/{holder_pid}/stat") else None
    start = int(stat.rsplit(")", 1)[1].split()[19]) if stat else 1
    lock = {"host": socket.gethostname(), "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(),
            "pid": holder_pid, "pid_start": start, "slurm_job_id": "", "started": "2026-11-22T10:00:00+00:00",
            "command": "train_cnn.py --lr 0.2", "token": "planted"}
    return json.dumps({**lock, **fields})
