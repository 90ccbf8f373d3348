"""BERT end to end with real launches: data prep (single and mpirun), pretraining on
2 Horovod ranks, export, resume, phase 2, preemption signals, bad input."""
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from support.bert_data import make_small_static_data
from support.checkpoints import checkpoint_files, checkpoint_name, checkpoint_names
from support.checks import ok, one_error_line, succeeded
from support.commands import PREPARE, PRETRAIN, with_heavy_modules
from support.launch import horovodrun, launch, python
from support.needs import require_module
from support.ranks import rank_pids
from support.weights import checkpoint_at

# Small enough for 2 shared cores, large enough to show real learning.
SMALL_DATA = ["--max-seq-length", "64", "--vocab-size", "4000", "--dupe-factor", "2", "--num-shards", "4"]
TINY_RUN = ["--model", "tiny", "--batch-size", "16", "--log-every", "10"]
PRETRAINED_STEPS = 300  # the MLM loss: 0.65 of its start at 300 steps, 0.68 at 120 and 160 (measured 2026-11-27)


def need_mpi4py():
    require_module("mpi4py")


def results(directory):
    return json.loads((Path(directory) / "results.json").read_text())


def metrics(directory):
    return [json.loads(line) for line in (Path(directory) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The embedded corpus, prepared once (dynamic masking)."""
    directory = tmp_path_factory.mktemp("bert") / "data"
    succeeded(python([PREPARE, "--output-dir", directory, *SMALL_DATA], timeout=120))
    return directory


@pytest.fixture(scope="module")
def small_static_data(tmp_path_factory):
    return make_small_static_data(tmp_path_factory.mktemp("bert-small"))


@pytest.fixture(scope="module")
def pretrained(data_dir, tmp_path_factory):
    """The headline run: 2 Horovod ranks, tiny BERT, PRETRAINED_STEPS steps."""
    output = tmp_path_factory.mktemp("bert-run") / "run"
    run = succeeded(horovodrun(2, [PRETRAIN, "--data", data_dir, "--output-dir", output, *TINY_RUN,
                                   "--steps", PRETRAINED_STEPS, "--lr", "1e-2",
                                   "--checkpoint-every", PRETRAINED_STEPS // 2], timeout=900))
    return output, run


# ----------------------------------------------------------------------------- data preparation

@pytest.mark.parametrize("source", ["embedded corpus", "unequal text files", "one large file"])
def test_prepare_under_mpirun_writes_the_single_process_shards(source, tmp_path, need_mpi):
    """Issue 9: shards used to follow each rank's input (896, 378, 902, ... instances)."""
    need_mpi4py()
    args = ["--max-seq-length", "64", "--vocab-size", "600", "--dupe-factor", "1", "--num-shards", "8",
            "--masking", "static", "--seed", "3"]
    ranks = 2
    if source == "unequal text files":  # 12 files of 1 to 34 documents on 3 ranks
        from hvdtrain.data.bert_corpus import default_corpus_documents
        documents = default_corpus_documents()
        (tmp_path / "text").mkdir()
        for part in range(12):
            text = "\n\n".join("\n".join(d) for d in documents[part::12][:1 + 3 * part])
            (tmp_path / "text" / f"part{part:02d}.txt").write_text(text + "\n")
        args += ["--input", tmp_path / "text"]
        ranks = 3
    if source == "one large file":  # every rank tokenizes a part of it, not just the first
        from hvdtrain.data.bert_corpus import default_corpus_documents
        (tmp_path / "corpus.txt").write_text("\n\n".join("\n".join(d) for d in default_corpus_documents()) + "\n")
        args += ["--input", tmp_path / "corpus.txt"]
        ranks = 3
    succeeded(python([PREPARE, "--output-dir", tmp_path / "one", *args], timeout=120))
    many_run = succeeded(launch(["mpirun", "--oversubscribe", "-np", str(ranks), sys.executable, PREPARE,
                          "--output-dir", tmp_path / "many", *args], timeout=180))
    per_rank = re.search(r"documents tokenized per rank: ([\d ]+)\)", many_run.output).group(1).split()
    assert len(per_rank) == ranks and all(int(count) > 0 for count in per_rank), per_rank
    one = json.loads((tmp_path / "one" / "metadata.json").read_text())
    many = json.loads((tmp_path / "many" / "metadata.json").read_text())
    assert many["world_size"] == ranks and one["world_size"] == 1
    assert one["num_instances"] > 1000
    sizes = [shard["instances"] for shard in many["shards"]]
    assert max(sizes) - min(sizes) <= 1, sizes
    assert many["shards"] == one["shards"]  # the same files, byte for byte (sha256)
    assert not list((tmp_path / "many").glob(".*")), "scratch files left behind"


# ----------------------------------------------------------------------------- pretraining

def test_pretraining_on_two_ranks_learns_and_exports(pretrained):
    output, run = pretrained
    result = results(output)
    assert result["world_size"] == 2 and result["steps"] == PRETRAINED_STEPS and result["completed"]
    print(f"MLM loss {result['initial_mlm_loss']:.2f} -> {result['final_mlm_loss']:.2f} in {PRETRAINED_STEPS} steps")
    assert result["final_mlm_loss"] <= 0.7 * result["initial_mlm_loss"], result
    assert result["mlm_accuracy"] > 0.05 and result["nsp_accuracy"] > 0.5
    assert result["sequences_per_sec"] > 0 and result["tokens_per_sec"] > 0
    rows = metrics(output)
    assert [r["step"] for r in rows][:2] == [1, 10] and rows[-1]["step"] == PRETRAINED_STEPS
    assert checkpoint_names(output) == [
        checkpoint_name(PRETRAINED_STEPS // 2), checkpoint_name(PRETRAINED_STEPS)]

    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import BertForMaskedLM, pipeline
    model = BertForMaskedLM.from_pretrained(output / "model")
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 2
    fill = pipeline("fill-mask", model=str(output / "model"), tokenizer=str(output / "model"))
    predictions = fill("the [MASK] statement is used to raise an exception.")
    assert len(predictions) == 5 and all(p["token_str"] for p in predictions)


def test_resume_is_bit_exact(small_static_data, tmp_path):
    """Uninterrupted 8 steps == 3 steps, stop, resume to 8 (crossing an epoch boundary)."""
    common = [PRETRAIN, "--data", small_static_data, "--model", "tiny", "--batch-size", "4",
              "--accumulation-steps", "2", "--steps", "8", "--log-every", "1", "--checkpoint-every", "0"]
    succeeded(horovodrun(2, [*common, "--output-dir", tmp_path / "whole"], timeout=180))
    succeeded(horovodrun(2, [*common, "--output-dir", tmp_path / "parts", "--stop-after", "3"], timeout=180))
    assert results(tmp_path / "parts")["completed"] is False
    # Mid-epoch, each rank read its own share of the shards: no other number of ranks can go on.
    one_error_line(horovodrun(1, [*common, "--output-dir", tmp_path / "parts"], timeout=180),
                   "cannot resume 2 ranks' checkpoint in", "on 1: its epoch 0 is in progress", "--global-batch")
    second = succeeded(horovodrun(2, [*common, "--output-dir", tmp_path / "parts"], timeout=180))
    assert "resumed from" in second.output and "at step 3" in second.output, second.describe()
    # Relaunching the finished run: said before any model is built, so without transformers.
    again, loaded = with_heavy_modules([*common, "--output-dir", tmp_path / "parts"], timeout=180, np=2)
    assert "holds a finished run (step 8)" in again.output and "transformers" not in loaded, (loaded, again.describe())

    whole = checkpoint_at(tmp_path / "whole", 8)
    parts = checkpoint_at(tmp_path / "parts", 8)
    whole_at, parts_at = whole["train_state"], parts["train_state"]
    assert whole_at["epoch"] >= 1, "the run should cross an epoch boundary"
    assert (whole_at["epoch"], whole_at["step_in_epoch"]) == (parts_at["epoch"], parts_at["step_in_epoch"])
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, parts["model"][name]), name
    for key, state in whole["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, parts["optimizer"]["state"][key][name]), (key, name)
    assert metrics(tmp_path / "whole") == metrics(tmp_path / "parts")
    assert len(metrics(tmp_path / "whole")) == 8


def test_phase2_starts_from_phase1_weights_with_longer_sequences(pretrained, data_dir, tmp_path):
    phase1, _ = pretrained
    succeeded(python([PREPARE, "--output-dir", tmp_path / "data128", "--max-seq-length", "128", "--vocab",
               data_dir / "tokenizer", "--dupe-factor", "1", "--num-shards", "2", "--bin-size", "32"], timeout=120))
    meta = json.loads((tmp_path / "data128" / "metadata.json").read_text())
    assert meta["vocab_sha256"] == json.loads((data_dir / "metadata.json").read_text())["vocab_sha256"]
    assert [len(shard["bins"]) for shard in meta["shards"]] == [4, 4]  # phase 2 trains length-binned
    run = succeeded(horovodrun(2, [PRETRAIN, "--data", tmp_path / "data128", "--init-checkpoint", phase1,
                            "--max-seq-length", "128", "--batch-size", "8", "--steps", "3", "--log-every", "1",
                            "--output-dir", tmp_path / "phase2"], timeout=180))
    assert "initialised from" in run.output and f"its step {PRETRAINED_STEPS}" in run.output, run.describe()
    state = checkpoint_at(tmp_path / "phase2", 3)
    assert state["train_state"]["step"] == 3 and state["settings"]["max_seq_length"] == 128
    assert state["bert_config"]["hidden_size"] == 128
    phase1_start = results(phase1)["initial_mlm_loss"]
    phase2_start = results(tmp_path / "phase2")["initial_mlm_loss"]
    assert phase2_start < 0.85 * phase1_start, (phase1_start, phase2_start)  # trained weights, not random ones


def test_continued_pretraining_from_a_hugging_face_directory(pretrained, small_static_data, tmp_path):
    """A BERT saved by transformers itself (BertForMaskedLM.save_pretrained and its tokenizer's: no NSP
    head), a domain corpus prepared with its vocabulary, pretraining continued from its weights on 2
    ranks; the export loads back in transformers."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import BertForMaskedLM, BertForPreTraining, BertTokenizerFast
    phase1, _ = pretrained
    existing = tmp_path / "existing-bert"
    BertForMaskedLM.from_pretrained(phase1 / "model").save_pretrained(existing)
    BertTokenizerFast.from_pretrained(phase1 / "model").save_pretrained(existing)
    from hvdtrain.data.bert_corpus import default_corpus_documents
    domain = "\n\n".join("\n".join(document[:40]) for document in default_corpus_documents()[8:40])
    (tmp_path / "domain.txt").write_text(domain + "\n")
    succeeded(python([PREPARE, "--input", tmp_path / "domain.txt", "--vocab", existing, "--max-seq-length", "64",
                      "--dupe-factor", "1", "--num-shards", "2", "--output-dir", tmp_path / "domain"], timeout=120))
    run = ok(horovodrun(2, [PRETRAIN, "--data", tmp_path / "domain", "--init-checkpoint", existing,
                                   "--batch-size", "8", "--steps", "3", "--log-every", "1",
                                   "--output-dir", tmp_path / "continued"], timeout=240))
    assert (f"initialised from {existing} (a Hugging Face model; bert.pooler, cls.seq_relationship freshly initialised)"
            in run.output), run.describe()
    assert checkpoint_at(tmp_path / "continued", 3)["bert_config"]["hidden_size"] == 128
    assert results(tmp_path / "continued")["initial_mlm_loss"] < 0.85 * results(phase1)["initial_mlm_loss"]
    exported = BertForPreTraining.from_pretrained(tmp_path / "continued" / "model")
    assert exported.config.vocab_size == BertForMaskedLM.from_pretrained(existing).config.vocab_size
    # A corpus prepared with another vocabulary is refused in one line.
    one_error_line(python([PRETRAIN, "--data", small_static_data, "--init-checkpoint", existing, "--steps", "1",
                           "--output-dir", tmp_path / "other"], timeout=240),
                   f"--init-checkpoint {existing} was trained with a different vocabulary than the shards")


@pytest.mark.scale  # the CNN's in make test (test_train_cnn.py): both trainers stop through runtime/signals.py
def test_signal_to_one_rank_checkpoints_every_rank_and_resumes(data_dir, tmp_path):
    """SIGUSR1 (Slurm's warning before the time limit) to rank 1 only: both ranks stop together."""
    output = tmp_path / "preempted"
    args = [PRETRAIN, "--data", data_dir, "--output-dir", output, *TINY_RUN, "--steps", "1000",
            "--log-every", "1", "--checkpoint-every", "0"]
    sent = []

    def preempt():
        deadline = time.time() + 150
        while time.time() < deadline and not sent:
            if (output / "metrics.jsonl").exists() and len((output / "metrics.jsonl").read_text().splitlines()) >= 3:
                for pid in rank_pids(str(output), rank=1):
                    os.kill(pid, signal.SIGUSR1)
                    sent.append(pid)
            time.sleep(0.2)

    sender = threading.Thread(target=preempt, daemon=True)
    sender.start()
    run = succeeded(horovodrun(2, args, timeout=240))
    sender.join()
    assert sent, "found no rank-1 process to signal"
    assert "stopped by SIGUSR1 (rank 1) at step" in run.output, run.describe()
    (saved,) = checkpoint_files(output)
    stopped_at = torch.load(saved, weights_only=True)["train_state"]["step"]
    assert 3 <= stopped_at < 1000 and stopped_at % 10 == 0  # checked every --stop-check-every steps
    assert results(output)["completed"] is False and results(output)["steps"] == stopped_at

    resumed = succeeded(horovodrun(2, [*args, "--stop-after", str(stopped_at + 2)], timeout=180))
    assert f"at step {stopped_at}" in resumed.output, resumed.describe()
    assert [r["step"] for r in metrics(output)][-2:] == [stopped_at + 1, stopped_at + 2]


# ----------------------------------------------------------------------------- bad input

def test_bad_inputs_single_process(data_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 999, "hidden_size": 64,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2}))
    base = ["--output-dir", tmp_path / "out", "--steps", "2"]
    cases = [
        (["--data", tmp_path / "absent", "--model", "tiny"], ["data directory not found"]),
        (["--data", tmp_path / "empty", "--model", "tiny"], ["no shards", "metadata.json"]),
        (["--data", data_dir, "--model", "huge"], ["unknown model preset 'huge'"]),
        (["--data", data_dir, "--model", "tiny", "--max-seq-length", "128"], ["max_seq_length 64", "128"]),
        (["--data", data_dir, "--config", tmp_path / "config.json"], ["vocab_size 999", "4000"]),
        (["--data", data_dir, "--model", "tiny", "--batch-size", "100000"], ["not enough for one step"]),
        (["--data", shards_with_another_vocabulary(data_dir, tmp_path / "retokenized"), "--model", "tiny"],
         ["is not the vocabulary the shards were made with"]),
    ]
    for args, fragments in cases:
        one_error_line(python([PRETRAIN, *args, *base], timeout=120), *fragments)
    one_error_line(python([PREPARE, "--input", tmp_path / "nothing.txt", "--output-dir", tmp_path / "d"],
                          timeout=60), "input not found")
    (tmp_path / "one.txt").write_text("A single document.\nWith two sentences.\n")
    one_error_line(python([PREPARE, "--input", tmp_path / "one.txt", "--vocab", data_dir / "tokenizer",
                           "--output-dir", tmp_path / "d"], timeout=60), "1 non-empty document", "at least 2")


def shards_with_another_vocabulary(data_dir, directory):
    """``data_dir``'s shards (linked) with a tokenizer whose token 1000 is renamed."""
    directory.mkdir()
    for item in data_dir.iterdir():
        if item.name != "tokenizer":
            (directory / item.name).symlink_to(item)
    shutil.copytree(data_dir / "tokenizer", directory / "tokenizer")
    tokenizer = json.loads((directory / "tokenizer" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["zzz-renamed"] = vocab.pop(next(token for token, index in vocab.items() if index == 1000))
    (directory / "tokenizer" / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def test_nvlamb_without_lamb_is_a_one_line_error(tmp_path):
    run = python([PRETRAIN, "--data", tmp_path, "--optimizer", "adamw", "--lamb-nvlamb"], timeout=120)
    one_error_line(run, "--lamb-nvlamb only applies to --optimizer lamb")


def test_bad_inputs_stop_every_rank(data_dir, small_static_data, pretrained, tmp_path, need_mpi):
    """Problems only some ranks see: every rank exits 2 with one line, no hang."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in data_dir.iterdir():
        (broken / item.name).symlink_to(item)
    shard = broken / "shard-00003.h5"
    shard.unlink()
    shard.write_bytes((data_dir / "shard-00003.h5").read_bytes()[:2000])  # checked by rank 1 only
    mpirun = ["mpirun", "-np", "2", sys.executable, PRETRAIN, "--model", "tiny", "--steps", "2"]
    run = launch([*mpirun, "--data", broken, "--output-dir", tmp_path / "a"], timeout=120)
    one_error_line(run, "corrupt shard", str(shard))

    phase1, _ = pretrained  # trained on another vocabulary than small_static_data's
    run = launch([*mpirun, "--data", small_static_data, "--init-checkpoint", phase1,
                  "--output-dir", tmp_path / "b"], timeout=120)
    one_error_line(run, "different vocabulary")
