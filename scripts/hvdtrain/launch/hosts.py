"""Hosts and slots: hostfiles, Slurm nodelists, PBS and LSF allocations.

Reads every form people meet and writes the one a launcher wants:

    openmpi      node1 slots=4        mpirun -hostfile FILE   (Open MPI)
    mpich        node1:4              mpirun -f FILE          (MPICH, Intel MPI)
    horovodrun   node1 slots=4        horovodrun --hostfile FILE  (strict: see below)
    H            node1:4,node2:4      horovodrun -H STRING

Rules for hostfiles we read: ``#`` starts a comment, blank lines and trailing
spaces are ignored, ``max_slots=``/``max-slots=`` is accepted (and must not be
below ``slots``), a bare host name counts as ``default_slots`` (1 unless told,
as in MPICH and PBS node files), and a host listed again has its slots added
(as Open MPI and PBS node files count them). Anything else is an error naming
the line. horovodrun's own ``--hostfile`` reader is stricter than the rest: it
cannot skip comments or blank lines and needs ``slots=`` on every line, so the
``horovodrun`` input format checks exactly that.

Pure Python (no torch, no Horovod; python-hostlist is pure Python too): the host
tools run anywhere, fast.
"""
import re
from dataclasses import dataclass, field

import hostlist  # python-hostlist: Slurm host list syntax

from hvdtrain.errors import UsageError


FORMATS = ("openmpi", "mpich", "horovodrun", "H")
# --elastic: the file of hosts scripts/discover_hosts.py leaves out (the trainers add a straggler's);
# here, not in runtime/stragglers.py, so that discovery, run every second, imports no torch.
EXCLUDED_HOSTS_VAR = "HVDTRAIN_EXCLUDED_HOSTS"

# Host names: letters, digits, '-', '_', '.' (IPv4 addresses included).
_HOST = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_HOST_RE = re.compile(rf"^{_HOST}$")
_COLON_LINE = re.compile(rf"^({_HOST}):(\S*)$")
_KEY_VALUE = re.compile(r"^([A-Za-z_\-]+)\s*=\s*(\S*)")


@dataclass
class Host:
    name: str
    slots: int
    max_slots: int = None
    lines: list = field(default_factory=list, compare=False, repr=False)  # hostfile lines it came from


# ---------------------------------------------------------------- nodelists
# Slurm's host list syntax is python-hostlist's (the library LLNL/NSC tools use);
# what it leaves to us: checking each name, our error wording, and counts per node.
_HOSTLIST_REASONS = {
    "start > stop": "a range runs backwards",
    "bad range": "bad range (ranges are N or N-M)",
    "results too large": "more than 100000 names",
    "range too large": "a range of more than 100000 names",
}


def expand_nodelist(text, where="nodelist"):
    """Slurm's compressed host list -> host names, in order.

    ``node[01-04]`` -> node01..node04 (zero padding kept), ``gpu-a[1,3-5],gpu-b7``
    -> gpu-a1, gpu-a3, gpu-a4, gpu-a5, gpu-b7; several brackets in one name
    (``r[1-2]n[1-2]``) expand in order, like `scontrol show hostnames`.
    Repeats are kept: a host listed twice has its slots added (see ``merge``).
    """
    names = _expand(text, where)
    for name in names:
        _check_name(name, where, text)
    return names


def _expand(text, where):
    """python-hostlist's expansion, stripped of blanks ("a, b" as "a,b"); at least one name."""
    try:
        expanded = hostlist.expand_hostlist(text, allow_duplicates=True)
    except hostlist.BadHostlist as error:
        raise UsageError(f"{where}: {_hostlist_reason(str(error), text)} in {text!r}") from None
    names = [name.strip() for name in expanded if name.strip()]
    if not names:
        raise UsageError(f"{where}: no host names in {text!r}")
    return names


def _check_name(name, where, text):
    # python-hostlist takes any characters ("no de" is one name): we do not.
    if not _HOST_RE.match(name):
        raise UsageError(f"{where}: bad host name {name!r} in {text!r}")


