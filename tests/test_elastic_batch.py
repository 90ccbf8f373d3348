"""--elastic --global-batch N: a step trains N samples at every world size, so a resize changes nothing
in the optimisation: the weights equal those of a run that never resized."""
import json

import torch

from support.checks import ok
from support.commands import CNN
from support.elastic_jobs import elastic_command, world_sizes, write_hosts
from support.launch import launch, python, wait_then

RUN = [CNN, "--elastic", "--model", "convnet", "--epochs", "3", "--batch-size", "16",
       "--lr", "0.01", "--global-batch", "32", "--elastic-commit-every", "5"]
# A small LR: at 0.1 the first epoch sits on a plateau where float rounding of the
# sum order (2 x 16 against 1 x 32) grows to 1e-4 by step 45 with or without a resize.


def newest_checkpoint(out):
    return max(out.glob("step-*.pt"))


def test_a_job_shrunk_mid_run_trains_the_weights_of_one_that_never_resized(need_horovod, tmp_path):
    resized, steady = tmp_path / "resized", tmp_path / "steady"
    hosts = tmp_path / "hosts"
    write_hosts(hosts, "localhost slots=1", "127.0.0.1 slots=1")
    # After the first epoch discovery stops listing 127.0.0.1: the job goes on with one worker.
    wait_then(lambda: (resized / "metrics.jsonl").exists(), lambda: write_hosts(hosts, "localhost slots=1"), 240)
    ran = ok(launch(elastic_command(hosts, 2, [*RUN, "--output-dir", resized]), timeout=300))
    assert world_sizes(ran)[0] == 2 and world_sizes(ran)[-1] == 1, ran.describe()
    assert ran.output.count("global batch 32") == len(world_sizes(ran)), ran.describe()

    alone = tmp_path / "alone-hosts"
    write_hosts(alone, "localhost slots=1")
    ok(launch(elastic_command(alone, 1, [*RUN, "--output-dir", steady]), timeout=300))
    assert newest_checkpoint(resized).name == newest_checkpoint(steady).name
    weights = [torch.load(newest_checkpoint(out), weights_only=True)["model"] for out in (resized, steady)]
    for key, value in weights[1].items():
        torch.testing.assert_close(weights[0][key], value, rtol=0, atol=1e-5, msg=lambda m: f"{key}: {m}")
    rows = [json.loads(line) for line in (resized / "metrics.jsonl").read_text().splitlines()]
    assert [row["train_samples"] for row in rows] == [1438] * 3, rows


def test_global_batch_needs_elastic(tmp_path):
    run = python([CNN, "--global-batch", "64", "--output-dir", tmp_path], timeout=120)
    assert run.returncode == 2 and "--global-batch keeps a step's samples fixed" in run.output, run.describe()
