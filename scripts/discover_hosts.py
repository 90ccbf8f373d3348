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
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hvdtrain.launch import hosts as hostlib
from hvdtrain.cli import ArgumentParser, positive_int, run_main
from hvdtrain.errors import UsageError
from hvdtrain.launch.hosts import EXCLUDED_HOSTS_VAR

SLURM_SECONDS = 20  # per Slurm command; slower counts as not answering
STATE_VAR = "HVD_DISCOVERY_STATE"


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


class SlurmUnavailable(Exception):
    """Slurm could not be asked, or gave an answer we cannot read."""


def slurm_hosts(env, default_slots):
    """The allocation's nodes that Slurm considers usable (see the module's docstring)."""
    allocation = hostlib.from_slurm(env, default_slots)  # bad input: one line, exit 2
    state = State(state_path(env))
    try:
        kept, left_out = hostlib.usable_hosts(allocation, *ask_slurm(env))
    except SlurmUnavailable as problem:
        return state.fall_back(allocation, f"cannot ask Slurm for the node states ({problem})")
    if not kept:
        return state.fall_back(allocation, f"Slurm calls every node unusable ({describe(left_out)})")
    state.say(f"leaving out {describe(left_out)}" if left_out else
              "every node of the allocation usable again" if state.said else "")
    state.keep(kept)
    return kept


def describe(left_out):
    return ", ".join(f"{name} ({reason})" for name, reason in left_out.items())


def ask_slurm(env):
    """(node states from sinfo, the job's nodes now from squeue or None outside a job)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    try:
        states = hostlib.parse_node_states(slurm_output(hostlib.node_state_command(nodelist)))
    except ValueError as error:
        raise SlurmUnavailable(error) from None
    job = env.get("SLURM_JOB_ID")
    if not job:
        return states, None
    nodes = slurm_output(["squeue", "--noheader", "--jobs", job, "--format", "%N"]).strip()
    try:
        return states, set(hostlib.expand_nodelist(nodes, "squeue"))
    except UsageError as error:
        raise SlurmUnavailable(f"squeue gave no nodes for job {job}: {error}") from None


def slurm_output(command):
    """A Slurm command's stdout; SlurmUnavailable if it is missing, fails or is slow."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SLURM_SECONDS,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmUnavailable(f"{command[0]} not found") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"{command[0]} gave no answer in {SLURM_SECONDS} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SlurmUnavailable(f"{command[0]}: {last}")
    return done.stdout


def state_path(env):
    """Where the last list and the last stderr line live: one file per job and user."""
    if env.get(STATE_VAR):
        return Path(env[STATE_VAR])
    job = env.get("SLURM_JOB_ID")
    return Path(tempfile.gettempdir()) / f"hvd-discover-{os.getuid()}-{job}.json" if job else None


class State:
    """What the last call printed and said, so that a line goes to stderr only when it changes."""

    def __init__(self, path):
        self.path = path
        try:  # a missing or damaged file: nothing said, no list yet
            saved = json.loads(path.read_text()) if path else {}
            self.said = str(saved.get("said", ""))
            self.hosts = [[str(name), int(slots)] for name, slots in saved.get("hosts", [])]
        except (OSError, ValueError, TypeError, AttributeError):
            self.said, self.hosts = "", []

    def say(self, line):
        if line != self.said:
            if line:
                print(f"discover_hosts.py: {line}", file=sys.stderr, flush=True)
            self.said = line
            self.save()

    def keep(self, hosts):
        names = [[host.name, host.slots] for host in hosts]
        if names != self.hosts:
            self.hosts = names
            self.save()

    def fall_back(self, allocation, problem):
        """The last list Slurm's answers gave (of this allocation), else the whole allocation."""
        listed = {name for name, _ in self.hosts}
        last = [host for host in allocation if host.name in listed]
        what = "the last list" if last else "every node of the allocation"
        self.say(f"{problem}: listing {what}")
        return last or allocation

    def save(self):
        if not self.path:
            return
        try:
            new = self.path.with_name(f"{self.path.name}.{os.getpid()}")
            new.write_text(json.dumps({"said": self.said, "hosts": self.hosts}))
            new.replace(self.path)  # atomically: a call never reads half a file
        except OSError:
            pass  # then it says things again: better than failing discovery


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