def _hostlist_reason(reason, text):
    """python-hostlist's reason in our words; it does not say which bracket is unbalanced."""
    if reason == "unbalanced brackets":
        depth = 0
        for char in text:
            depth += {"[": 1, "]": -1}.get(char, 0)
            if depth < 0:
                return "unbalanced ']'"
        return "unbalanced '['"
    return _HOSTLIST_REASONS.get(reason, reason)


def expand_tasks_per_node(spec, node_count, where="tasks per node"):
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) or a single count -> one int per node."""
    spec = re.sub(r"\s+", "", spec)
    if spec.isdigit():  # SLURM_NTASKS_PER_NODE, --tasks-per-node 4: the same on every node
        counts = [int(spec)] * node_count
    else:
        try:
            counts = hostlist.parse_slurm_tasks_per_node(spec)
        except hostlist.BadHostlist:
            raise UsageError(f"{where}: cannot read {spec!r} (expected e.g. 4 or 2(x3),1)") from None
    if len(counts) != node_count:
        raise UsageError(f"{where}: {spec!r} gives {len(counts)} counts for {node_count} nodes")
    if 0 in counts:
        raise UsageError(f"{where}: {spec!r} gives a node zero slots")
    return counts


# ---------------------------------------------------------------- hostfiles
def parse_hostfile(text, source="hostfile", default_slots=1, input_format="auto"):
    """Hostfile text -> merged [Host]. ``input_format``: auto, openmpi, mpich, horovodrun, pbs."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        where = f"{source} line {number}"
        if input_format == "horovodrun":
            hosts.append(_parse_horovodrun_line(raw, where))
        else:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            hosts.append(_parse_line(line, where, default_slots, input_format))
        hosts[-1].lines.append(number)  # so a too-small file can name its lines
    if not hosts:
        raise UsageError(f"{source}: no hosts (only comments or blank lines)")
    return merge(hosts)


def _parse_line(line, where, default_slots, input_format):
    fields = line.split()
    colon = _COLON_LINE.match(fields[0])
    if colon and input_format in ("auto", "mpich"):
        if len(fields) > 1:
            raise UsageError(f"{where}: unknown syntax {line!r} (MPICH lines are host:slots)")
        return Host(colon.group(1), _slot_count(colon.group(2), where, line))
    if not _HOST_RE.match(fields[0]):
        raise UsageError(f"{where}: unknown syntax {line!r} (bad host name {fields[0]!r})")
    if input_format in ("pbs", "mpich") and len(fields) > 1:
        kind = "PBS node files hold one host per line" if input_format == "pbs" else \
            "MPICH lines are host or host:slots"
        raise UsageError(f"{where}: unknown syntax {line!r} ({kind})")
    return _parse_openmpi_fields(fields, where, line, default_slots)


def _parse_openmpi_fields(fields, where, line, default_slots):
    """``host [slots=N] [max_slots=M]``; ``slots = N`` with spaces is accepted too."""
    host = Host(fields[0], default_slots)
    rest = " ".join(fields[1:])
    while rest:
        match = _KEY_VALUE.match(rest)
        if not match:
            raise UsageError(f"{where}: unknown syntax {line!r}")
        key, value = match.group(1).lower().replace("-", "_"), match.group(2)
        if key == "slots":
            host.slots = _slot_count(value, where, line)
        elif key == "max_slots":
            host.max_slots = _slot_count(value, where, line)
        else:
            raise UsageError(f"{where}: unknown syntax {line!r} (unknown key {key!r})")
        rest = rest[match.end():].strip()
    if host.max_slots is not None and host.max_slots < host.slots:
        raise UsageError(f"{where}: max_slots below slots in {line!r}")
    return host


def _parse_horovodrun_line(raw, where):
    """What horovodrun --hostfile itself can read: exactly ``host slots=N``."""
    line = raw.rstrip()
    if not line.strip() or line.lstrip().startswith("#"):
        raise UsageError(f"{where}: horovodrun --hostfile cannot read comments or blank lines "
                         "(remove them, or convert with make_hostfile.py --format horovodrun)")
    match = re.match(rf"^({_HOST})\s+slots=(\S*)$", line.strip())
    if not match:
        if _HOST_RE.match(line.strip()):
            raise UsageError(f"{where}: missing slot count in {line.strip()!r} "
                             "(horovodrun needs 'host slots=N')")
        raise UsageError(f"{where}: unknown syntax {line.strip()!r} "
                         "(horovodrun reads only 'host slots=N' lines)")
    return Host(match.group(1), _slot_count(match.group(2), where, line.strip()))


