#!/usr/bin/env python
"""Measure the fault matrix with the default limits and print it as a Markdown table.

    .venv/bin/python tools/fault_matrix.py            # every fault x launcher
    .venv/bin/python tools/fault_matrix.py --faults stop --launchers mpirun

Rank 1 of a 2-rank train_cnn.py job (digits) is SIGSTOPped, deadlocks its main
thread, is SIGKILLed, or raises after step 20 (HVDTRAIN_FAULT), under each
launcher; srun runs inside a one-node Slurm cluster started here (root, Slurm,
munge). Each row: seconds from the fault to the end of the job, exit status,
and the line that names the rank and the cause.
"""
import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from support.fault_cells import FAULTS, LAUNCHERS, run_cell


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--launchers", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS))
    parser.add_argument("--parallel", type=int, default=4, help="cells run side by side")
    parser.add_argument("--floor", type=float, help="HVDTRAIN_WATCHDOG_FLOOR_SECONDS (default: the trainers' 60)")
    parser.add_argument("--show-output", action="store_true", help="each job's output after the table")
    args = parser.parse_args()
    cluster = None
    if "srun" in args.launchers:
        from support.slurm_cluster import SlurmCluster
        cluster = SlurmCluster.start()
    root = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    cells = [(fault, launcher) for fault in args.faults for launcher in args.launchers]
    env = {"HVDTRAIN_WATCHDOG_FLOOR_SECONDS": str(args.floor)} if args.floor else None
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            done = list(pool.map(lambda c: run_cell(c[0], c[1], root / f"{c[0]}-{c[1].replace(' --', '-')}",
                                                    env, cluster), cells))
    finally:
        if cluster:
            cluster.stop()
    print("| fault on rank 1 | launcher | seconds to end (after the fault) | exit status | message |")
    print("|---|---|---|---|---|")
    for cell in done:
        status = "timed out" if cell.timed_out else cell.returncode
        print(f"| {cell.fault} | `{cell.launcher}` | {cell.seconds_after_fault:.0f} | {status} | "
              f"`{(cell.message or '(none)').replace('|', '/')}` |")
    for cell in done if args.show_output else ():
        print(f"\n===== {cell.describe()}")


if __name__ == "__main__":
    main()
