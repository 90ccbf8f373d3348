"""Integrity: one run per output directory, no code from data files, no silent corruption.

Real launches (horovodrun, and Slurm in test_slurm.py) of both trainers.
"""
import json
import os
import pickle
import re
import shutil
import socket
import struct
import subprocess
import sys
import zipfile

import h5py
import pytest
import torch

from support.bert_data import make_small_static_data
from support.checkpoints import checkpoint_file, checksum_file, set_aside
from support.checks import ok, one_error_line, only_an_error_line, the_error_line
from support.commands import CNN, DISCOVER, NO_ALLOCATION, PRETRAIN, QUICK_CNN, make_hostfile
from support.image_data import make_cifar10
from support.launch import SCRIPTS, horovodrun, launch, python, wait_then
from support.ranks import waits_held
from support.locks import lock_of

pytestmark = pytest.mark.usefixtures("need_horovod")


# ---------------------------------------------------------------- output-directory lock
def dead_pid():
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_second_job_on_a_busy_output_dir_exits_2_naming_the_holder(tmp_path):
    """Two horovodrun jobs on one --output-dir: the second stops at once, the first is
    untouched (it runs until SIGUSR1 stops it, after the second has ended)."""
    out = tmp_path / "out"
    first = [CNN, "--output-dir", out, *QUICK_CNN, "--epochs", "1000"]
    ranks = rf"^\S*python\S* \S*train_cnn\.py --output-dir {re.escape(str(out))} .*--epochs 1000"
    script = f"""
        horovodrun -np 2 --gloo {sys.executable} {' '.join(map(str, first))} > {tmp_path}/first.log 2>&1 &
        first=$!
        until [ -e {out}/metrics.jsonl ]; do sleep 0.2; done
        horovodrun -np 2 --gloo {sys.executable} {CNN} --output-dir {out} {' '.join(QUICK_CNN)} --lr 0.2
        echo "second exit $?"
        pkill -USR1 -f '{ranks}'
        wait $first
        echo "first exit $?"
    """
    # The first run only holds the lock meanwhile: once it trains, a sliver of a core is enough.
    with waits_held("--epochs 1000", 2) as hold:
        wait_then(lambda: (out / "metrics.jsonl").exists(), hold, 200)
        run = launch(["bash", "-c", script], timeout=300)
    assert not run.timed_out, run.describe()
    first_log = (tmp_path / "first.log").read_text()
    assert "first exit 0" in run.output and "stopped by SIGUSR1" in first_log, run.describe() + first_log
    assert re.search(r"second exit [12]\b", run.output), run.describe()
    the_error_line(run.output, "train_cnn.py: error:", f"{out} is in use by another run (pid ", socket.gethostname(),
                   "--take-over-lock", shown=run.describe())
    # Only the first run's rows (epoch 1, 2, ... in order), and its lock is gone.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(1, len(rows) + 1)), rows
    assert {row["lr"] for row in rows} <= {0.2} or max(row["lr"] for row in rows) <= 0.2, rows
    assert not (out / "run.lock").exists()