def _slot_count(value, where, line):
    if value == "":
        raise UsageError(f"{where}: missing slot count in {line!r}")
    if not value.isdigit():
        raise UsageError(f"{where}: slot count {value!r} is not a number in {line!r}")
    if int(value) == 0:
        raise UsageError(f"{where}: zero slots in {line!r}")
    return int(value)


def merge(hosts):
    """One entry per host, in first-seen order; a repeated host's slots are added."""
    merged = {}
    for host in hosts:
        if host.name not in merged:
            merged[host.name] = Host(host.name, 0, None)
        entry = merged[host.name]
        entry.slots += host.slots
        entry.lines += host.lines
        if host.max_slots is not None:
            entry.max_slots = (entry.max_slots or 0) + host.max_slots
    return list(merged.values())


# ---------------------------------------------------------------- host strings
def parse_host_string(text, default_slots=None, where="host list"):
    """``a:2,b:2``, ``node[01-04]`` or ``gpu-a[1,3-5]:4,gpu-b7:2`` -> merged [Host].

    A name without ``:N`` takes ``default_slots``; without one that is an error.
    """
    hosts = []
    # python-hostlist carries what follows the brackets into every name: n[1-2]:4 -> n1:4, n2:4.
    for entry in _expand(text, where):
        name, colon, slots = entry.partition(":")
        _check_name(name, where, text)
        if colon:
            count = _slot_count(slots, where, entry)
        elif default_slots is None:
            raise UsageError(f"{where}: missing slot count for {name!r} in {text!r} "
                             "(write host:N or pass --slots N)")
        else:
            count = default_slots
        hosts.append(Host(name, count))
    return merge(hosts)


def hosts_with_counts(names, counts):
    return merge([Host(name, count) for name, count in zip(names, counts)])


# ---------------------------------------------------------------- allocations
def from_slurm(env, default_slots=None):
    """SLURM_JOB_NODELIST + SLURM_TASKS_PER_NODE (or SLURM_NTASKS_PER_NODE)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UsageError("SLURM_JOB_NODELIST is not set (not inside a Slurm allocation?)")
    names = expand_nodelist(nodelist, "SLURM_JOB_NODELIST")
    spec = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if spec:
        return hosts_with_counts(names, expand_tasks_per_node(spec, len(names), "SLURM_TASKS_PER_NODE"))
    if default_slots is None:
        raise UsageError("missing slot count: SLURM_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE "
                         "are unset; pass --slots N")
    return hosts_with_counts(names, [default_slots] * len(names))


# ---------------------------------------------------------------- node states
# What Slurm says of a node, as `sinfo --Node --format "%N %T"` prints it: the state's
# long name, then a flag character where one applies (sinfo(1), NODE STATE CODES).
# A node is left out of an elastic job on Slurm's word only: a state below, or a flag.
UNUSABLE_STATES = {
    "down": "down", "drain": "drained", "drained": "drained", "draining": "draining",
    "fail": "failing", "failing": "failing",
    "powered_down": "powered down", "powering_down": "powering down", "power_down": "powering down",
}
UNUSABLE_FLAGS = {"*": "not responding", "~": "powered off", "%": "powering down"}
_STATE_LINE = re.compile(rf"^({_HOST})\s+([a-z_+]+)([^a-z_+\s]?)$")


def node_state_command(nodelist):
    """sinfo's one line per node: name and state, over every partition (hidden ones too)."""
    return ["sinfo", "--noheader", "--Node", "--all", "--nodes", nodelist, "--format", "%N %T"]


def parse_node_states(text):
    """``node1 mixed\nnode4 idle*`` -> {"node1": "mixed", "node4": "idle*"}.

    A node in several partitions is listed once per partition, with the same state.
    Raises ValueError on a line that is not ``name state``: sinfo answered something else.
    """
    states = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _STATE_LINE.match(line.strip().lower())
        if not match:
            raise ValueError(f"unexpected sinfo line {line.strip()!r}")
        states[match.group(1)] = match.group(2) + match.group(3)
    return states


