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

Pure Python (no torch, no Horovod): the host tools run anywhere, fast.
"""
import re
from dataclasses import dataclass, field

from .cli import UsageError

FORMATS = ("openmpi", "mpich", "horovodrun", "H")

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
def expand_nodelist(text, where="nodelist"):
    """Slurm's compressed host list -> host names, in order.

    ``node[01-04]`` -> node01..node04 (zero padding kept), ``gpu-a[1,3-5],gpu-b7``
    -> gpu-a1, gpu-a3, gpu-a4, gpu-a5, gpu-b7; several brackets in one name
    (``r[1-2]n[1-2]``) expand in order, like `scontrol show hostnames`.
    """
    names = []
    for item in _split_top_level(text.strip(), where):
        names.extend(_expand_item(item, where))
    if not names:
        raise UsageError(f"{where}: no host names in {text!r}")
    return names


def _split_top_level(text, where):
    """Split on commas outside brackets."""
    items, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"{where}: unbalanced ']' in {text!r}")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise UsageError(f"{where}: unbalanced '[' in {text!r}")
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def _expand_item(item, where):
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not match:
        if not _HOST_RE.match(item):
            raise UsageError(f"{where}: bad host name {item!r}")
        return [item]
    prefix, ranges, rest = match.groups()
    expanded = []
    for number in _expand_ranges(ranges, item, where):
        expanded.extend(_expand_item(prefix + number + rest, where))
    return expanded


def _expand_ranges(ranges, item, where):
    numbers = []
    for part in ranges.split(","):
        match = re.match(r"^(\d+)(?:-(\d+))?$", part.strip())
        if not match:
            raise UsageError(f"{where}: bad range {part!r} in {item!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise UsageError(f"{where}: range {part!r} runs backwards in {item!r}")
        width = len(first) if first.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return numbers


def expand_tasks_per_node(spec, node_count, where="tasks per node"):
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) or a single count -> one int per node."""
    spec = spec.strip()
    if re.match(r"^\d+$", spec):
        counts = [int(spec)] * node_count
    else:
        counts = []
        for part in spec.split(","):
            match = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
            if not match:
                raise UsageError(f"{where}: cannot read {spec!r} (expected e.g. 4 or 2(x3),1)")
            counts.extend([int(match.group(1))] * int(match.group(2) or 1))
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
    for item in _split_top_level(text.strip(), where):
        names, colon, slots = item.partition(":")
        if colon:
            count = _slot_count(slots, where, item)
        elif default_slots is None:
            raise UsageError(f"{where}: missing slot count for {item!r} "
                             "(write host:N or pass --slots N)")
        else:
            count = default_slots
        hosts.extend(Host(name, count) for name in expand_nodelist(names, where))
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
