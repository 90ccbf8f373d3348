"""Elastic horovodrun jobs on one machine: the discovery hostfile a test rewrites, the command line."""
import re
import sys

from .launch import SCRIPTS

# Gloo's timeout for the elastic tests that time a reset: far above what a reset takes, a new
# worker's start on a loaded 2-core machine included (about 30 s seen in CI), so a reset that
# waits the timeout out is plain (Horovod's default, 30 s, is as long as such a start).
GLOO_TIMEOUT_SECONDS = 120


def discovery(hostfile):
    return f"{sys.executable} {SCRIPTS / 'discover_hosts.py'} {hostfile}"


def write_hosts(path, *lines):
    """Atomically, as discover_hosts.py asks."""
    new = path.with_name(path.name + ".new")
    new.write_text("".join(f"{line}\n" for line in lines))
    new.replace(path)


def elastic_command(hostfile, np, script_args, interface="lo", extra=(), discover=None):
    """``discover``: the discovery command, if not discover_hosts.py on ``hostfile``."""
    # --network-interface: an elastic job otherwise waits for two hosts to compare NICs.
    return ["horovodrun", "-np", np, "--min-np", "1", "--max-np", np, "--network-interface", interface,
            "--host-discovery-script", discover or discovery(hostfile), *extra, sys.executable, *script_args]


def world_sizes(ran):
    """The world sizes rank 0 announced, in order: one line per (re)start of training.

    From the whole output: horovodrun tags lines by the worker's first slot, so
    a survivor that became rank 0 still prints as [1].
    """
    return [int(n) for n in re.findall(r"(\d+) workers? x batch", ran.output)]