def unusable_reason(state):
    """Why Slurm's ``state`` (``idle*``, ``draining``, ``mixed``) keeps a node out; None if it does not."""
    names, flag = re.match(r"^([a-z_+]*)(.*)$", state.lower()).groups()
    if flag in UNUSABLE_FLAGS:
        return UNUSABLE_FLAGS[flag]
    return next((UNUSABLE_STATES[name] for name in names.split("+") if name in UNUSABLE_STATES), None)


def usable_hosts(hosts, states, allocated=None):
    """``hosts`` less the nodes Slurm calls unusable (``states`` from parse_node_states) and,
    given ``allocated`` (the job's nodes now), those no longer in the job's allocation
    (Slurm removes a failed node from a --no-kill job; back in service, it is not ours).
    A node sinfo does not list stays: Slurm said nothing against it.
    Returns (kept hosts, {left-out name: reason})."""
    kept, left_out = [], {}
    for host in hosts:
        state = states.get(host.name.lower())
        reason = unusable_reason(state) if state else None
        if reason:
            left_out[host.name] = f"{state}: {reason}"
        elif allocated is not None and host.name not in allocated:
            left_out[host.name] = "no longer in the job's allocation"
        else:
            kept.append(host)
    return kept, left_out


def from_pbs(env, read_text):
    """PBS/Torque: PBS_NODEFILE lists each host once per slot."""
    path = env.get("PBS_NODEFILE")
    if not path:
        raise UsageError("PBS_NODEFILE is not set (not inside a PBS job?)")
    return parse_hostfile(read_text(path), source=path, input_format="pbs")


def from_lsf(env):
    """LSF: LSB_MCPU_HOSTS ('h1 4 h2 4'), else LSB_HOSTS ('h1 h1 h1 h1 h2 ...')."""
    mcpu = env.get("LSB_MCPU_HOSTS", "").split()
    if mcpu:
        if len(mcpu) % 2:
            raise UsageError(f"LSB_MCPU_HOSTS: expected 'host count' pairs, got {' '.join(mcpu)!r}")
        pairs = list(zip(mcpu[0::2], mcpu[1::2]))
        for name, _ in pairs:
            _check_lsf_name(name, "LSB_MCPU_HOSTS")
        return merge([Host(name, _slot_count(count, "LSB_MCPU_HOSTS", f"{name} {count}"))
                      for name, count in pairs])
    names = env.get("LSB_HOSTS", "").split()
    if not names:
        raise UsageError("LSB_HOSTS and LSB_MCPU_HOSTS are not set (not inside an LSF job?)")
    for name in names:
        _check_lsf_name(name, "LSB_HOSTS")
    return merge([Host(name, 1) for name in names])


def _check_lsf_name(name, variable):
    if not _HOST_RE.match(name):
        raise UsageError(f"{variable}: bad host name {name!r}")


# ---------------------------------------------------------------- output
def total_slots(hosts):
    return sum(host.slots for host in hosts)


def check_np(hosts, np, source):
    """-np must fit the slots; the error says where each host's slots come from."""
    if np is None or np <= total_slots(hosts):
        return
    shown = "; ".join(_slots_of(host) for host in hosts[:4]) + ("; ..." if len(hosts) > 4 else "")
    raise UsageError(f"-np {np} is more than the {total_slots(hosts)} slots in {source} ({shown}): "
                     "raise slots= or add hosts (one machine: mpirun --oversubscribe)")


def _slots_of(host):
    where = f"line {', '.join(map(str, host.lines))}: " if host.lines else ""
    return f"{where}{host.name} {host.slots} slot{'s' if host.slots != 1 else ''}"


def render(hosts, fmt):
    """The hosts as text in format ``fmt`` (one of FORMATS)."""
    if fmt == "openmpi":
        return "".join(f"{h.name} slots={h.slots}"
                       + (f" max_slots={h.max_slots}" if h.max_slots else "") + "\n"
                       for h in hosts)
    if fmt == "mpich":
        return "".join(f"{h.name}:{h.slots}\n" for h in hosts)
    if fmt == "horovodrun":
        return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)
    if fmt == "H":
        return ",".join(f"{h.name}:{h.slots}" for h in hosts) + "\n"
    raise ValueError(f"unknown format {fmt!r}")
