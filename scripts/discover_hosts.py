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
SLURM_TASKS_PER_NODE slots each): a node whose worker died is let in again
once Horovod's blacklist cooldown ends (``--blacklist-cooldown-range``).
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
from hvdtrain.runtime.stragglers import EXCLUDED_HOSTS_VAR


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hostfile", nargs="?", default=os.environ.get("HVD_DISCOVERY_HOSTFILE"),
                        help="hostfile to read (default: $HVD_DISCOVERY_HOSTFILE)")
    parser.add_argument("--slots", type=positive_int, default=1,
                        help="slots for a host listed without a count")
    parser.add_argument("--slurm", action="store_true",
                        help="the Slurm allocation's nodes (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE) "
                             "instead of a hostfile")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.slurm:
        # --slots only where Slurm gives no task count; a bare hostfile host gets it too.
        print_hosts(hostlib.from_slurm(os.environ, args.slots))
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
