#!/usr/bin/env python3
"""Turn an allocation or a hostfile into the hostfile (or -H string) a launcher wants.

Inside a Slurm, PBS or LSF job with no source option, the allocation is read
from the environment. Examples:

    # Slurm: SLURM_JOB_NODELIST + SLURM_TASKS_PER_NODE -> Open MPI hostfile
    python scripts/make_hostfile.py --slurm -o hosts.txt
    # the same hosts as horovodrun's -H string
    horovodrun -np 8 -H "$(python scripts/make_hostfile.py --slurm --format H)" python ...
    # a nodelist with a slot count per node
    python scripts/make_hostfile.py --hosts 'gpu-a[1,3-5],gpu-b7' --slots 4 --format mpich
    # validate a hostfile, print its -H string, check it holds 8 ranks
    python scripts/make_hostfile.py --hostfile hostfiles/openmpi --format H -np 8

Hostfiles may carry comments, blank lines, max_slots= and repeated host lines
(their slots add up). Bad input is one line naming the file and line, exit 2.
"""
import os
import sys
from pathlib import Path

from hvdtrain.launch import hosts as hostlib
from hvdtrain.cli import ArgumentParser, positive_int, run_main
from hvdtrain.errors import UsageError


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--hostfile", metavar="FILE",
                        help="read a hostfile (Open MPI, MPICH, horovodrun or PBS form; '-' for stdin)")
    source.add_argument("--hosts", metavar="LIST",
                        help="hosts as 'a:4,b:4' or a Slurm nodelist like 'node[01-04]'")
    source.add_argument("--slurm", action="store_true",
                        help="SLURM_JOB_NODELIST with SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE")
    source.add_argument("--pbs", action="store_true", help="PBS_NODEFILE (one line per slot)")
    source.add_argument("--lsf", action="store_true", help="LSB_MCPU_HOSTS or LSB_HOSTS")
    parser.add_argument("--input-format", default="auto",
                        choices=("auto", "openmpi", "mpich", "horovodrun", "pbs"),
                        help="with --hostfile: the form to expect; 'horovodrun' checks what "
                             "horovodrun --hostfile itself can read")
    parser.add_argument("--slots", type=positive_int, default=None,
                        help="slots for hosts given without a count (default: 1 in hostfiles, "
                             "required for --hosts names without :N)")
    parser.add_argument("--tasks-per-node", metavar="SPEC",
                        help="with --hosts: slots per node in Slurm's form, e.g. 4 or 2(x3),1")
    parser.add_argument("--format", default="openmpi", choices=hostlib.FORMATS,
                        help="output: openmpi 'host slots=N', mpich 'host:N', "
                             "horovodrun 'host slots=N' (no comments), H 'a:N,b:N'")
    parser.add_argument("-np", type=positive_int, default=None,
                        help="fail unless the hosts have at least this many slots")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    return parser.parse_args(argv)


def read_text(path):
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None


def detect_source(env):
    """The allocation we are inside, when no source option was given."""
    if env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"):
        return "slurm"
    if env.get("PBS_NODEFILE"):
        return "pbs"
    if env.get("LSB_MCPU_HOSTS") or env.get("LSB_HOSTS"):
        return "lsf"
    raise UsageError("no hosts given and no Slurm, PBS or LSF allocation found: "
                     "pass --hostfile, --hosts, --slurm, --pbs or --lsf")


def load_hosts(args, env):
    """(hosts, a name for where they came from)."""
    if args.tasks_per_node and not args.hosts:
        raise UsageError("--tasks-per-node goes with --hosts")
    if args.hostfile:
        default = args.slots or 1
        name = "stdin" if args.hostfile == "-" else args.hostfile
        text = read_text(args.hostfile)
        return hostlib.parse_hostfile(text, name, default, args.input_format), name
    if args.hosts:
        if args.tasks_per_node:
            names = hostlib.expand_nodelist(args.hosts, "--hosts")
            counts = hostlib.expand_tasks_per_node(args.tasks_per_node, len(names), "--tasks-per-node")
            return hostlib.hosts_with_counts(names, counts), "--hosts"
        return hostlib.parse_host_string(args.hosts, args.slots, "--hosts"), "--hosts"
    source = ("slurm" if args.slurm else "pbs" if args.pbs else "lsf" if args.lsf
              else detect_source(env))
    if source == "slurm":
        return hostlib.from_slurm(env, args.slots), "the Slurm allocation"
    if source == "pbs":
        return hostlib.from_pbs(env, read_text), env.get("PBS_NODEFILE")
    return hostlib.from_lsf(env), "the LSF allocation"


def main(argv=None):
    args = parse_args(argv)
    hosts, source = load_hosts(args, os.environ)
    hostlib.check_np(hosts, args.np, source)
    text = hostlib.render(hosts, args.format)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: {len(hosts)} hosts, {hostlib.total_slots(hosts)} slots",
              file=sys.stderr)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    run_main(main)
