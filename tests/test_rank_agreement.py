"""Ranks launched with other settings or other data stop at start, naming the difference.

Real horovodrun launches in which each rank gets its own command line: a small
shell script picks it by the rank the launcher exports (HOROVOD_RANK under
--gloo, OMPI_COMM_WORLD_RANK under MPI), as a job script with a per-node
mistake would.
"""
import json
import shlex
import shutil
import sys
from types import SimpleNamespace

import pytest

from hvdtrain.runtime import consistency
from hvdtrain.data import images
from support.bert_data import make_small_static_data
from support.checks import ok, one_error_line
from support.commands import CNN, PRETRAIN, QUICK_CNN
from support.image_data import make_image_folder
from support.launch import launch

pytestmark = pytest.mark.usefixtures("need_horovod")

FOLDER_RUN = [*QUICK_CNN, "--dataset", "imagefolder", "--epochs", "1", "--batch-size", "2", "--workers", "0"]


def per_rank(tmp_path, commands, timeout=240):
    """``horovodrun -np N --gloo sh SCRIPT``: rank r runs ``python commands[r]``."""
    script = ['case "${HOROVOD_RANK:-$OMPI_COMM_WORLD_RANK}" in']
    script += [f"  {rank}) exec {shlex.join(map(str, [sys.executable, *args]))} ;;"
               for rank, args in enumerate(commands)]
    script += ["esac", "exit 99"]
    path = tmp_path / "per_rank.sh"
    path.write_text("\n".join(script) + "\n")
    return launch(["horovodrun", "-np", str(len(commands)), "--gloo", "sh", path], timeout=timeout)


def test_a_rank_with_another_lr_stops_every_rank(tmp_path):
    common = [CNN, *QUICK_CNN, "--epochs", "1", "--output-dir", tmp_path / "out"]
    run = per_rank(tmp_path, [[*common, "--lr", "0.1"], [*common, "--lr", "0.2"]])
    one_error_line(run, "rank 1 differs from rank 0: lr 0.2 vs 0.1")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # stopped before training


def test_a_rank_reading_another_image_folder_stops_every_rank(tmp_path):
    mine = make_image_folder(tmp_path / "a")
    other = make_image_folder(tmp_path / "b", train_per_class=5)
    common = [CNN, *FOLDER_RUN, "--output-dir", tmp_path / "out"]
    run = per_rank(tmp_path, [[*common, "--data", mine], [*common, "--data", other]])
    one_error_line(run, "rank 1 differs from rank 0:", "train_samples 15 vs 12")


def test_a_copy_of_the_same_images_at_another_path_is_fine(tmp_path):
    """Node-local copies may live at different paths: what they hold is compared."""
    mine = make_image_folder(tmp_path / "a")
    copy = shutil.copytree(mine, tmp_path / "elsewhere" / "copy")
    out = tmp_path / "out"
    common = [CNN, *FOLDER_RUN, "--output-dir", out]
    ok(per_rank(tmp_path, [[*common, "--data", mine], [*common, "--data", copy]]))
    assert json.loads((out / "results.json").read_text())["completed"]


def test_a_rank_reading_other_bert_shards_stops_every_rank(tmp_path):
    data = make_small_static_data(tmp_path)
    fewer = shutil.copytree(data, tmp_path / "fewer")  # one shard left out, still valid data
    metadata = json.loads((fewer / "metadata.json").read_text())
    dropped = metadata["shards"].pop()
    metadata["num_instances"] -= dropped["instances"]
    (fewer / "metadata.json").write_text(json.dumps(metadata))
    (fewer / dropped["file"]).unlink()
    common = [PRETRAIN, "--model", "tiny", "--batch-size", "2", "--steps", "2", "--output-dir", tmp_path / "out"]
    run = per_rank(tmp_path, [[*common, "--data", data], [*common, "--data", fewer]])
    total = metadata["num_instances"] + dropped["instances"]
    one_error_line(run, "rank 1 differs from rank 0:", f"num_instances {metadata['num_instances']} vs {total}",
                   "shards_sha256")


def test_disagreement_names_the_first_rank_and_each_difference():
    base = {"lr": 0.1, "model": "resnet20", "vocab_sha256": "a" * 64}
    assert consistency.disagreement([base, dict(base), dict(base)]) is None
    message = consistency.disagreement([base, dict(base), {**base, "lr": 0.2, "vocab_sha256": "b" * 64},
                                        {**base, "model": "resnet50"}])
    assert message.startswith(f"rank 2 differs from rank 0: lr 0.2 vs 0.1, vocab_sha256 {'b' * 12} vs {'a' * 12} "
                              "(and 1 more rank);"), message


def test_fingerprint_leaves_out_only_per_node_paths():
    settings = {"data": "/local/a", "threads": 4, "lr": 0.1, "output_dir": "/shared/run"}
    assert consistency.fingerprint(settings, {"val_samples": 3}) == \
        {"lr": 0.1, "output_dir": "/shared/run", "val_samples": 3}


def test_image_folder_facts_see_a_renamed_file_but_not_the_folder_s_path(tmp_path):
    from hvdtrain.training.cnn import data_facts

    def facts(root):
        train_set, val_set, _, _ = images.image_folder(root, 8, 0)
        return data_facts(SimpleNamespace(data=str(root)), train_set, val_set)

    mine = make_image_folder(tmp_path / "a")
    copy = shutil.copytree(mine, tmp_path / "b")
    assert facts(mine) == facts(copy)
    (copy / "train" / "cat" / "0.jpg").rename(copy / "train" / "cat" / "renamed.jpg")
    assert facts(mine)["image_files_sha256"] != facts(copy)["image_files_sha256"]