def test_stale_and_live_locks(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = [CNN, "--output-dir", out, *QUICK_CNN, "--epochs", "1", "--stop-after", "2"]
    # A dead process on this host: taken over with a notice.
    gone = dead_pid()
    (out / "run.lock").write_text(lock_of(gone))
    run = ok(python(args, timeout=120))
    assert f"note: taking over the lock on {out} from pid {gone} on {socket.gethostname()}" in run.output
    assert "that process no longer exists" in run.output, run.describe()
    assert not (out / "run.lock").exists()
    # A live one (this test's own process) is refused, until --take-over-lock.
    (out / "run.lock").write_text(lock_of(os.getpid()))
    refused = python(args, timeout=120)
    assert only_an_error_line(refused) == (
        f"train_cnn.py: error: {out} is in use by another run (pid {os.getpid()} on {socket.gethostname()}, "
        f"started 2026-11-22T10:00:00+00:00); wait for it to end or use another --output-dir (if it has ended, "
        f"delete {out}/run.lock or pass --take-over-lock)"), refused.describe()
    run = ok(python([*args, "--take-over-lock"], timeout=120))
    assert "--take-over-lock was given" in run.output, run.describe()
    # A recycled pid (alive, but started later than the holder) is not the holder.
    (out / "run.lock").write_text(lock_of(os.getpid(), pid_start=0))
    run = ok(python(args, timeout=120))
    assert "that process no longer exists" in run.output, run.describe()


def test_bert_preparation_locks_its_output_dir_too(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "run.lock").write_text(lock_of(os.getpid()))
    refused = python([SCRIPTS / "prepare_bert_data.py", "--output-dir", out], timeout=120)
    line = only_an_error_line(refused)
    assert line.startswith(f"prepare_bert_data.py: error: {out} is in use by another run (pid {os.getpid()}")
    assert not (out / "metadata.json").exists()


# ---------------------------------------------------------------- hostile CIFAR-10 batch
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_cifar10_batch_that_would_run_code_is_refused_before_it_runs(tmp_path):
    data = make_cifar10(tmp_path / "cifar")
    marker = tmp_path / "code-ran"
    with open(data / "data_batch_1", "wb") as handle:
        pickle.dump({b"data": _RunsCode(marker), b"labels": [0]}, handle)
    run = horovodrun(2, [CNN, "--dataset", "cifar10", "--data", data, "--model", "convnet", "--epochs", "1",
                         "--output-dir", tmp_path / "out"], timeout=180)
    error = one_error_line(run, f"refusing CIFAR-10 batch {data / 'data_batch_1'}", "system")
    assert "posix.system" in error or "os.system" in error
    assert not marker.exists(), "the pickle's code ran"


# ---------------------------------------------------------------- silent corruption
def flip_a_byte_in_the_largest_tensor(path):
    """A one-bit-class error where torch.load cannot notice it: inside tensor data."""
    with zipfile.ZipFile(path) as archive:
        largest = max((info for info in archive.infolist() if "/data/" in info.filename),
                      key=lambda info: info.file_size)
    with open(path, "r+b") as handle:
        handle.seek(largest.header_offset)
        header = handle.read(30)
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        where = largest.header_offset + 30 + name_length + extra_length + largest.file_size // 2
        handle.seek(where)
        byte = handle.read(1)
        handle.seek(where)
        handle.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_byte_in_a_checkpoint_is_caught_and_the_previous_one_used(tmp_path):
    out = tmp_path / "out"
    common = [CNN, "--output-dir", out, *QUICK_CNN, "--epochs", "1", "--checkpoint-every", "10"]
    ok(horovodrun(2, [*common, "--stop-after", "20"], timeout=180))
    newest = checkpoint_file(out, 20)
    # The sidecar is sha256sum's format.
    ok(launch(["sha256sum", "-c", checksum_file(newest).name], timeout=30, cwd=out))
    before = torch.load(newest, weights_only=True)["model"]
    flip_a_byte_in_the_largest_tensor(newest)
    after = torch.load(newest, weights_only=True)["model"]  # loads fine: only a checksum can tell
    assert any(not torch.equal(before[k], after[k]) for k in before)
    run = ok(horovodrun(2, [*common, "--stop-after", "25"], timeout=180))
    assert f"warning: checkpoint {newest} is damaged: sha256" in run.output, run.describe()
    assert "resuming at epoch 0 sample 320 (step 10)" in run.output, run.describe()
    assert set_aside(newest).is_file()
    assert checksum_file(set_aside(newest)).is_file()


# ---------------------------------------------------------------- BERT shards
@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    return make_small_static_data(tmp_path_factory.mktemp("integrity-bert"))


def damaged_copy(source, target, damage):
    shutil.copytree(source, target)
    metadata = json.loads((target / "metadata.json").read_text())
    damage(target, metadata)
    (target / "metadata.json").write_text(json.dumps(metadata))
    return target


def pretrain(data, out):
    return horovodrun(2, [PRETRAIN, "--data", data, "--output-dir", out, "--model", "tiny", "--batch-size", "4",
                          "--steps", "3"], timeout=240)


def test_a_damaged_bert_shard_is_named_on_every_rank(small_shards, tmp_path):
    def flip(directory, metadata):
        shard = directory / metadata["shards"][1]["file"]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))

    data = damaged_copy(small_shards, tmp_path / "data", flip)
    one_error_line(pretrain(data, tmp_path / "out"), "corrupt shard", "shard-00001.h5", "sha256 differs")


