#!/usr/bin/env python
"""What grows with the number of ranks: train_cnn.py at 1, 2, 4, ... ranks under mpirun.

For each N, three launches of the same small job (convnet, synthetic data, one
thread and batch 4 per rank, a checkpoint every 10 steps):
- a clean one: seconds from the launch to rank 0's first step (launcher, imports,
  hvd.init, the rank agreement, data), steps/s after it, and the seconds from
  the last step to the launcher's exit (final checkpoint, results, shutdown);
  from rank 0's results.json "durations": the rank agreement check (one
  allgather of every rank's settings) and a checkpoint's per-rank gather and
  write (means over the launch's checkpoints);
- a faulty one: the highest rank SIGKILLed once the first checkpoint is on disk;
  seconds until the launcher exits, and how many lines the job printed after
  the loss, progress lines aside (the policy: one error line; mpirun's own
  report is a block of several lines, whatever the size);
- an elastic one (`horovodrun --elastic`, N slots on this machine): the highest
  rank SIGKILLed after the first checkpoint; rank 0's "an elastic reset" (from
  the failure to the new world of N-1) and the state sync after it.

On one host (default: `mpirun --oversubscribe --bind-to none`, as the ranks of
one node) every rank shares the machine's cores, so steps/s falls with N by
compute alone; the columns that measure the mechanism are the start, the end
and the lost-rank ones. `--hosts 4` runs on support/hosts.py's four hosts (root),
N/4 ranks each, started over ssh as on a cluster.

    .venv/bin/python tools/scale_study.py --ranks 1 2 4 8 16 32
    .venv/bin/python tools/scale_study.py --elastic-only --ranks 2 4 8 16 32
"""
import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from support.commands import CNN
from support.hosts import Hosts, require_hosts
from support.launch import Timed
from support.ranks import rank_pids

JOB = ["--dataset", "synthetic", "--synthetic-samples", "100000", "--model", "convnet", "--image-size", "8",
       "--threads", "1", "--batch-size", "4", "--checkpoint-every", "10"]
FIRST_STEP = re.compile(r"progress: step 1/")  # with a progress line every step (PROGRESS below)
PROGRESS = {"HVDTRAIN_PROGRESS_SECONDS": "0.001"}
PROGRESS_LINE = re.compile(r"progress: step ")


COLUMNS = [("ranks", 5), ("start_s", 7), ("steps_per_s", 11), ("images_per_s", 12), ("end_s", 5),
           ("agree_s", 7), ("gather_s", 8), ("write_s", 7), ("lost_end_s", 10), ("lost_lines", 10),
           ("reset_s", 7), ("sync_s", 6)]


def shown(value):
    return "-" if value is None else value


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="world sizes")
    parser.add_argument("--steps", type=int, default=40, help="train_cnn.py --max-steps of the clean launch")
    parser.add_argument("--hosts", type=int, choices=(1, 4), default=1,
                        help="1: this machine; 4: support/hosts.py's four hosts (root)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds before a launch is killed")
    parser.add_argument("--no-elastic", action="store_true", help="skip the elastic launches")
    parser.add_argument("--elastic-only", action="store_true",
                        help="only the elastic launches (the reset after a lost rank), on this machine")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser.parse_args()


