#!/usr/bin/env python3
"""Elastic host discovery for ``horovodrun --host-discovery-script``.

horovodrun runs this script every few seconds and reads one ``host:slots``
line per usable host from its output. The hosts come from a hostfile that
may change while the job runs: add a line and Horovod grows the job, remove
one and it shrinks. Replace the file atomically (write a new file, then
``mv`` it over the old one) so a run never reads half a file.

    horovodrun -np 2 --min-np 1 --max-np 4 --network-interface lo \\
        --host-discovery-script "python scripts/discover_hosts.py hostfiles/elastic" \\
        python tests/workers/elastic_grow.py runs/elastic 2

The hostfile takes any form make_hostfile.py reads (``host slots=N``,
``host:N``, comments). The path can also come from HVD_DISCOVERY_HOSTFILE.
Inside a Slurm allocation ``--slurm`` lists the allocation's nodes instead
(SLURM_JOB_NODELIST, as ``scontrol show hostnames`` expands it, with
SLURM_TASKS_PER_NODE slots each) that Slurm considers usable now: it asks
``squeue`` for the job's nodes (a --no-kill job loses a failed node from its
allocation) and ``sinfo`` for their states, and leaves out a node that is
DOWN, DRAINED or DRAINING, FAILING, powered down, or not responding (``idle*``:
its slurmd missed a ping). A node whose worker died is let in again once
Horovod's blacklist cooldown ends (``--blacklist-cooldown-range``) if Slurm
still lists it as usable. slurm/common.sh's LAUNCHER=horovodrun-elastic runs it.

What a transient failure does (--slurm): horovodrun runs this every second and
takes what it prints as the whole truth, so an empty or partial list would stop
healthy workers. When Slurm cannot be asked (no sinfo, a command failing or
slower than 20 s, an answer it cannot read) or calls every node unusable (the
node running this is alive, so that is Slurm's error), it prints the last list
Slurm's answers gave, else the whole allocation, and says so on stderr. It
keeps that list and what it last said in a small file (HVD_DISCOVERY_STATE:
slurm/common.sh gives each launch its own; by default one per job and user in
the temporary directory) and writes a line to
stderr only when what it has to say changes (a node left out, Slurm not
answering, all usable again), not every second. (Exiting non-zero instead
would make horovodrun keep its last list too, but fail the job at the first
call and log a warning every second.) Dead workers are Horovod's to find: it
blacklists a host whose workers failed whatever this lists.

A missing or broken file is one line on stderr and exit status 2, which
horovodrun reports; it never prints a partial host list. Hosts listed in the
file HVDTRAIN_EXCLUDED_HOSTS names are left out: the trainers add a straggler's
host there (--straggler-action exclude).
"""
import os
import sys
from pathlib import Path

from hvdtrain.launch import hosts as hostlib
from hvdtrain.cli import ArgumentParser, positive_int, run_main
from hvdtrain.errors import UsageError
from hvdtrain.launch.hosts import EXCLUDED_HOSTS_VAR
from hvdtrain.launch.slurm_nodes import slurm_hosts


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hostfile", nargs="?", default=os.environ.get("HVD_DISCOVERY_HOSTFILE"),
                        help="hostfile to read (default: $HVD_DISCOVERY_HOSTFILE)")
    parser.add_argument("--slots", type=positive_int, default=1,
                        help="slots for a host listed without a count")
    parser.add_argument("--slurm", action="store_true",
                        help="the Slurm allocation's nodes (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE) "
                             "that Slurm considers usable now, instead of a hostfile")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.slurm:
        # --slots only where Slurm gives no task count; a bare hostfile host gets it too.
        print_hosts(slurm_hosts(os.environ, args.slots))
        return
    if not args.hostfile:
        raise UsageError("no hostfile: pass one or set HVD_DISCOVERY_HOSTFILE")
    try:
        text = Path(args.hostfile).read_text()
    except OSError as error:
        raise UsageError(f"cannot read {args.hostfile}: {error.strerror}") from None
    print_hosts(hostlib.parse_hostfile(text, args.hostfile, default_slots=args.slots))


def print_hosts(hosts):
    # Horovod's discovery format: one "host:slots" per line.
    excluded = excluded_hosts(os.environ.get(EXCLUDED_HOSTS_VAR))
    sys.stdout.write("".join(f"{host.name}:{host.slots}\n" for host in hosts if host.name not in excluded))


def excluded_hosts(path):
    """Hosts the trainers excluded as stragglers (--straggler-action exclude), one per line."""
    try:
        return set(Path(path).read_text().split()) if path else set()
    except FileNotFoundError:
        return set()


if __name__ == "__main__":
    run_main(main)