def test_a_foreign_shard_with_token_ids_beyond_the_vocabulary_is_named(small_shards, tmp_path):
    """Its checksum matches (re-recorded): only the value check stands between it and an
    IndexError on CPU or a device-side assert on a GPU."""
    def foreign(directory, metadata):
        entry = metadata["shards"][0]
        with h5py.File(directory / entry["file"], "r+") as handle:
            ids = handle["input_ids"][...]
            ids[0, 1] = metadata["vocab_size"] + 7
            handle["input_ids"][...] = ids
        from hvdtrain.data.bert_data import file_sha256
        entry["sha256"] = file_sha256(directory / entry["file"])

    data = damaged_copy(small_shards, tmp_path / "data", foreign)
    one_error_line(pretrain(data, tmp_path / "out"), "corrupt shard", "shard-00000.h5", "input_ids holds values",
                   "outside [0, ")


def test_shard_checksums_are_recorded(small_shards):
    metadata = json.loads((small_shards / "metadata.json").read_text())
    from hvdtrain.data.bert_data import file_sha256
    for entry in metadata["shards"]:
        assert entry["sha256"] == file_sha256(small_shards / entry["file"])


# ---------------------------------------------------------------- host names
HOSTILE = "node1;touch${IFS}MARKER"


@pytest.mark.parametrize("form", ["hostfile", "mpich-hostfile", "hosts", "slurm", "pbs", "lsf", "lsf-hosts",
                                  "discovery"])
def test_hostile_host_names_are_refused_in_every_input_form(tmp_path, form):
    """Host names end up in mpirun/horovodrun command lines: shell metacharacters never pass."""
    name = HOSTILE.replace("MARKER", str(tmp_path / "ran"))
    hostfile = tmp_path / "hosts"
    args, env = [], {}
    if form == "hostfile":
        hostfile.write_text(f"node0 slots=2\n{name} slots=2\n")
        args = ["--hostfile", hostfile]
    elif form == "mpich-hostfile":
        hostfile.write_text(f"node0:2\n{name}:2\n")
        args = ["--hostfile", hostfile]
    elif form == "hosts":
        args = ["--hosts", f"node0:2,{name}:2"]
    elif form == "slurm":
        args, env = ["--slurm"], {"SLURM_JOB_NODELIST": f"node0,{name}", "SLURM_TASKS_PER_NODE": "2(x2)"}
    elif form == "pbs":
        hostfile.write_text(f"node0\n{name}\n")
        args, env = ["--pbs"], {"PBS_NODEFILE": str(hostfile)}
    elif form == "lsf":
        args, env = ["--lsf"], {"LSB_MCPU_HOSTS": f"node0 2 {name} 2"}
    elif form == "lsf-hosts":
        args, env = ["--lsf"], {"LSB_HOSTS": f"node0 node0 {name}"}
    if form == "discovery":
        hostfile.write_text(f"node0 slots=2\n{name} slots=2\n")
        run = python([DISCOVER, hostfile], timeout=30, env=NO_ALLOCATION)
    else:
        run = make_hostfile(args, env)
    only_an_error_line(run, "node1;touch")  # the bad name is shown
