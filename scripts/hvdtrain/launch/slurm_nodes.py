"""discover_hosts.py --slurm: the allocation's nodes that Slurm considers usable now.

Asks ``squeue`` for the job's nodes and ``sinfo`` for their states on every
call (horovodrun runs discovery every second); what a transient failure does is
in scripts/discover_hosts.py's docstring. The parsing is in launch/hosts.py.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hvdtrain.errors import UsageError
from hvdtrain.launch import hosts as hostlib

SLURM_SECONDS = 20  # per Slurm command; slower counts as not answering
STATE_VAR = "HVD_DISCOVERY_STATE"


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
        return state.fall_back(allocation, f"Slurm calls every node unusable ({left_out_text(left_out)})")
    state.say(f"leaving out {left_out_text(left_out)}" if left_out else
              "every node of the allocation usable again" if state.said else "")
    state.keep(kept)
    return kept


def left_out_text(left_out):
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