def command_for(ranks, hosts, out, extra, scratch):
    script = [sys.executable, CNN, *JOB, "--output-dir", out, *extra]
    if hosts is None:
        return ["mpirun", "-np", ranks, "--oversubscribe", "--bind-to", "none", *script]
    hostfile = Path(scratch) / f"hostfile-{ranks}"
    per_host = max(1, ranks // len(hosts.names))
    used = hosts.names[:max(1, min(len(hosts.names), ranks))]
    hostfile.write_text("".join(f"{name} slots={per_host}\n" for name in used))
    return hosts.on_first([*hosts.mpirun(ranks, hostfile, pass_env=PROGRESS), *script])


def env_for(hosts):
    return {**(hosts.env() if hosts else {}), "OMPI_MCA_rmaps_base_oversubscribe": "0" if hosts else "1", **PROGRESS}


def clean_run(ranks, hosts, scratch, args):
    out = Path(scratch) / f"clean-{ranks}"
    run = Timed(command_for(ranks, hosts, out, ["--max-steps", args.steps], scratch), env_for(hosts),
                args.timeout).wait()
    first = run.first(FIRST_STEP)
    if run.process.returncode != 0 or first is None:
        sys.exit(f"scale_study.py: error: {ranks} ranks: the clean launch failed:\n{run.output()[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    last_step = (out / f"step-{args.steps:09d}.pt").stat().st_mtime
    moments = results["durations"]
    return {"start_s": round(first, 1), "steps_per_s": round(results["images_per_sec"] / (4 * ranks), 2),
            "images_per_s": round(results["images_per_sec"], 1),
            "end_s": round(run.ended_wall - last_step, 1),
            "agree_s": mean_seconds(moments, "checking that the ranks agree"),
            "gather_s": mean_seconds(moments, "gathering the ranks' checkpoint entries"),
            "write_s": mean_seconds(moments, "writing a checkpoint")}


def mean_seconds(moments, name):
    moment = moments.get(name)
    return round(moment["total_s"] / moment["count"], 3) if moment else None


def kill_highest_rank_after_a_checkpoint(out, ranks, hosts, killed):
    while not any(out.glob("step-*.pt")):
        time.sleep(0.2)
    for pid in rank_pids(str(out), ranks - 1) if hosts is None else []:
        os.kill(pid, signal.SIGKILL)
    if hosts is not None:
        hosts.vanish(hosts.names[-1], str(out))  # every rank of the last host
    killed["at"] = time.monotonic()


def lost_rank_run(ranks, hosts, scratch, args):
    out = Path(scratch) / f"lost-{ranks}"
    killed = {}
    watcher = threading.Thread(target=kill_highest_rank_after_a_checkpoint, args=(out, ranks, hosts, killed),
                               daemon=True)
    run = Timed(command_for(ranks, hosts, out, ["--epochs", "50"], scratch), env_for(hosts), args.timeout)
    watcher.start()
    run.wait()
    if "at" not in killed:
        return {"lost_end_s": None, "lost_lines": None}
    after = [line for at, line in run.lines if run.started + at >= killed["at"] and not PROGRESS_LINE.search(line)]
    if os.environ.get("SCALE_STUDY_SHOW_LOSS"):
        print("\n".join(after), file=sys.stderr)
    return {"lost_end_s": round(run.started + run.ended - killed["at"], 1), "lost_lines": len(after)}


def elastic_run(ranks, scratch, args):
    """horovodrun --elastic with N slots here; the highest rank killed: the reset's seconds on rank 0."""
    out, hostfile = Path(scratch) / f"elastic-{ranks}", Path(scratch) / f"elastic-hosts-{ranks}"
    hostfile.write_text(f"localhost slots={ranks}\n")
    discovery = f"{sys.executable} {Path(CNN).parent / 'discover_hosts.py'} {hostfile}"
    command = ["horovodrun", "-np", ranks, "--min-np", 1, "--max-np", ranks, "--network-interface", "lo",
               "--host-discovery-script", discovery, sys.executable, CNN, *JOB, "--elastic",
               "--elastic-commit-every", "5", "--max-steps", args.steps * 2, "--output-dir", out]
    killed = {}
    watcher = threading.Thread(target=kill_highest_rank_after_a_checkpoint, args=(out, ranks, None, killed),
                               daemon=True)
    run = Timed(command, {}, args.timeout)
    watcher.start()
    run.wait()
    if "at" not in killed or not (out / "results.json").exists():
        return {"reset_s": None, "sync_s": None}
    moments = json.loads((out / "results.json").read_text())["durations"]
    return {"reset_s": mean_seconds(moments, "an elastic reset"),
            "sync_s": mean_seconds(moments, "synchronising the elastic state")}


def main():
    args = parse_args()
    hosts = None
    if args.hosts == 4:
        require_hosts()
        hosts = Hosts([f"node{i}" for i in range(1, 5)], "10.79.0").start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            print("  ".join(f"{column:>{width}}" for column, width in COLUMNS), flush=True)
            for ranks in args.ranks:
                row = {"ranks": ranks}
                if not args.elastic_only:
                    row.update(clean_run(ranks, hosts, scratch, args))
                if ranks > 1 and not args.elastic_only:
                    row.update(lost_rank_run(ranks, hosts, scratch, args))
                if ranks > 1 and hosts is None and not args.no_elastic:
                    row.update(elastic_run(ranks, scratch, args))
                rows.append(row)
                print("  ".join(f"{shown(row.get(column)):>{width}}" for column, width in COLUMNS), flush=True)
    finally:
        if hosts is not None:
            hosts.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
