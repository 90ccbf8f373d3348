"""hostfiles/, scripts/make_hostfile.py and scripts/discover_hosts.py.

The real-world forms people hand these tools (comments, blank lines,
max_slots=, repeated hosts, trailing spaces, Slurm nodelists and task counts,
PBS node files, LSF host lists) and the mistakes that must give one line
naming the line, exit status 2. Scripts run as subprocesses, as users run them.
"""
import pytest

from hvdtrain.launch import hosts as hostlib
from hvdtrain.errors import UsageError
from support.checks import ok, only_an_error_line
from support.commands import DISCOVER, NO_ALLOCATION, make_hostfile
from support.launch import REPO, python

HOSTFILES = REPO / "hostfiles"


# ---------------------------------------------------------------- nodelists
@pytest.mark.parametrize("nodelist, expected", [
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("gpu-a[1,3-5],gpu-b7", ["gpu-a1", "gpu-a3", "gpu-a4", "gpu-a5", "gpu-b7"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("single", ["single"]),
    ("a.example.org,10.0.0.7", ["a.example.org", "10.0.0.7"]),
    ("n[1-2],n1", ["n1", "n2", "n1"]),  # a repeat is kept: its slots add up
    ("a, b[1-2]", ["a", "b1", "b2"]),
])
def test_expand_nodelist(nodelist, expected):
    assert hostlib.expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("nodelist, message", [
    ("node[01-04", "unbalanced '['"),
    ("node01-04]", "unbalanced ']'"),
    ("node[4-1]", "runs backwards"),
    ("node[a-b]", "bad range"),
    ("no de", "bad host name"),
    ("n[1-[2]]", "nested brackets"),
    ("n[1-400]m[1-400]", "more than 100000 names"),
    (",", "no host names"),
])
def test_expand_nodelist_errors(nodelist, message):
    with pytest.raises(UsageError) as raised:
        hostlib.expand_nodelist(nodelist)
    assert message in str(raised.value)


@pytest.mark.parametrize("spec, nodes, expected", [
    ("2(x3),1", 4, [2, 2, 2, 1]),
    ("4", 3, [4, 4, 4]),
    ("1,3(x2)", 3, [1, 3, 3]),
    ("1, 3(x2)", 3, [1, 3, 3]),
])
def test_expand_tasks_per_node(spec, nodes, expected):
    assert hostlib.expand_tasks_per_node(spec, nodes) == expected


@pytest.mark.parametrize("spec, nodes, message", [
    ("2(x2)", 3, "gives 2 counts for 3 nodes"),
    ("2x3", 3, "cannot read"),
    ("0", 2, "zero slots"),
])
def test_expand_tasks_per_node_errors(spec, nodes, message):
    with pytest.raises(UsageError) as raised:
        hostlib.expand_tasks_per_node(spec, nodes)
    assert message in str(raised.value)


def test_repeated_hosts_add_their_slots_in_first_seen_order():
    text = "b slots=1\na slots=2\nb slots=3 max_slots=4\n"
    merged = hostlib.parse_hostfile(text)
    assert [(h.name, h.slots, h.max_slots) for h in merged] == [("b", 4, 4), ("a", 2, None)]


# ---------------------------------------------------------------- make_hostfile.py: good input
HOSTFILE_CASES = [
    # id, hostfile text, extra args, expected output
    ("comments-blank-trailing-spaces",
     "# cluster A\n\nnode1 slots=4   \n   # indented comment\nnode2 slots=4 # trailing comment\n\n",
     ["--format", "H"], "node1:4,node2:4\n"),
    ("max-slots-both-spellings",
     "node1 slots=2 max_slots=4\nnode2 max-slots=8 slots=2\n",
     [], "node1 slots=2 max_slots=4\nnode2 slots=2 max_slots=8\n"),
    ("repeated-host-lines-sum",
     "node1 slots=2\nnode2 slots=2\nnode1 slots=2\n", ["--format", "H"], "node1:4,node2:2\n"),
    ("spaces-around-equals", "node1 slots = 4\n", ["--format", "H"], "node1:4\n"),
    ("mpich-with-and-without-slots", "node1:4\nnode2\n", ["--format", "H"], "node1:4,node2:1\n"),
    ("bare-hosts-take---slots", "node1\nnode2\n", ["--slots", "8", "--format", "mpich"],
     "node1:8\nnode2:8\n"),
    ("pbs-style-one-line-per-slot", "n1\nn1\nn2\nn2\n", ["--format", "H"], "n1:2,n2:2\n"),
    ("ip-addresses", "10.0.0.1 slots=2\n10.0.0.2:2\n", ["--format", "H"], "10.0.0.1:2,10.0.0.2:2\n"),
    ("to-horovodrun-drops-comments-and-max-slots",
     "# header\nnode1 slots=2 max_slots=4\n\nnode2:2\n", ["--format", "horovodrun"],
     "node1 slots=2\nnode2 slots=2\n"),
    ("np-equal-to-total-is-fine", "node1 slots=2\nnode2:2\n", ["-np", "4", "--format", "H"],
     "node1:2,node2:2\n"),
]


@pytest.mark.parametrize("text, args, expected", [c[1:] for c in HOSTFILE_CASES],
                         ids=[c[0] for c in HOSTFILE_CASES])
def test_make_hostfile_reads_real_world_hostfiles(tmp_path, text, args, expected):
    path = tmp_path / "hosts"
    path.write_text(text)
    run = make_hostfile(["--hostfile", path, *args])
    ok(run)
    assert run.output == expected


ALLOCATION_CASES = [
    # id, args, environment, expected output
    ("nodelist-with---slots", ["--hosts", "node[01-04]", "--slots", "2", "--format", "H"], {},
     "node01:2,node02:2,node03:2,node04:2\n"),
    ("nodelist-mixed-ranges", ["--hosts", "gpu-a[1,3-5],gpu-b7", "--slots", "4", "--format", "mpich"], {},
     "gpu-a1:4\ngpu-a3:4\ngpu-a4:4\ngpu-a5:4\ngpu-b7:4\n"),
    ("nodelist-with-counts", ["--hosts", "gpu-a[1,3-5]:4,gpu-b7:2", "--format", "H"], {},
     "gpu-a1:4,gpu-a3:4,gpu-a4:4,gpu-a5:4,gpu-b7:2\n"),
    ("nodelist-with-slurm-task-counts", ["--hosts", "n1,n2,n3", "--tasks-per-node", "2(x2),1",
                                         "--format", "H"], {}, "n1:2,n2:2,n3:1\n"),
    ("slurm-tasks-per-node", ["--slurm"],
     {"SLURM_JOB_NODELIST": "node[01-03],big7", "SLURM_TASKS_PER_NODE": "2(x3),1"},
     "node01 slots=2\nnode02 slots=2\nnode03 slots=2\nbig7 slots=1\n"),
    ("slurm-ntasks-per-node-detected", ["--format", "H"],
     {"SLURM_JOB_NODELIST": "gpu-a[1,3-5]", "SLURM_NTASKS_PER_NODE": "4"},
     "gpu-a1:4,gpu-a3:4,gpu-a4:4,gpu-a5:4\n"),
    ("lsf-hosts", ["--lsf", "--format", "H"], {"LSB_HOSTS": "h1 h1 h2 h2 h2"}, "h1:2,h2:3\n"),
    ("lsf-mcpu-hosts", ["--format", "H"], {"LSB_MCPU_HOSTS": "h1 4 h2 4"}, "h1:4,h2:4\n"),
]


@pytest.mark.parametrize("args, env, expected", [c[1:] for c in ALLOCATION_CASES],
                         ids=[c[0] for c in ALLOCATION_CASES])
def test_make_hostfile_reads_allocations(args, env, expected):
    run = make_hostfile(args, env)
    ok(run)
    assert run.output == expected


def test_make_hostfile_reads_pbs_nodefile_and_writes_output_file(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("cn01\ncn01\ncn01\ncn02\ncn02\ncn02\n")
    out = tmp_path / "hosts.mpich"
    run = make_hostfile(["--pbs", "--format", "mpich", "-o", out], {"PBS_NODEFILE": str(nodefile)})
    ok(run)
    assert out.read_text() == "cn01:3\ncn02:3\n"
    assert "2 hosts, 6 slots" in run.output


# ---------------------------------------------------------------- make_hostfile.py: errors
ERROR_CASES = [
    # id, hostfile text (None: no file), args, environment, fragments the one line must hold
    ("unknown-key", "node1 slots=4\nnode2 cpus=4\n", [], {}, ["line 2", "unknown syntax", "cpus"]),
    ("unknown-syntax", "node1 slots=4\n\n!!node2\n", [], {}, ["line 3", "unknown syntax"]),
    ("mpich-line-with-extra-words", "node1:4 slots=2\n", [], {}, ["line 1", "unknown syntax"]),
    ("zero-slots", "# hosts\nnode1 slots=0\n", [], {}, ["line 2", "zero slots"]),
    ("zero-slots-mpich", "node1:0\n", [], {}, ["line 1", "zero slots"]),
    ("missing-slot-count", "node1 slots=4\nnode2 slots=\n", [], {}, ["line 2", "missing slot count"]),
    ("missing-slot-count-mpich", "node1:\n", [], {}, ["line 1", "missing slot count"]),
    ("slots-not-a-number", "node1 slots=four\n", [], {}, ["line 1", "not a number"]),
    ("max-slots-below-slots", "node1 slots=4 max_slots=2\n", [], {}, ["line 1", "max_slots below slots"]),
    ("horovodrun-needs-slots", "node1 slots=2\nnode2\n", ["--input-format", "horovodrun"], {},
     ["line 2", "missing slot count"]),
    ("horovodrun-cannot-read-comments", "# hosts\nnode1 slots=2\n", ["--input-format", "horovodrun"], {},
     ["line 1", "cannot read comments"]),
    ("horovodrun-cannot-read-max-slots", "node1 slots=2 max_slots=4\n", ["--input-format", "horovodrun"],
     {}, ["line 1", "unknown syntax"]),
    ("np-above-total-slots", "node1 slots=4\nnode2:4\n", ["-np", "9"], {},
     ["-np 9", "8 slots", "line 1: node1 4 slots; line 2: node2 4 slots"]),
    ("np-above-repeated-host", "# hosts\nnode1 slots=1\nnode1 slots=1\n", ["-np", "3", "--input-format", "openmpi"],
     {}, ["-np 3", "line 2, 3: node1 2 slots", "--oversubscribe"]),
    ("only-comments", "# nothing here\n\n", [], {}, ["no hosts"]),
    ("nodelist-without-slots", None, ["--hosts", "node[01-04]"], {}, ["missing slot count", "node[01-04]"]),
    ("nodelist-unbalanced", None, ["--hosts", "node[01-04:2"], {}, ["unbalanced"]),
    ("slurm-count-mismatch", None, ["--slurm"],
     {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"}, ["SLURM_TASKS_PER_NODE", "3 nodes"]),
    ("slurm-without-task-counts", None, ["--slurm"], {"SLURM_JOB_NODELIST": "n[1-3]"},
     ["missing slot count"]),
    ("no-allocation", None, [], {}, ["no hosts given"]),
    ("missing-file", None, ["--hostfile", "/nonexistent/hosts"], {}, ["cannot read /nonexistent/hosts"]),
]


@pytest.mark.parametrize("text, args, env, fragments", [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_make_hostfile_errors_are_one_line_exit_2(tmp_path, text, args, env, fragments):
    if text is not None:
        path = tmp_path / "hosts"
        path.write_text(text)
        args = ["--hostfile", path, *args]
    run = make_hostfile(args, env)
    line = only_an_error_line(run, *fragments)
    assert line.startswith("make_hostfile.py: error: "), run.describe()
    if text is not None and "line" in fragments[0]:
        assert str(tmp_path / "hosts") in line  # the file is named with the line


# ---------------------------------------------------------------- the files in hostfiles/
@pytest.mark.parametrize("name, input_format, expected", [
    ("openmpi", "openmpi", "node1:4,node2:4\n"),
    ("mpich", "mpich", "node1:4,node2:4\n"),
    ("horovodrun", "horovodrun", "node1:4,node2:4\n"),
    ("localhost", "openmpi", "localhost:2\n"),
    ("localhost-horovodrun", "horovodrun", "localhost:2\n"),
    ("elastic", "auto", "localhost:2\n"),
])
def test_repository_hostfiles_are_valid(name, input_format, expected):
    run = make_hostfile(["--hostfile", HOSTFILES / name, "--input-format", input_format, "--format", "H"])
    ok(run)
    assert run.output == expected


def test_every_hostfile_but_horovodrun_s_own_names_its_launcher():
    for path in HOSTFILES.iterdir():
        if path.name in ("horovodrun", "localhost-horovodrun", "README.md"):
            continue
        header = path.read_text().splitlines()[0]
        assert header.startswith("#") and any(word in header for word in ("mpirun", "horovodrun", "discover")), \
            f"{path.name}: first line should say which launcher reads it: {header!r}"
    readme = (HOSTFILES / "README.md").read_text()
    for path in HOSTFILES.iterdir():
        assert f"`{path.name}`" in readme or path.name == "README.md", f"{path.name} missing from README"


def test_horovodrun_H_example_is_the_same_hosts_as_the_hostfiles():
    lines = [line for line in (HOSTFILES / "horovodrun-H").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert len(lines) == 1
    run = make_hostfile(["--hosts", lines[0], "--format", "H"])
    ok(run)
    assert run.output == "node1:4,node2:4\n"


# ---------------------------------------------------------------- discover_hosts.py
def test_discover_hosts_follows_a_changing_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# start with one node\nnode1 slots=2\n")
    first = python([DISCOVER, hostfile], timeout=30, env=NO_ALLOCATION)
    ok(first)
    assert first.output == "node1:2\n"
    # Replaced atomically while the job runs: the next call sees the new hosts.
    new = tmp_path / "hosts.new"
    new.write_text("node1 slots=2\nnode2:4\nnode3\n")
    new.replace(hostfile)
    second = python([DISCOVER], timeout=30, env={**NO_ALLOCATION, "HVD_DISCOVERY_HOSTFILE": str(hostfile)})
    ok(second)
    assert second.output == "node1:2\nnode2:4\nnode3:1\n"


@pytest.mark.parametrize("text, fragment", [
    (None, "cannot read"),
    ("node1 slots=2\nnode2 slots=0\n", "line 2"),
])
def test_discover_hosts_errors_are_one_line_exit_2(tmp_path, text, fragment):
    hostfile = tmp_path / "hosts"
    if text is not None:
        hostfile.write_text(text)
    run = python([DISCOVER, hostfile], timeout=30, env=NO_ALLOCATION)
    only_an_error_line(run, "discover_hosts.py: error:", fragment)


# ---------------------------------------------------------------- discover_hosts.py --slurm: node states
# What `sinfo --noheader --Node --all --nodes node[1-6] --format "%N %T"` prints (Slurm 22.05):
# a node in two partitions is listed twice; '*' marks a node whose slurmd missed a ping.
SINFO = """\
node1 mixed
node2 allocated
node3 draining
node4 idle*
node5 down*
node5 down*
node6 drained
"""


def test_parse_node_states_reads_sinfos_node_lines():
    assert hostlib.parse_node_states(SINFO) == {
        "node1": "mixed", "node2": "allocated", "node3": "draining", "node4": "idle*", "node5": "down*",
        "node6": "drained"}
    with pytest.raises(ValueError, match="unexpected sinfo line"):
        hostlib.parse_node_states("NODELIST STATE\nnode1 mixed extra\n")


@pytest.mark.parametrize("state, reason", [
    ("mixed", None), ("allocated", None), ("idle", None), ("completing", None), ("mixed$", None),
    ("reserved", None), ("down", "down"), ("down*", "not responding"), ("allocated*", "not responding"),
    ("drained", "drained"), ("draining", "draining"), ("drain", "drained"), ("fail", "failing"),
    ("failing", "failing"), ("idle~", "powered off"), ("powered_down", "powered down"),
    ("IDLE+DRAIN", "drained"), ("MIXED", None),
])
def test_unusable_reason(state, reason):
    assert hostlib.unusable_reason(state) == reason


def test_usable_hosts_leaves_out_what_slurm_calls_unusable_and_what_left_the_job():
    hosts = hostlib.from_slurm({"SLURM_JOB_NODELIST": "node[1-6],node9", "SLURM_TASKS_PER_NODE": "4(x7)"})
    kept, left_out = hostlib.usable_hosts(hosts, hostlib.parse_node_states(SINFO))
    # node9 is not in sinfo's answer: Slurm said nothing against it, it stays.
    assert [(host.name, host.slots) for host in kept] == [("node1", 4), ("node2", 4), ("node9", 4)]
    assert left_out == {"node3": "draining: draining", "node4": "idle*: not responding",
                        "node5": "down*: not responding", "node6": "drained: drained"}
    # A --no-kill job that lost node2 (back in service now, but no longer the job's).
    kept, left_out = hostlib.usable_hosts(hosts[:2], {"node1": "mixed", "node2": "idle"}, allocated={"node1"})
    assert [host.name for host in kept] == ["node1"] and left_out == {"node2": "no longer in the job's allocation"}


def test_discover_hosts_slurm_without_slurm_commands_lists_the_allocation_and_says_so_once(tmp_path):
    """No sinfo on PATH: the whole allocation (never an empty or partial list), one line on
    stderr the first time, none on the next call (horovodrun calls every second)."""
    env = {**NO_ALLOCATION, "SLURM_JOB_NODELIST": "gpu[1-2],cpu7", "SLURM_TASKS_PER_NODE": "4(x2),1",
           "SLURM_JOB_ID": "77", "PATH": str(tmp_path / "no-slurm-here"), "HVD_DISCOVERY_STATE": str(tmp_path / "state")}
    first = python([DISCOVER, "--slurm"], timeout=30, env=env)
    ok(first)
    assert first.output.splitlines() == [
        "discover_hosts.py: cannot ask Slurm for the node states (sinfo not found): listing every node of the "
        "allocation", "gpu1:4", "gpu2:4", "cpu7:1"], first.describe()
    again = python([DISCOVER, "--slurm"], timeout=30, env=env)
    ok(again)
    assert again.output == "gpu1:4\ngpu2:4\ncpu7:1\n", again.describe()
    bad = python([DISCOVER, "--slurm"], timeout=30, env={**env, "SLURM_TASKS_PER_NODE": "4(x2)"})
    assert only_an_error_line(bad) == (
        "discover_hosts.py: error: SLURM_TASKS_PER_NODE: '4(x2)' gives 2 counts for 3 nodes"), bad.describe()


def test_discover_hosts_slurm_falls_back_to_the_last_list_slurm_gave(tmp_path):
    """Slurm left node4 out on the last call; now sinfo fails: the last list, not node4 again."""
    state = tmp_path / "state"
    state.write_text('{"said": "leaving out node4 (idle*: not responding)", "hosts": [["node1", 4], ["node2", 4]]}')
    env = {**NO_ALLOCATION, "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_TASKS_PER_NODE": "4(x4)",
           "PATH": str(tmp_path / "no-slurm-here"), "HVD_DISCOVERY_STATE": str(state)}
    ran = python([DISCOVER, "--slurm"], timeout=30, env=env)
    ok(ran)
    assert ran.output.splitlines() == [
        "discover_hosts.py: cannot ask Slurm for the node states (sinfo not found): listing the last list",
        "node1:4", "node2:4"], ran.describe()
